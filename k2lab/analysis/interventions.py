"""Interventions: context managers that change one forward's computation through its probes, then undo it.

    with ablate_experts(model, {3: [17, 42]}, mode="reroute"):   # experts 17 and 42 of layer 3 are gone
        logits = model(ids)
    with ablate_experts(model, {3: [17]}, mode="mean", reference=reference_ids):   # 17 answers its average
        ...
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
from typing import TYPE_CHECKING, Literal, get_args

import torch
import torch.nn.functional as F

from ..model.hooks import one_selector
from ..model.moe import MoE, Router
from .routing import allowed_experts, group_best, moe_layers
from .splicing import splice  # noqa: F401 - k2lab.interventions.splice, with the others

if TYPE_CHECKING:
    from ..model.hooks import HookFn, HookPoint, NameFilter
    from ..model.transformer import K2Model

AblationMode = Literal["zero", "renormalize", "reroute", "mean", "resample"]
AttributionUnit = Literal["position", "head", "expert"]
RouteSpec = int | Sequence[int] | torch.Tensor | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BiasSpec = torch.Tensor | float | Callable[[torch.Tensor], torch.Tensor]
Positions = int | slice | Sequence[int] | torch.Tensor | None  # along T; a bool tensor [T] or [B, T] also works


@contextmanager
def ablate_experts(model: K2Model, experts: Mapping[int, int | Iterable[int]], mode: AblationMode = "zero", *,
                   reference: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
                   reference_mask: torch.Tensor | None = None,
                   seed: int | torch.Generator | None = None) -> Iterator[None]:
    """Remove routed experts: ``{layer: [expert, ...]}``. For a token that chose an ablated expert in slot j:

    - ``"zero"``: the slot contributes nothing; the other slots keep their weights, the router's choice is
      unchanged. ``hook_expert_out`` shows zeros in that slot. Same as zeroing the expert's down_proj.
    - ``"renormalize"``: the slot is dropped and the weights renormalised over the slots left, as the router
      would have had the expert not been chosen: w_i = s_i / (sum_{kept} s + 1e-20) * routed_scaling_factor
      (with norm_topk_prob; without it the router never renormalises, so this equals "zero").
    - ``"reroute"``: the slot goes to the next-best expert by choice score (s + bias) that was not already chosen,
      is not ablated and lies in a group the router kept (n_group > 1); the router then weighs the new set from
      the unbiased scores as usual. Several ablated slots take the next-best experts in slot order.
    - ``"mean"``: the slot's expert output (``hook_expert_out``) is the expert's mean output over the reference
      tokens: mean over every real reference token x_r of SwiGLU_e(x_r), x_r the MoE's input there
      (``post_attention_layernorm.hook_out``), whether or not the router sent x_r to e (so the mean exists for an
      expert that the reference rarely chooses, and is not biased toward the tokens that choose it).
    - ``"resample"``: the slot's expert output is SwiGLU_e(x_r) at a reference token r drawn uniformly for each slot
      of each forward, from ``seed`` (an int, or a torch.Generator; None: torch's global generator). The same seed
      and the same forwards give the same draws.

    With "mean" and "resample" the router's choice and weights stay as they were: only what the ablated expert
    answers changes.
    ``reference`` is token ids [B', T'] (run once on entry, under whatever hooks are attached then, with
    ``reference_mask`` [B', T'] as its attention mask) or an ActivationCache holding
    ``layers.{l}.post_attention_layernorm.hook_out`` [B', T', D] of every ablated layer; ``reference_mask`` (1 for a
    token, 0 for a pad) leaves pads out of the reference tokens in both cases. Without one, the pads are those the
    reference's forward left out: the mask a cache kept, or the one the forward infers for ids ([PAD]s at a row's edges,
    as ``model(ids)`` infers it). A reference whose answers hold NaN or inf is refused. The experts run through their
    own ``expert_weights`` (stacked, quantized or streamed alike); resample keeps each ablated expert's outputs on all
    reference tokens, [tokens, D].
    """
    if mode not in get_args(AblationMode):
        raise ValueError(f"mode must be one of {sorted(get_args(AblationMode))}, got {mode!r}")
    _check_mapping(experts, "experts", "{layer: [expert, ...]}")
    needs_reference = mode in ("mean", "resample")
    if needs_reference and reference is None:
        raise ValueError(f"mode={mode!r} needs reference=: token ids [B, T] or an ActivationCache holding "
                         "layers.{l}.post_attention_layernorm.hook_out of the ablated layers")
    unused = {"reference": reference, "reference_mask": reference_mask} if not needs_reference else {}
    unused |= {"seed": seed} if mode != "resample" else {}
    given = [name for name, value in unused.items() if value is not None]
    if given:
        raise ValueError(f"{given[0]}= is not used by mode={mode!r}: reference= and reference_mask= serve modes "
                         "'mean' and 'resample', seed= serves 'resample'")
    if seed is not None and not (isinstance(seed, torch.Generator) or _is_int(seed)):
        raise TypeError(f"seed must be an int, a torch.Generator or None, got {seed!r}")
    chosen = []  # (layer, its MoE, the ablated expert ids)
    for layer, ids in experts.items():
        layer, moe = _moe_block(model, layer)
        chosen.append((layer, moe, sorted(set(_expert_ids(moe, [ids] if _is_int(ids) else ids, layer)))))
        if not chosen[-1][2]:
            raise ValueError(f"experts[{layer}] names no expert ({ids!r}): give the experts to ablate at layer "
                             f"{layer}, or leave the layer out")
    fwd_hooks: list[tuple[str, HookFn]] = []
    if needs_reference and chosen:
        inputs = _reference_inputs(model, sorted({layer for layer, _, _ in chosen}), reference, reference_mask)
        generator = torch.Generator().manual_seed(int(seed)) if _is_int(seed) else seed
        for layer, moe, ids in chosen:
            answers = torch.stack([_expert_outputs(moe, e, inputs[layer]) for e in ids])  # [A, N, D]
            if mode == "mean":
                answers = answers.float().mean(1, keepdim=True).to(answers.dtype)  # [A, 1, D]
            fwd_hooks += _replace_hooks(f"layers.{layer}.mlp", moe.experts.num_experts, ids, answers,
                                        generator if mode == "resample" else None)
    else:
        builders = {"zero": _zero_hooks, "renormalize": _renormalize_hooks, "reroute": _reroute_hooks}
        for layer, moe, ids in chosen:
            ablated = torch.zeros(moe.experts.num_experts, dtype=torch.bool, device=moe.gate.weight.device)  # [E]
            ablated[ids] = True
            fwd_hooks += builders[mode](f"layers.{layer}.mlp", moe.gate, ablated)
    with model.hooks(fwd_hooks=fwd_hooks):
        yield


def _reference_inputs(model: K2Model, layers: list[int], reference: torch.Tensor | Mapping[str, torch.Tensor],
                      reference_mask: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """{layer: the MoE inputs [N, D] of the N real reference tokens} (``post_attention_layernorm.hook_out``),
    from reference ids (run here) or a cache that holds them."""
    names = {layer: f"layers.{layer}.post_attention_layernorm.hook_out" for layer in layers}
    if reference_mask is not None and not (isinstance(reference_mask, torch.Tensor) and (
            reference_mask.dtype == torch.bool or not (reference_mask.dtype.is_floating_point
                                                       or reference_mask.dtype.is_complex))):
        got = reference_mask.dtype if isinstance(reference_mask, torch.Tensor) else type(reference_mask).__name__
        raise TypeError(f"reference_mask must be an integer or bool tensor [B, T] (1 = token, 0 = pad), got {got}")
    if isinstance(reference, torch.Tensor):
        try:
            with torch.no_grad():
                _, reference = model.run_with_cache(reference, names=list(names.values()),
                                                    attention_mask=reference_mask)
        except (ValueError, TypeError) as err:
            raise type(err)(f"reference=: {err}".replace("input_ids", "the reference ids").replace(
                "attention_mask", "reference_mask")) from None
    elif not isinstance(reference, Mapping):
        raise TypeError(f"reference must be token ids [B, T] (a tensor) or an ActivationCache, got "
                        f"{type(reference).__name__}")
    if reference_mask is None:  # the pads the reference's forward left out (given, made for text, or inferred)
        reference_mask = getattr(reference, "mask", None)
    missing = [name for name in names.values() if name not in reference]
    if missing:
        raise KeyError(f"reference lacks {missing}: record them with model.run_with_cache(reference_ids, "
                       f"names={missing!r}), or pass the reference ids")
    inputs = {}
    width = model.config.hidden_size
    for layer, name in names.items():
        x = reference[name]  # [B', T', D]
        if x.dim() != 3 or x.shape[-1] != width:
            raise ValueError(f"reference[{name!r}] is {tuple(x.shape)}, but the model's {name} is [B, T, {width}]: "
                             f"the reference was recorded from another model")
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"reference[{name!r}] holds NaN or inf at {int((~torch.isfinite(x)).any(-1).sum())} "
                             f"token(s): an expert's answer to it would be NaN too, and so would the ablated logits")
        if reference_mask is None:
            inputs[layer] = x.flatten(0, 1)
            continue
        if reference_mask.shape != x.shape[:2]:
            raise ValueError(f"reference_mask is {tuple(reference_mask.shape)} but the reference is "
                             f"{tuple(x.shape[:2])} tokens ([B, T]); give one mask entry per reference token")
        inputs[layer] = x[reference_mask.to(x.device).bool()]  # [N, D]
    if any(len(x) == 0 for x in inputs.values()):
        raise ValueError("reference_mask selects no reference token: an expert's reference answer needs at least one")
    return inputs


def _expert_outputs(moe: MoE, expert: int, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of one routed expert on x [N, D] -> [N, D], through ``expert_weights``: the per-expert path that
    stacked, quantized and streamed experts all provide, on the weights' device and in their dtype."""
    gate, up, down = moe.experts.expert_weights(expert)  # [I, D], [I, D], [D, I]
    with torch.no_grad():
        h = x.to(gate.device, gate.dtype)
        return F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)


def _replace_hooks(prefix: str, num_experts: int, ablated: list[int], answers: torch.Tensor,
                   generator: torch.Generator | None) -> list[tuple[str, HookFn]]:
    """Hooks that put ``answers[a, r]`` [D] in every slot that chose ``ablated[a]``: r = 0 for one answer per expert
    (mean), else r drawn per slot from ``generator`` (resample). ``answers`` [A, N, D]."""
    row_of = torch.full((num_experts,), -1, dtype=torch.long)  # [E] -> row of answers, -1: not ablated
    row_of[ablated] = torch.arange(len(ablated))
    seen: dict[str, torch.Tensor] = {}

    def replace_slots(expert_out: torch.Tensor, hook: HookPoint) -> torch.Tensor:  # [B, T, k, D]
        idx = seen["idx"].to(expert_out.device)  # [B, T, k]
        row = row_of.to(idx.device)[idx]  # [B, T, k]
        if generator is None:  # one answer per expert (mean), or a draw from torch's global generator
            drawn = torch.randint(answers.shape[1], idx.shape) if answers.shape[1] > 1 else torch.zeros_like(idx)
        else:
            drawn = torch.randint(answers.shape[1], idx.shape, generator=generator, device=generator.device)
        replacement = answers.to(expert_out.device)[row.clamp(min=0), drawn.to(idx.device)]  # [B, T, k, D]
        return torch.where((row >= 0)[..., None], replacement.to(expert_out.dtype), expert_out)

    return [(f"{prefix}.gate.hook_topk_idx", _remember(seen, "idx")), (f"{prefix}.hook_expert_out", replace_slots)]


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
    - an expert id, or a sequence of 1 <= m <= k distinct expert ids: they take the first m slots of every token;
      the remaining k - m slots keep the router's best other choices (in its order). With m = k the router's choice
      is ignored.
    - an integer tensor broadcastable to [B, T, k] (2 or 3 dims), k distinct experts per token: exactly these.
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
        _check_route_tensor(spec, layer, E, k)
        choose = lambda idx: _broadcast_route(spec.to(idx.device), idx, layer)
    else:
        forced = torch.tensor(_expert_ids(moe, [spec] if _is_int(spec) else spec, layer), dtype=torch.long)  # [m]
        if not len(forced):
            raise ValueError(f"layer {layer}: the route is empty; force 1..k={k} distinct experts, give a tensor "
                             f"of k experts per token, or leave the layer out of routes")
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


def _check_route_tensor(spec: torch.Tensor, layer: int, num_experts: int, k: int) -> None:
    """A route tensor [..., k] must hold, for every token it covers, k distinct expert ids in 0..E-1, and broadcast
    to [B, T, k] (at most 3 dims)."""
    if spec.shape[-1] != k:
        raise ValueError(f"layer {layer}: a route tensor gives k={k} experts per token in its last dim, "
                         f"got shape {tuple(spec.shape)}")
    if spec.dim() > 3 or spec.numel() == 0:
        raise ValueError(f"layer {layer}: a route tensor must broadcast to [B, T, k] (2 or 3 dims, not empty); "
                         f"got shape {tuple(spec.shape)}")
    if spec.dtype.is_floating_point or spec.dtype.is_complex or spec.dtype == torch.bool:
        raise TypeError(f"layer {layer}: a route tensor holds integer expert ids, got {spec.dtype}")
    if spec.device.type != "meta":
        outside = spec[(spec < 0) | (spec >= num_experts)]
        if len(outside):
            raise ValueError(f"layer {layer}: route tensor ids {outside.unique().tolist()} out of range "
                             f"0..{num_experts - 1}")
        ordered = spec.sort(-1).values
        if (ordered[..., 1:] == ordered[..., :-1]).any():
            raise ValueError(f"layer {layer}: a route tensor must give k={k} distinct experts per token; a row "
                             "repeats an expert")


def _broadcast_route(spec: torch.Tensor, idx: torch.Tensor, layer: int) -> torch.Tensor:
    """The route tensor expanded to this forward's idx [B, T, k], or an error naming both shapes."""
    try:
        return spec.expand_as(idx)
    except RuntimeError:
        raise ValueError(f"layer {layer}: the route tensor {tuple(spec.shape)} does not broadcast to this run's "
                         f"[B, T, k] = {tuple(idx.shape)}") from None


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


def _is_int(value: object) -> bool:
    """One integer: an int or numpy integer, not a bool, a float or a tensor (tensors have ``__index__`` too)."""
    return not isinstance(value, torch.Tensor) and _is_index(value)


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
                      names_filter: NameFilter = None, per: AttributionUnit = "position",
                      **forward_kwargs) -> dict[str, torch.Tensor]:
    """Attribution patching (Nanda 2023): the first-order estimate, per probe and position, of how much
    ``metric(logits)`` (a scalar) would change if that activation of the corrupt run were patched to its clean value:

        estimate[name][b, t] = sum over the other dims of (clean[name] - corrupt[name]) * d metric / d corrupt[name]

    from one clean forward, one corrupt forward and one backward, instead of a forward per patch. ``names`` (or
    ``names_filter``) selects the probes as in ``run_with_cache``; the returned dict holds [B, T] tensors (T is the
    query axis of ``hook_pattern`` and ``hook_attn_scores``) for every selected probe that carries a gradient
    (not the integer ``hook_topk_idx``, nor ``hook_choice_scores``, which only ranks experts: see docs/research.md).
    The estimate is exact where the metric is linear in the activation (``hook_logits`` for a logit difference);
    compare with ``patch`` where it matters. ``forward_kwargs`` (attention_mask, attn_impl) go to both runs.

    ``per`` splits the estimate finer, for the probes of one kind among the selection (names=None: all of them):

    - ``"head"``: the ``self_attn.hook_z`` probes [B, T, H, V] -> [B, T, H], summed over V only: head h's share of
      the [B, T] estimate, which the heads sum to.
    - ``"expert"``: the ``mlp.hook_routed_out`` probes -> [B, T, E] float32. routed_out = sum_e contrib_e, with
      contrib_e = w_j * expert_out_j for the slot j that chose expert e (zero where no slot did), so
      estimate[b, t, e] = (clean contrib_e - corrupt contrib_e) . d metric / d routed_out [b, t]. It counts an
      expert the clean run chose and the corrupt run did not (and the reverse), and sums over e to the routed_out
      estimate (to rounding; routed_out is cast to the model's dtype). Costs recording each layer's slots
      (``gate.hook_topk_idx``, ``gate.hook_topk_weights``, ``hook_expert_out`` [B, T, k, D]) in both runs.
    """
    if per not in _UNIT_PROBES:
        raise ValueError(f"per must be one of {sorted(_UNIT_PROBES)}, got {per!r}")
    selected = model.select_hook_names(one_selector(names, names_filter))
    if _UNIT_PROBES[per] is not None:
        selected = [name for name in selected if name.endswith("." + _UNIT_PROBES[per])]
        if not selected:
            raise ValueError(f"per={per!r} splits {_UNIT_PROBES[per]} probes, and the names selected hold none")
    slots = [name.removesuffix("hook_routed_out") + leaf for name in selected for leaf in _SLOT_PROBES] \
        if per == "expert" else []
    with torch.no_grad():
        _, clean = model.run_with_cache(clean_ids, names=selected + slots, **forward_kwargs)
    _, corrupt_run = model.run_with_cache(corrupt_ids, names=selected + slots, incl_bwd=True, metric=metric,
                                          **forward_kwargs)
    estimates = {}
    for name in selected:
        grad = corrupt_run.get(name + "_grad")  # None: the probe carries no gradient, or the metric did not reach it
        if grad is None:
            continue
        corrupt = corrupt_run[name]
        if clean[name].shape != corrupt.shape:
            raise ValueError(f"{name} is {tuple(corrupt.shape)} in the corrupt run but {tuple(clean[name].shape)} in "
                             "the clean one: give runs of equal batch and length")
        if per == "expert":
            prefix = name.removesuffix("hook_routed_out")
            num_experts = model.get_submodule(prefix.removesuffix(".")).experts.num_experts
            estimates[name] = _expert_contributions(clean, prefix, grad, num_experts) - \
                _expert_contributions(corrupt_run, prefix, grad, num_experts)
            continue
        diff = clean[name].to(corrupt.device, corrupt.dtype) - corrupt  # [B, ...]
        term = torch.where(grad != 0, diff * grad, 0.0)  # masked scores are -inf in both runs: their diff is NaN
        if per == "head":
            estimates[name] = term.sum(-1)  # [B, T, H, V] -> [B, T, H]
            continue
        axis = 2 if name.endswith(("hook_attn_scores", "hook_pattern")) else 1  # the position axis
        estimates[name] = term.movedim(axis, 1).flatten(2).sum(-1) if term.dim() > 2 else term
    return estimates


# per= -> the probe it splits (None: every selected probe, per position); the slots a per-expert estimate reads.
_UNIT_PROBES = {"position": None, "head": "self_attn.hook_z", "expert": "mlp.hook_routed_out"}
_SLOT_PROBES = ("gate.hook_topk_idx", "gate.hook_topk_weights", "hook_expert_out")


def _expert_contributions(run: Mapping[str, torch.Tensor], prefix: str, grad: torch.Tensor,
                          num_experts: int) -> torch.Tensor:
    """[B, T, E] float32: contrib_e . grad for one run of the MoE at ``prefix`` (``layers.{l}.mlp.``), with
    contrib_e = w_j * expert_out_j in the slot j that chose e. Projected slot by slot ([B, T, k]) and scattered to
    the experts, so no [B, T, E, D] tensor is made. ``grad`` [B, T, D] is d metric / d routed_out."""
    idx = run[prefix + "gate.hook_topk_idx"].to(grad.device)  # [B, T, k]
    weights = run[prefix + "gate.hook_topk_weights"].to(grad.device, torch.float32)  # [B, T, k]
    expert_out = run[prefix + "hook_expert_out"].to(grad.device, torch.float32)  # [B, T, k, D]
    projected = weights * (expert_out @ grad.float()[..., None]).squeeze(-1)  # [B, T, k]
    return projected.new_zeros(*idx.shape[:2], num_experts).scatter_add_(-1, idx, projected)
