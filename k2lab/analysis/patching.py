"""Activation patching sweeps, TransformerLens's ``transformer_lens.patching`` names and shapes, for K2.

    _, clean_cache = model.run_with_cache(clean_ids, names=["hook_resid_pre", "self_attn.hook_z"])
    metric = lambda logits: logits[:, -1, good].sum() - logits[:, -1, bad].sum()     # -> a scalar tensor
    effect = k2lab.patching.get_act_patch_resid_pre(model, corrupted_ids, clean_cache, metric)   # [L, T]
    heads = k2lab.patching.get_act_patch_attn_head_out_all_pos(model, corrupted_ids, clean_cache, metric)  # [L, H]

Each cell of a result is one forward of ``corrupted_tokens`` with one activation of the clean run copied in (at every
row of the batch, as TransformerLens does), and holds ``metric(logits)`` of that forward: the same number as

    with interventions.patch(model, clean_cache, f"layers.{layer}.hook_resid_pre", positions=[t]):
        metric(model(corrupted_tokens))

Normalise it yourself (e.g. (cell - metric_corrupted) / (metric_clean - metric_corrupted)). Probe per sweep:

    get_act_patch_resid_pre / _resid_mid / _attn_out / _mlp_out   hook_resid_pre, ...           -> [L, T]
    get_act_patch_block_every                                     resid_pre, attn_out, mlp_out  -> [3, L, T]
    get_act_patch_attn_head_out_all_pos                           self_attn.hook_z, one head    -> [L, H]
    get_act_patch_attn_head_out_by_pos                            self_attn.hook_z, head at t   -> [L, T, H]
    get_act_patch_routed_out                                      mlp.hook_routed_out           -> [L, T]
    get_act_patch_expert_choice                                   mlp.gate.hook_topk_idx        -> [L, T]

The last two are K2's own. ``routed_out`` is the weighted sum of the chosen experts (without the shared expert).
``expert_choice`` copies only which experts the clean run chose: the router of the patched run then weighs those
experts from its own sigmoid scores (see ``interventions``), so the cell asks "does it matter *who* computes here?",
apart from how much each is trusted. Their rows for dense layers (K2: layer 0) are NaN, so row i is layer i in every
result and the tensors line up for plotting; ``torch.nanmean`` and friends skip them.

Shapes: L layers, T positions, H heads (all along the corrupted run's [B, T]). ``attention_mask`` [B, T] goes to every
patched forward; record ``clean_cache`` with the same one. Sweeps run under ``torch.no_grad``; ``progress`` shows a tqdm
bar (None: when a sweep runs more than ``LONG_SWEEP`` forwards).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from ..model.moe import MoE

if TYPE_CHECKING:
    from ..model.hooks import HookPoint
    from ..model.transformer import K2Model

Metric = Callable[[torch.Tensor], torch.Tensor]  # logits [B, T, V] -> a scalar tensor
LONG_SWEEP = 100  # forwards above which progress=None shows a bar


def get_act_patch_resid_pre(model: K2Model, corrupted_tokens: torch.Tensor, clean_cache: Mapping[str, torch.Tensor],
                            metric: Metric, *, attention_mask: torch.Tensor | None = None,
                            progress: bool | None = None) -> torch.Tensor:
    """[L, T]: ``metric`` with the clean ``layers.{l}.hook_resid_pre`` (the block's input) at position t."""
    return _sweep(model, corrupted_tokens, clean_cache, metric, "hook_resid_pre", by_position=True,
                  attention_mask=attention_mask, progress=progress)


def get_act_patch_resid_mid(model: K2Model, corrupted_tokens: torch.Tensor, clean_cache: Mapping[str, torch.Tensor],
                            metric: Metric, *, attention_mask: torch.Tensor | None = None,
                            progress: bool | None = None) -> torch.Tensor:
    """[L, T]: ``metric`` with the clean ``layers.{l}.hook_resid_mid`` (after attention) at position t."""
    return _sweep(model, corrupted_tokens, clean_cache, metric, "hook_resid_mid", by_position=True,
                  attention_mask=attention_mask, progress=progress)


def get_act_patch_attn_out(model: K2Model, corrupted_tokens: torch.Tensor, clean_cache: Mapping[str, torch.Tensor],
                           metric: Metric, *, attention_mask: torch.Tensor | None = None,
                           progress: bool | None = None) -> torch.Tensor:
    """[L, T]: ``metric`` with the clean ``layers.{l}.hook_attn_out`` (attention's write) at position t."""
    return _sweep(model, corrupted_tokens, clean_cache, metric, "hook_attn_out", by_position=True,
                  attention_mask=attention_mask, progress=progress)


def get_act_patch_mlp_out(model: K2Model, corrupted_tokens: torch.Tensor, clean_cache: Mapping[str, torch.Tensor],
                          metric: Metric, *, attention_mask: torch.Tensor | None = None,
                          progress: bool | None = None) -> torch.Tensor:
    """[L, T]: ``metric`` with the clean ``layers.{l}.hook_mlp_out`` (dense SwiGLU, or routed + shared experts) at
    position t."""
    return _sweep(model, corrupted_tokens, clean_cache, metric, "hook_mlp_out", by_position=True,
                  attention_mask=attention_mask, progress=progress)


def get_act_patch_block_every(model: K2Model, corrupted_tokens: torch.Tensor,
                              clean_cache: Mapping[str, torch.Tensor], metric: Metric, *,
                              attention_mask: torch.Tensor | None = None, progress: bool | None = None
                              ) -> torch.Tensor:
    """[3, L, T]: the resid_pre, attn_out and mlp_out sweeps stacked, in that order (TransformerLens's)."""
    sweeps = (get_act_patch_resid_pre, get_act_patch_attn_out, get_act_patch_mlp_out)
    return torch.stack([sweep(model, corrupted_tokens, clean_cache, metric, attention_mask=attention_mask,
                              progress=progress) for sweep in sweeps])


def get_act_patch_attn_head_out_all_pos(model: K2Model, corrupted_tokens: torch.Tensor,
                                        clean_cache: Mapping[str, torch.Tensor], metric: Metric, *,
                                        attention_mask: torch.Tensor | None = None, progress: bool | None = None
                                        ) -> torch.Tensor:
    """[L, H]: ``metric`` with head h's clean output ``layers.{l}.self_attn.hook_z[:, :, h]`` at every position (the
    other heads keep this run's)."""
    return _sweep(model, corrupted_tokens, clean_cache, metric, "self_attn.hook_z", by_position=False, by_head=True,
                  attention_mask=attention_mask, progress=progress)


def get_act_patch_attn_head_out_by_pos(model: K2Model, corrupted_tokens: torch.Tensor,
                                       clean_cache: Mapping[str, torch.Tensor], metric: Metric, *,
                                       attention_mask: torch.Tensor | None = None, progress: bool | None = None
                                       ) -> torch.Tensor:
    """[L, T, H]: ``metric`` with head h's clean output ``layers.{l}.self_attn.hook_z[:, t, h]`` at position t
    only."""
    return _sweep(model, corrupted_tokens, clean_cache, metric, "self_attn.hook_z", by_position=True, by_head=True,
                  attention_mask=attention_mask, progress=progress)


def get_act_patch_routed_out(model: K2Model, corrupted_tokens: torch.Tensor, clean_cache: Mapping[str, torch.Tensor],
                             metric: Metric, *, attention_mask: torch.Tensor | None = None,
                             progress: bool | None = None) -> torch.Tensor:
    """[L, T]: ``metric`` with the clean ``layers.{l}.mlp.hook_routed_out`` (the weighted sum of the chosen experts;
    the shared expert keeps this run's) at position t. Dense layers' rows are NaN."""
    return _sweep(model, corrupted_tokens, clean_cache, metric, "mlp.hook_routed_out", by_position=True,
                  moe_only=True, attention_mask=attention_mask, progress=progress)


def get_act_patch_expert_choice(model: K2Model, corrupted_tokens: torch.Tensor,
                                clean_cache: Mapping[str, torch.Tensor], metric: Metric, *,
                                attention_mask: torch.Tensor | None = None, progress: bool | None = None
                                ) -> torch.Tensor:
    """[L, T]: ``metric`` with the clean run's chosen experts ``layers.{l}.mlp.gate.hook_topk_idx`` at position t.
    The router weighs them from this run's scores, w = s[idx] / (sum + 1e-20) * routed_scaling_factor, and they run
    on this run's input: only the choice is clean. Dense layers' rows are NaN."""
    return _sweep(model, corrupted_tokens, clean_cache, metric, "mlp.gate.hook_topk_idx", by_position=True,
                  moe_only=True, attention_mask=attention_mask, progress=progress)


@torch.no_grad()
def _sweep(model: K2Model, corrupted_tokens: torch.Tensor, clean_cache: Mapping[str, torch.Tensor], metric: Metric,
           probe: str, *, by_position: bool, by_head: bool = False, moe_only: bool = False,
           attention_mask: torch.Tensor | None = None, progress: bool | None = None) -> torch.Tensor:
    """The engine of every sweep: ``metric`` of one patched forward per cell, in a float tensor
    [L, T if by_position, H if by_head] (NaN rows at dense layers when ``moe_only``).

    ``probe`` is the path inside a layer (``"hook_resid_pre"``, ``"self_attn.hook_z"``). A cell patches the clean
    activation [B, T, ...] at every batch row, at one position (``by_position``) or all, and at one head (dim 2 of
    hook_z [B, T, H, V], ``by_head``) or all."""
    layers = [i for i, block in enumerate(model.layers) if not moe_only or isinstance(block.mlp, MoE)]
    if not layers:
        raise ValueError(f"{probe} exists on MoE layers only, and this model has none")
    names = [f"layers.{i}.{probe}" for i in layers]
    B, T = _check_inputs(corrupted_tokens, clean_cache, metric, names, probe, progress)
    positions = list(range(T)) if by_position else [slice(None)]
    heads = list(range(clean_cache[names[0]].shape[2])) if by_head else [None]
    cells = [(name, position, head) for name in names for position in positions for head in heads]

    values = []
    show = len(cells) > LONG_SWEEP if progress is None else progress
    for name, position, head in tqdm(cells, desc=f"patching {probe}", unit="run", disable=not show):
        index = (slice(None), position) + (() if head is None else (head,))  # into [B, T, ...] or [B, T, H, V]
        put = partial(_put_clean, clean=clean_cache[name], index=index)
        with model.hooks(fwd_hooks=[(name, put)]):
            value = metric(model(corrupted_tokens, attention_mask=attention_mask))
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"metric must return a scalar tensor (one element) from logits [B, T, V]; it returned "
                             f"{got}")
        values.append(value.detach().reshape(()))

    swept = torch.stack(values).view(len(layers), *([T] if by_position else []), *([len(heads)] if by_head else []))
    result = torch.full((len(model.layers), *swept.shape[1:]), float("nan"), device=swept.device,
                        dtype=swept.dtype if swept.is_floating_point() else torch.float32)
    result[layers] = swept.to(result.dtype)
    return result


def _put_clean(activation: torch.Tensor, hook: HookPoint, *, clean: torch.Tensor,
               index: tuple[slice | int, ...]) -> torch.Tensor:
    """The activation [B, T, ...] with ``clean[index]`` written over ``activation[index]`` (a copy: the forward's own
    tensor stays as it was)."""
    if clean.shape != activation.shape:
        raise ValueError(f"clean_cache[{hook.name!r}] is {tuple(clean.shape)} but the corrupted run's is "
                         f"{tuple(activation.shape)}: patch between runs of the same model, batch and length")
    patched = activation.clone()
    patched[index] = clean[index].to(activation.device, activation.dtype)
    return patched


def _check_inputs(corrupted_tokens: torch.Tensor, clean_cache: Mapping[str, torch.Tensor], metric: Metric,
                  names: list[str], probe: str, progress: bool | None) -> tuple[int, int]:
    """(B, T) of the corrupted tokens, after checking every argument against them: a bad one raises here, before the
    first forward."""
    if not isinstance(corrupted_tokens, torch.Tensor) or corrupted_tokens.dim() != 2 or \
            corrupted_tokens.dtype.is_floating_point or corrupted_tokens.dtype == torch.bool:
        got = (f"{corrupted_tokens.dtype} tensor of shape {tuple(corrupted_tokens.shape)}"
               if isinstance(corrupted_tokens, torch.Tensor) else type(corrupted_tokens).__name__)
        raise TypeError(f"corrupted_tokens must be token ids, an integer tensor [B, T]; got {got}")
    if not isinstance(clean_cache, Mapping):
        raise TypeError(f"clean_cache must be an ActivationCache (model.run_with_cache) or a mapping "
                        f"{{probe name: tensor}}; got {type(clean_cache).__name__}")
    if not callable(metric):
        raise TypeError(f"metric must be a function of the logits [B, T, V] returning a scalar tensor; got {metric!r}")
    if progress not in (None, True, False):
        raise ValueError(f"progress must be None (a bar for sweeps of more than {LONG_SWEEP} forwards), True or "
                         f"False; got {progress!r}")
    missing = [name for name in names if name not in clean_cache]
    if missing:
        raise KeyError(f"clean_cache lacks {len(missing)} of the {len(names)} probes this sweep patches "
                       f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): record them with "
                       f"model.run_with_cache(clean_tokens, names={probe!r})")
    B, T = corrupted_tokens.shape
    for name in names:
        shape = tuple(clean_cache[name].shape)
        if shape[:2] != (B, T):
            raise ValueError(f"clean_cache[{name!r}] is {shape}, for batch {shape[0]} and {shape[1]} positions, but "
                             f"corrupted_tokens is {(B, T)}: patch between runs of equal batch and length")
    return B, T
