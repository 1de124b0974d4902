"""The Kimi K2 architecture in PyTorch: YaRN RoPE, multi-head latent attention with its latent cache, the sigmoid
router and routed experts, the decoder stack and decoding. It knows no checkpoint format, no figure library and
no analysis: ``k2lab.weights`` fills it, ``k2lab.analysis`` reads it."""

from .attention import AttnImpl, LatentCache, MultiHeadLatentAttention
from .generate import generate
from .hooks import HookPoint, get_act_name
from .transformer import K2Model

__all__ = ["AttnImpl", "HookPoint", "K2Model", "LatentCache", "MultiHeadLatentAttention", "generate", "get_act_name"]
