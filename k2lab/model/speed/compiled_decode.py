"""Speed room: the compiled decode step of ``generate(compile=True)``; the prefill stays eager (its products are large
and its shapes change from prompt to prompt).

- On one CUDA device: the static step (static_decode.py) compiled with ``mode="reduce-overhead"``: inductor's kernels
  for the whole step are captured as one CUDA graph and replayed at every step, one launch where the eager step makes
  hundreds, each waited for by the host.
- Elsewhere (the CPU, a model spread over devices): ``torch.compile(model, dynamic=True)``, the model's own forward,
  one graph for every cache length (the length is a symbol; generate reserves the cache's storage up front, so no
  step grows it).

Both compile with ``fullgraph=True``: the step is one graph or an error, never a silent break, so nothing inside it
reads a value back to the host. What cannot be compiled runs eagerly, after a warning that names why (``eager_reason``):
a model something observes (hooks cannot run inside a graph), experts made from files as they run (streamed), or a model
whose speed rooms are off (``K2Model.speed``: compiling is one of them). So does a step past torch.compile's recompile
limit (``torch._dynamo.config.recompile_limit`` graphs of one function, 8 by default: as many models, dtypes or batch
sizes in one process), which ``fullgraph=True`` turns from a silent eager fallback into an error. """

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..attention import AttnImpl, LatentCache, choose_attn_impl
from ..moe import MoE
from .static_decode import StaticCache, static_decode_step

if TYPE_CHECKING:
    from ..transformer import K2Model


def eager_reason(model: K2Model) -> str | None:
    """Why ``model``'s decode step cannot be compiled whole (None: it can)."""
    if not model.speed:
        return "the speed rooms are off (model.speed is False), and a compiled step is one of them"
    if model.is_observed():
        return ("something observes this model (model.is_observed(): a hook on a probe or module, a wrapper such as "
                "nnsight's, a spliced module), and hooks cannot run inside a compiled graph; detach it "
                "(model.reset_hooks() for k2lab's hooks) to compile")
    for i, layer in enumerate(model.layers):
        experts = layer.mlp.experts if isinstance(layer.mlp, MoE) else None
        if experts is not None and not experts.indexable:
            return (f"layer {i}'s routed experts ({type(experts).__name__}) make each expert's matrices as it runs "
                    "(streamed from files), which a compiled step cannot read by index")
    return None


def compiled_decode_step(model: K2Model, cache: LatentCache, attn_impl: AttnImpl) -> Callable[[torch.Tensor],
                                                                                             torch.Tensor]:
    """The decode step after a prefill into ``cache``: new ids [B, 1] -> float32 logits [B, 1, V], compiled (the first
    call compiles: tens of seconds). The logits of a CUDA graph are overwritten by the next step: read them first."""
    devices = {layer.input_layernorm.weight.device for layer in model.layers} | {model.device}
    model.rotary.grow(model.device, cache.storage[0].shape[1])  # every position the step reaches, before the graph
    if devices == {cache.device} and cache.device.type == "cuda":
        static = StaticCache(model, cache)
        path = choose_attn_impl(attn_impl, 1, cache.length, model.config.kv_lora_rank)
        graph = torch.compile(static_decode_step, fullgraph=True, mode="reduce-overhead")

        def replay(ids: torch.Tensor) -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are no longer read
            return graph(model, ids, static, path)

        return eager_past_the_limit(replay, lambda ids: static_decode_step(model, ids, static, path))
    compiled = torch.compile(model, dynamic=True, fullgraph=True)  # dynamic: one graph for every cache length
    return eager_past_the_limit(lambda ids: compiled(ids, cache=cache, attn_impl=attn_impl, attention_mask=None),
                                lambda ids: model(ids, cache=cache, attn_impl=attn_impl))


def eager_past_the_limit(compiled: Callable[[torch.Tensor], torch.Tensor],
                         eager: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``compiled``, until torch.compile refuses to compile one more graph of the step (its recompile limit): from
    then on ``eager``, after a warning that says why. The refusal comes before the step runs, so nothing ran twice."""
    over_limit = False

    def step(ids: torch.Tensor) -> torch.Tensor:
        nonlocal over_limit
        if not over_limit:
            try:
                return compiled(ids)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                over_limit = True
                warnings.warn("generate(compile=True) runs eagerly from here: torch.compile has compiled "
                              f"torch._dynamo.config.recompile_limit ({torch._dynamo.config.recompile_limit}) graphs "
                              "of this decode step in this process (one per model, dtype or batch size); raise the "
                              "limit or call torch._dynamo.reset() to compile again", UserWarning, stacklevel=5)
        return eager(ids)

    return step
