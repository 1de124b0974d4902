"""Interventions: context managers that change one forward's computation through its probes, then undo it.

    with ablate_experts(model, {3: [17, 42]}, mode="reroute"):   # experts 17 and 42 of layer 3 are gone
        logits = model(ids)
    with force_route(model, {3: [5]}, positions=[-1]):          # the last token must use expert 5
        ...
    with edit_bias(model, {3: lambda b: b * 0}):                 # route layer 3 without its correction bias
        ...
    _, clean = model.run_with_cache(clean_ids)
    with patch(model, clean, "layers.2.hook_resid_post", positions=[4]):   # activation patching
        patched = model(corrupted_ids)

Everything is built on ``model.hooks`` (or, for ``edit_bias``, a buffer restored on exit), so interventions nest,
compose with ``run_with_cache`` (which records the edited activations) and vanish on exit, also after an error.
Nested interventions on the same probe run in the order they were entered.

Router reminder (see moe.Router), per token: s = sigmoid(logits) [E]; choice = s + bias; idx = top-k of choice
(within the kept groups); w = s[idx] / (sum s[idx] + 1e-20) * routed_scaling_factor (the division only with
norm_topk_prob). Replacing idx at ``gate.hook_topk_idx`` makes the router recompute w from s for the new experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import torch

from ..model.hooks import one_selector
from ..model.moe import MoE, Router
from .routing import allowed_experts, group_best, moe_layers

if TYPE_CHECKING:
    from ..model.hooks import HookFn, HookPoint, NameFilter
    from ..model.transformer import K2Model

AblationMode = Literal["zero", "renormalize", "reroute"]
RouteSpec = Sequence[int] | torch.Tensor | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BiasSpec = torch.Tensor | float | Callable[[torch.Tensor], torch.Tensor]
Positions = int | slice | Sequence[int] | torch.Tensor | None  # along T; a bool tensor [T] or [B, T] also works


@contextmanager
def ablate_experts(model: K2Model, experts: Mapping[int, int | Iterable[int]],
                   mode: AblationMode = "zero") -> Iterator[None]:
    """Remove routed experts: ``{layer: [expert, ...]}``. For a token that chose an ablated expert in slot j:

    - ``"zero"``: the slot contributes nothing; the other slots keep their weights, the router's choice is
      unchanged. ``hook_expert_out`` shows zeros in that slot. Same as zeroing the expert's down_proj.
    - ``"renormalize"``: the slot is dropped and the weights renormalised over the slots left, as the router
      would have had the expert not been chosen: w_i = s_i / (sum_{kept} s + 1e-20) * routed_scaling_factor
      (with norm_topk_prob; without it the router never renormalises, so this equals "zero").
    - ``"reroute"``: the slot goes to the next-best expert by choice score (s + bias) that was not already chosen,
      is not ablated and lies in a group the router kept (n_group > 1); the router then weighs the new set from
      the unbiased scores as usual. Several ablated slots take the next-best experts in slot order.
    """
    builders = {"zero": _zero_hooks, "renormalize": _renormalize_hooks, "reroute": _reroute_hooks}
    if mode not in builders:
        raise ValueError(f"mode must be one of {sorted(builders)}, got {mode!r}")
    _check_mapping(experts, "experts", "{layer: [expert, ...]}")
    fwd_hooks: list[tuple[str, HookFn]] = []
    for layer, ids in experts.items():
        layer, moe = _moe_block(model, layer)
        ablated = torch.zeros(moe.experts.num_experts, dtype=torch.bool, device=moe.gate.weight.device)  # [E]
        ablated[_expert_ids(moe, [ids] if isinstance(ids, int) else ids, layer)] = True
        fwd_hooks += builders[mode](f"layers.{layer}.mlp", moe.gate, ablated)
    with model.hooks(fwd_hooks=fwd_hooks):
        yield


def _zero_hooks(prefix: str, gate: Router, ablated: torch.Tensor) -> list[tuple[str, HookFn]]:
    seen: dict[str, torch.Tensor] = {}

    def zero_slots(expert_out: torch.Tensor, hook: HookPoint) -> torch.Tensor:  # [B, T, k, D]
        idx = seen["idx"].to(expert_out.device)  # [B, T, k]
        return expert_out.masked_fill(ablated.to(idx.device)[idx][..., None], 0.0)

    return [(f"{prefix}.gate.hook_topk_idx", _remember(seen, "idx")), (f"{prefix}.hook_expert_out", zero_slots)]


def _renormalize_hooks(prefix: str, gate: Router, ablated: torch.Tensor) -> list[tuple[str, HookFn]]:
    seen: dict[str, torch.Tensor] = {}

    def renormalize(weights: torch.Tensor, hook: HookPoint) -> torch.Tensor:  # [B, T, k]
        idx = seen["idx"]
        kept = seen["scores"].gather(-1, idx) * ~ablated.to(idx.device)[idx]  # [B, T, k] unbiased scores; dropped 0
        if gate.norm_topk_prob:
            kept = kept / (kept.sum(-1, keepdim=True) + 1e-20)
        return (kept * gate.scaling).to(weights.dtype)

    return [(f"{prefix}.gate.hook_scores", _remember(seen, "scores")),
            (f"{prefix}.gate.hook_topk_idx", _remember(seen, "idx")),
            (f"{prefix}.gate.hook_topk_weights", renormalize)]


def _reroute_hooks(prefix: str, gate: Router, ablated: torch.Tensor) -> list[tuple[str, HookFn]]:
    seen: dict[str, torch.Tensor] = {}

    def reroute(idx: torch.Tensor, hook: HookPoint) -> torch.Tensor | None:  # [B, T, k]
        ablated_here = ablated.to(idx.device)  # [E]
        hit = ablated_here[idx]  # [B, T, k] slots to hand over
        if not hit.any():
            return None
        choice = seen["choice"]  # [B, T, E] before the group limit, as the router saw it
        allowed = allowed_experts(choice, gate.n_group, gate.topk_group, group_best(gate.topk_method))  # [B, T, E]
        eligible = allowed & ~ablated_here  # [B, T, E]
        eligible = eligible.scatter(-1, idx, False)  # experts already chosen keep their own slots
        best = choice.masked_fill(~eligible, float("-inf")).topk(gate.top_k, dim=-1)  # [B, T, k] best first
        rank = (hit.cumsum(-1) - 1).clamp(min=0)  # the j-th ablated slot of a token takes the j-th candidate
        if (hit & best.values.gather(-1, rank).isneginf()).any():
            raise ValueError(f"{hook.name}: too few experts left to reroute to (ablated, or outside the kept groups)")
        return torch.where(hit, best.indices.gather(-1, rank), idx)

    return [(f"{prefix}.gate.hook_choice_scores", _remember(seen, "choice")), (f"{prefix}.gate.hook_topk_idx", reroute)]


@contextmanager
def force_route(model: K2Model, routes: Mapping[int, RouteSpec], positions: Positions = None) -> Iterator[None]:
    """Choose the experts yourself: ``{layer: spec}``, at ``positions`` only (default: every token).

    A spec is
    - a sequence of m <= k distinct expert ids: they take the first m slots of every token; the remaining k - m
      slots keep the router's best other choices (in its order). With m = k the router's choice is ignored.
    - an integer tensor broadcastable to [B, T, k]: exactly these experts.
    - a function ``fn(idx [B, T, k], choice_scores [B, T, E]) -> idx [B, T, k]``.

    Group limits do not apply to forced experts. The weights are recomputed by the router as always, from the
    unbiased sigmoid scores of the new experts: w = s[idx] / (sum + 1e-20) * routed_scaling_factor.
    """
    _check_mapping(routes, "routes", "{layer: experts}")
    _check_positions(positions)
    fwd_hooks: list[tuple[str, HookFn]] = []
    for layer, spec in routes.items():
        layer, moe = _moe_block(model, layer)
        fwd_hooks += _force_hooks(f"layers.{layer}.mlp", moe, layer, spec, positions)
    with model.hooks(fwd_hooks=fwd_hooks):
        yield


def _force_hooks(prefix: str, moe: MoE, layer: int, spec: RouteSpec, positions: Positions
                 ) -> list[tuple[str, HookFn]]:
    E, k = moe.experts.num_experts, moe.gate.top_k
    seen: dict[str, torch.Tensor] = {}
    if callable(spec):
        choose = lambda idx: spec(idx, seen["choice"])
    elif isinstance(spec, torch.Tensor) and spec.dim() >= 2:
        if spec.shape[-1] != k:
            raise ValueError(f"layer {layer}: a route tensor gives k={k} experts per token in its last dim, "
                             f"got shape {tuple(spec.shape)}")
        choose = lambda idx: spec.to(idx.device).expand_as(idx)
    else:
        forced = torch.tensor(_expert_ids(moe, spec, layer))  # [m]
        if len(forced) > k or len(set(forced.tolist())) < len(forced):
            raise ValueError(f"layer {layer}: force at most k={k} distinct experts, got {forced.tolist()}")

        def choose(idx: torch.Tensor) -> torch.Tensor:
            f = forced.to(idx.device)
            others = torch.isin(idx, f).to(torch.int8).argsort(dim=-1, stable=True)  # unforced choices first
            rest = idx.gather(-1, others)[..., : k - len(f)]  # the router's best choices that are not forced
            return torch.cat([f.expand(*idx.shape[:-1], len(f)), rest], dim=-1)

    def force(idx: torch.Tensor, hook: HookPoint) -> torch.Tensor:  # [B, T, k]
        new = choose(idx)
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"{hook.name}: the route function must return expert ids [B, T, k], got "
                            f"{type(new).__name__}")
        if new.shape != idx.shape or new.dtype.is_floating_point or ((new < 0) | (new >= E)).any():
            raise ValueError(f"{hook.name}: forced routes must be expert ids in 0..{E - 1} of shape "
                             f"{tuple(idx.shape)}; got {new.dtype} {tuple(new.shape)}")
        mask = _position_mask(positions, *idx.shape[:2], idx.device)  # [B, T]
        return torch.where(mask[..., None], new.to(idx.device, idx.dtype), idx)  # a route fn may answer on the CPU

    return [(f"{prefix}.gate.hook_choice_scores", _remember(seen, "choice")), (f"{prefix}.gate.hook_topk_idx", force)]


@contextmanager
def edit_bias(model: K2Model, biases: Mapping[int, BiasSpec]) -> Iterator[None]:
    """Temporarily set layers' ``e_score_correction_bias`` [E]: ``{layer: new_bias | fn(old_bias) -> new_bias}``.

    The bias only decides which experts are chosen (choice = s + bias), never their weights, so this moves
    tokens between experts without rescaling anyone. The old values are copied back on exit.
    """
    _check_mapping(biases, "biases", "{layer: bias or fn(bias) -> bias}")
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for layer, spec in biases.items():
            layer, moe = _moe_block(model, layer)
            bias = moe.gate.e_score_correction_bias  # [E] float32
            new = spec(bias.clone()) if callable(spec) else spec
            if isinstance(new, (str, bytes, bool)) or not isinstance(new, (torch.Tensor, int, float, Sequence)):
                what = "the bias function returned" if callable(spec) else "the bias is"
                raise TypeError(f"layer {layer}: {what} {new!r}; a bias is a number or a tensor of shape "
                                f"{tuple(bias.shape)} (does the function return its result?)")
            # Checked where the caller made it (its values may be read there even when the model's are not, as on
            # meta), then written on the model's device, in the bias's own float32.
            new = torch.as_tensor(new, dtype=bias.dtype)
            if new.shape not in (bias.shape, ()):
                raise ValueError(f"layer {layer}: bias must be a scalar or of shape {tuple(bias.shape)}, "
                                 f"got {tuple(new.shape)}")
            if not new.isfinite().all():
                raise ValueError(f"layer {layer}: bias must be finite; NaN or infinity would decide every route")
            saved.append((bias, bias.clone()))
            with torch.no_grad():
                bias.copy_(new.to(bias.device))
        yield
    finally:
        with torch.no_grad():
            for bias, old in reversed(saved):
                bias.copy_(old)


@contextmanager
def patch(model: K2Model, source: Mapping[str, torch.Tensor], names: NameFilter = None,
          positions: Positions = None, *, names_filter: NameFilter = None) -> Iterator[None]:
    """Activation patching: at the probes selected by ``names`` (or ``names_filter``, the same: a name, list,
    substring or predicate), replace this run's activation by ``source[name]`` (e.g. the ActivationCache of a clean
    run), at ``positions`` only if given.

    Positions index T, which is dim 1 of [B, T, ...] probes and the query axis (dim 2) of attention scores and
    patterns [B, H, T, S]. Shapes must match: patch between runs of equal batch and length.
    """
    _check_mapping(source, "source", "{probe name: tensor}, e.g. an ActivationCache")
    _check_positions(positions)
    names = one_selector(names, names_filter)
    if names is None:  # patching every probe is never meant: say which
        raise ValueError("patch needs the probes to patch: give exactly one of names= and names_filter=")
    selected = model.select_hook_names(names)
    missing = [n for n in selected if n not in source]
    if missing:
        raise KeyError(f"patch: the source lacks {missing[:3]} ({len(missing)} of {len(selected)} probes)")

    def put(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        src = source[hook.name]
        if src.shape != x.shape:
            raise ValueError(f"patch: {hook.name} is {tuple(x.shape)} here but {tuple(src.shape)} in the source")
        src = src.to(x.device, x.dtype)
        if positions is None:
            return src
        dim = 2 if hook.name.endswith(("hook_attn_scores", "hook_pattern")) else 1
        B, T = x.shape[0], x.shape[dim]
        mask = _position_mask(positions, B, T, x.device)  # [B, T]
        mask = mask.view(B, *(1,) * (dim - 1), T, *(1,) * (x.dim() - dim - 1))
        return torch.where(mask, src, x)

    with model.hooks(fwd_hooks=[(name, put) for name in selected]):
        yield


# ---- helpers ---------------------------------------------------------------------------------------------------------
def _remember(seen: dict[str, torch.Tensor], key: str) -> HookFn:
    """A hook that keeps the latest tensor of a probe for a later probe of the same forward."""

    def remember(tensor: torch.Tensor, hook: HookPoint) -> None:
        seen[key] = tensor

    return remember


def _check_mapping(value: object, name: str, form: str) -> None:
    if not isinstance(value, Mapping) and not hasattr(value, "keys"):
        raise TypeError(f"{name} must be a mapping {form}, got {type(value).__name__}")


def _check_positions(positions: Positions) -> None:
    """Positions of a known kind; their range is checked against T when the forward runs."""
    if positions is None or isinstance(positions, slice) or _is_index(positions):
        return
    if isinstance(positions, torch.Tensor):
        if positions.dtype == torch.bool or not (positions.dtype.is_floating_point or positions.dtype.is_complex):
            return
    elif isinstance(positions, Sequence) and not isinstance(positions, str) and all(map(_is_index, positions)):
        return
    raise TypeError(f"positions must be None, an int, a slice, a list of ints or an int or bool tensor, "
                    f"got {positions!r}")


def _is_index(value: object) -> bool:
    """An int (or numpy integer), not a bool or a float."""
    return not isinstance(value, bool) and hasattr(type(value), "__index__")


def _moe_block(model: K2Model, layer: int) -> tuple[int, MoE]:
    """(non-negative layer index, its MoE block); a dense layer or a bad index raises, naming the MoE layers."""
    if not _is_index(layer):
        raise TypeError(f"layer keys must be integers, got {layer!r} ({type(layer).__name__})")
    layer = int(layer)
    L = len(model.layers)
    if not -L <= layer < L:
        raise IndexError(f"layer {layer} out of range for {L} layers")
    layer %= L
    if not isinstance(model.layers[layer].mlp, MoE):
        raise ValueError(f"layer {layer} has a dense MLP, not experts; MoE layers: {moe_layers(model)}")
    return layer, model.layers[layer].mlp


def _expert_ids(moe: MoE, ids: Iterable[int] | torch.Tensor, layer: int) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Iterable, torch.Tensor)):
        raise TypeError(f"layer {layer}: experts must be an int or a list of ints, got {ids!r}")
    ids = list(ids.flatten().tolist() if isinstance(ids, torch.Tensor) else ids)
    not_ints = [e for e in ids if not _is_index(e)]
    if not_ints:
        raise TypeError(f"layer {layer}: expert ids must be integers, got {not_ints}")
    ids = [int(e) for e in ids]
    E = moe.experts.num_experts
    bad = [e for e in ids if not 0 <= e < E]
    if bad:
        raise ValueError(f"layer {layer}: expert ids {bad} out of range 0..{E - 1}")
    return ids


def _position_mask(positions: Positions, B: int, T: int, device: torch.device) -> torch.Tensor:
    """[B, T] bool: True at the selected positions (int, slice, list of ints, or a bool mask [T] or [B, T])."""
    if positions is None:
        return torch.ones(B, T, dtype=torch.bool, device=device)
    if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
        if positions.shape not in ((T,), (B, T)):
            raise ValueError(f"a position mask must be [T] or [B, T] = {(B, T)}, got {tuple(positions.shape)}")
        return positions.to(device).expand(B, T)
    if isinstance(positions, slice):
        if not range(T)[positions]:
            raise ValueError(f"positions {positions} select none of the {T} positions")
    else:
        index = torch.as_tensor(positions).flatten()
        outside = index[(index < -T) | (index >= T)]
        if len(outside):
            raise IndexError(f"positions {outside.tolist()} out of range for {T} positions (-{T}..{T - 1})")
    mask = torch.zeros(T, dtype=torch.bool, device=device)
    mask[positions if isinstance(positions, int | slice) else torch.as_tensor(positions, device=device)] = True
    return mask.expand(B, T)


def attribution_patch(model: K2Model, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor,
                      metric: Callable[[torch.Tensor], torch.Tensor], names: NameFilter = None, *,
                      names_filter: NameFilter = None, **forward_kwargs) -> dict[str, torch.Tensor]:
    """Attribution patching (Nanda 2023): the first-order estimate, per probe and position, of how much
    ``metric(logits)`` (a scalar) would change if that activation of the corrupt run were patched to its clean value:

        estimate[name][b, t] = sum over the other dims of (clean[name] - corrupt[name]) * d metric / d corrupt[name]

    from one clean forward, one corrupt forward and one backward, instead of a forward per patch. ``names`` (or
    ``names_filter``) selects the probes as in ``run_with_cache``; the returned dict holds [B, T] tensors (T is the
    query axis of ``hook_pattern`` and ``hook_attn_scores``) for every selected probe that carries a gradient
    (not the integer ``hook_topk_idx``, nor ``hook_choice_scores``, which only ranks experts: see docs/research.md).
    The estimate is exact where the metric is linear in the activation (``hook_logits`` for a logit difference);
    compare with ``patch`` where it matters. ``forward_kwargs`` (attention_mask, attn_impl) go to both runs.
    """
    selected = model.select_hook_names(one_selector(names, names_filter))
    with torch.no_grad():
        _, clean = model.run_with_cache(clean_ids, names=selected, **forward_kwargs)
    _, corrupt_run = model.run_with_cache(corrupt_ids, names=selected, incl_bwd=True, metric=metric, **forward_kwargs)
    estimates = {}
    for name in selected:
        grad = corrupt_run.get(name + "_grad")  # None: the probe carries no gradient, or the metric did not reach it
        if grad is None:
            continue
        corrupt = corrupt_run[name]
        if clean[name].shape != corrupt.shape:
            raise ValueError(f"{name} is {tuple(corrupt.shape)} in the corrupt run but {tuple(clean[name].shape)} in "
                             "the clean one: give runs of equal batch and length")
        diff = clean[name].to(corrupt.device, corrupt.dtype) - corrupt  # [B, ...]
        term = torch.where(grad != 0, diff * grad, 0.0)  # masked scores are -inf in both runs: their diff is NaN
        axis = 2 if name.endswith(("hook_attn_scores", "hook_pattern")) else 1  # the position axis
        estimates[name] = term.movedim(axis, 1).flatten(2).sum(-1) if term.dim() > 2 else term
    return estimates
