"""The Kimi K2 architecture in PyTorch: YaRN RoPE, multi-head latent attention with its latent cache, the sigmoid
router and routed experts, the decoder stack and decoding. It knows no checkpoint format, no figure library and
no analysis: ``k2lab.weights`` fills it, ``k2lab.analysis`` reads it.

The reading path, in the order a forward runs it (a plain forward calls nothing else):

    transformer.py   K2Model: embed, the blocks (attention, then the dense or MoE feed-forward), final norm, head
    inputs.py        what a forward is given -> what every block shares: ids, pads, positions, the rotary table
    rope.py          YaRN's rotary frequencies and the cos/sin table they make
    attention.py     multi-head latent attention, naive and absorbed, and the latent KV cache
    moe.py           the sigmoid router with its correction bias, the routed experts, the shared expert
    layers.py        Linear, RMSNorm, SwiGLU, and HookPoint (the identity a probe hangs on)

Beside it: ``hooks.py`` (naming, selecting and attaching probes, ``run_with_cache``), ``activation_cache.py`` (what
``run_with_cache`` recorded, and the residual-stream analyses), ``generate.py`` (decoding through the latent cache),
``devices.py`` (a device argument checked against the devices this machine has).
``speed/`` holds every module that exists only for speed, each called from the reading path in one line;
``model.speed = False`` turns them all off.
"""

from .activation_cache import ActivationCache
from .attention import AttnImpl, LatentCache, MultiHeadLatentAttention
from .generate import generate
from .hooks import get_act_name
from .inputs import Inputs, prepare_inputs
from .layers import HookPoint
from .moe import Experts, MoE, RoutedExperts, Router
from .transformer import K2Model

__all__ = [
    "ActivationCache", "AttnImpl", "Experts", "HookPoint", "Inputs", "K2Model", "LatentCache", "MoE",
    "MultiHeadLatentAttention", "RoutedExperts", "Router", "generate", "get_act_name", "prepare_inputs",
]
