"""The activation cache: what ``model.run_with_cache`` recorded, plus the analyses that read the residual stream.

    logits, cache = model.run_with_cache(ids)
    cache["layers.1.mlp.gate.hook_topk_idx"]        # [B, T, k]
    cache.stack("hook_resid_post")                  # [L, B, T, D]
    cache.logit_lens()                              # [L, B, T, V]: final norm + head on every layer's output
    parts = cache.decompose_resid()                 # embedding + attention + MLP (+ shared, routed, slots)
    attr = cache.logit_attribution(token_id)        # the same parts, each projected onto one logit
    cache["resid_post", 3], cache["pattern", -1]    # TransformerLens habits: short names (k2lab.get_act_name)
    stack, labels = cache.accumulated_resid(return_labels=True)   # [C, B, T, D] the residual after each block
    cache.apply_ln_to_stack(stack) @ model.lm_head.weight.T       # through the final norm (scale frozen): logit lens

The residual stream is a sum: every block adds its attention and feed-forward outputs to what came before, so the
input of the final norm is

    x_final = embed + sum_l attn_out[l] + sum_l mlp_out[l]
    mlp_out[l] = shared[l] + routed[l] = shared[l] + sum_j w[l, j] * expert_out[l, j]     (MoE layers)

and direct logit attribution asks how much each term pushes one logit when it passes straight to the head.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .hooks import MODEL_PROBES, get_act_name

if TYPE_CHECKING:
    from .transformer import K2Model

Pos = int | slice | None  # a position selector along T; an int drops the T dimension
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")


@dataclass
class ResidDecomposition:
    """The final residual (the input of the final norm) split into the terms that were added to it.

    Shapes below use ``*`` for the last dimension: D for ``cache.decompose_resid()``, nothing for
    ``cache.logit_attribution()`` (each term projected onto one logit). With an int ``pos``, T is dropped.

        residual = embed + attn.sum(0) + mlp.sum(0)
        mlp[l]   = shared[j] + routed[j]             for MoE layer l = moe_layers[j]
        routed[j] = expert_slots[j].sum(-2)          slot s of token (b, t): expert expert_ids[j, b, t, s]
    """

    embed: torch.Tensor  # [B, T, *] token embeddings
    attn: torch.Tensor  # [L, B, T, *] each layer's attention output
    mlp: torch.Tensor  # [L, B, T, *] each layer's feed-forward output (dense SwiGLU or shared + routed)
    moe_layers: list[int]  # the layer index of every row of shared, routed, expert_slots, expert_ids
    shared: torch.Tensor | None  # [L_moe, B, T, *] the shared expert's output (None without shared experts)
    routed: torch.Tensor  # [L_moe, B, T, *] the weighted sum over the k chosen experts
    expert_slots: torch.Tensor  # [L_moe, B, T, k, *] weight * expert output of each chosen slot
    expert_ids: torch.Tensor  # [L_moe, B, T, k] which expert filled each slot
    num_experts: int  # E, the routed experts per MoE layer
    residual: torch.Tensor  # [B, T, *] the final residual itself (or, projected, the logit)

    def total(self) -> torch.Tensor:
        """embed + sum of attention and feed-forward outputs: equals ``residual`` up to float rounding."""
        return self.embed + self.attn.sum(0) + self.mlp.sum(0)

    def components(self, split_moe: bool = False) -> tuple[list[str], torch.Tensor]:
        """(labels, [C, B, T, *]) in forward order: ``embed``, ``L0.attn``, ``L0.mlp``, ... With ``split_moe``
        each MoE layer's ``mlp`` is replaced by ``L{l}.shared`` and ``L{l}.routed``. The rows sum to ``residual``."""
        labels, parts = ["embed"], [self.embed]
        for l in range(self.attn.shape[0]):
            labels.append(f"L{l}.attn")
            parts.append(self.attn[l])
            if split_moe and l in self.moe_layers:
                j = self.moe_layers.index(l)
                if self.shared is not None:
                    labels.append(f"L{l}.shared")
                    parts.append(self.shared[j])
                labels.append(f"L{l}.routed")
                parts.append(self.routed[j])
            else:
                labels.append(f"L{l}.mlp")
                parts.append(self.mlp[l])
        return labels, torch.stack(parts)

    def by_expert(self, layer: int) -> torch.Tensor:
        """[E, B, T, *]: each expert's contribution at one MoE layer, zero where the token did not choose it."""
        j = self._moe_row(layer)
        slots, ids = self.expert_slots[j], self.expert_ids[j]  # [B, T, k, *], [B, T, k]
        one_hot = torch.nn.functional.one_hot(ids, self.num_experts).to(slots.dtype)  # [B, T, k, E]
        lead = "bt"[: ids.dim() - 1]  # "b" when an int pos dropped T
        last = "d" if slots.dim() > ids.dim() else ""  # "" once projected onto a logit
        return torch.einsum(f"{lead}ke,{lead}k{last}->e{lead}{last}", one_hot, slots)

    def _moe_row(self, layer: int) -> int:
        if layer not in self.moe_layers:
            raise ValueError(f"layer {layer} is not a MoE layer; MoE layers here: {self.moe_layers}")
        return self.moe_layers.index(layer)

    def map(self, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> ResidDecomposition:
        """Apply ``fn(tensor, extra_dims)`` to every contribution (not to ``expert_ids``); ``extra_dims`` counts the
        dimensions between [B, T] and the last one (1 for the k slots of ``expert_slots``, else 0)."""
        return dataclasses.replace(
            self, embed=fn(self.embed, 0), attn=fn(self.attn, 0), mlp=fn(self.mlp, 0),
            shared=None if self.shared is None else fn(self.shared, 0), routed=fn(self.routed, 0),
            expert_slots=fn(self.expert_slots, 1), residual=fn(self.residual, 0),
        )


class ActivationCache(Mapping[str, torch.Tensor]):
    """Probe name -> recorded tensor (detached), for one forward of ``model``. A read-only mapping.

    Keys are probe names; a ``(short name, layer)`` pair or a model-level short name also works, as in
    TransformerLens: ``cache["resid_post", 3]``, ``cache["topk_idx", -1]`` (the last layer), ``cache["logits"]``
    (see ``k2lab.get_act_name``). Gradients from ``run_with_cache(incl_bwd=True)`` are under ``name + "_grad"``.
    """

    def __init__(self, activations: dict[str, torch.Tensor], model: K2Model):
        self._acts = activations
        self.model = model

    # ---- the mapping -------------------------------------------------------------------------------------------------
    def __getitem__(self, name: str | tuple[str, int]) -> torch.Tensor:
        name = self._name(name)
        if name not in self._acts:
            close = difflib.get_close_matches(name, self._acts, n=5, cutoff=0.5)
            raise KeyError(f"{name!r} is not in this cache; closest: {close or 'none'} (cache.keys() lists all)")
        return self._acts[name]

    def __contains__(self, name: object) -> bool:
        try:
            return self._name(name) in self._acts  # type: ignore[arg-type]
        except (KeyError, ValueError, TypeError):
            return False

    def _name(self, key: str | tuple[str, int]) -> str:
        """A probe name from a name, a short model-level name, or a (short name, layer) pair (layer may be < 0)."""
        if isinstance(key, tuple):
            if len(key) != 2 or not isinstance(key[1], int):
                raise KeyError(f"a cache key is a probe name or a (short name, layer) pair, got {key!r}")
            short, layer = key
            L = len(self.model.layers)
            if not -L <= layer < L:
                raise KeyError(f"layer {layer} out of range for {L} layers")
            return get_act_name(short, layer % L)
        if isinstance(key, str) and key not in self._acts and key in MODEL_PROBES:
            return MODEL_PROBES[key]
        return key

    def __iter__(self) -> Iterator[str]:
        return iter(self._acts)

    def __len__(self) -> int:
        return len(self._acts)

    def __repr__(self) -> str:
        width = max((len(n) for n in self._acts), default=0)
        lines = [f"  {n:<{width}}  {list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for n, t in self.items()]
        return "\n".join([f"ActivationCache({len(self)} probes)", *lines])

    # ---- per-layer stacks --------------------------------------------------------------------------------------------
    def layer_indices(self, suffix: str) -> list[int]:
        """The layers whose probe ``layers.{i}.<...>suffix`` is in the cache, ascending: row j of
        ``stack(suffix)`` is layer ``layer_indices(suffix)[j]`` (for MoE-only probes the dense layers are absent)."""
        return [layer for layer, _ in self._layer_names(suffix)]

    def stack(self, suffix: str) -> torch.Tensor:
        """[L', ...]: the probe ``suffix`` of every layer that has it, stacked along a new first axis.

        ``suffix`` is the part after ``layers.{i}.``, whole or by its last components: ``"hook_resid_post"``,
        ``"self_attn.hook_pattern"``, ``"hook_topk_idx"``. See ``layer_indices`` for which layers the rows are.
        """
        tensors = [self[name] for _, name in self._layer_names(suffix)]
        return torch.stack([t.to(tensors[0].device) for t in tensors])  # blocks may sit on several devices

    def _layer_names(self, suffix: str) -> list[tuple[int, str]]:
        per_layer: dict[int, list[str]] = {}
        for name in self._acts:
            m = _LAYER_NAME.fullmatch(name)
            if m and (m[2] == suffix or m[2].endswith("." + suffix)):
                per_layer.setdefault(int(m[1]), []).append(name)
        if not per_layer:
            suffixes = sorted({m[2] for n in self._acts if (m := _LAYER_NAME.fullmatch(n))})
            close = difflib.get_close_matches(suffix, suffixes, n=5, cutoff=0.4)
            raise KeyError(f"no layers.{{i}}.*{suffix} probe in this cache; closest: {close or 'none'}")
        ambiguous = [names for names in per_layer.values() if len(names) > 1]
        if ambiguous:
            raise KeyError(f"suffix {suffix!r} matches several probes per layer: {ambiguous[0]}; give more of the path")
        return [(layer, names[0]) for layer, names in sorted(per_layer.items())]

    # ---- reading the residual stream ---------------------------------------------------------------------------------
    @torch.no_grad()
    def logit_lens(self, pos: Pos = None) -> torch.Tensor:
        """[L, B, T, V] float32, on the cache's device: ``lm_head(norm(resid_post[l]))`` for every layer l, as if the
        model stopped there.

        The last layer's row is the model's logits (same ops on the same tensor). Each layer goes through the head
        on its own, so peak memory is one layer's logits on top of the result; pick ``pos`` (e.g. -1) for long
        prompts and big vocabularies.
        """
        self._require("logit_lens", [f"layers.{i}.hook_resid_post" for i in range(len(self.model.layers))])
        model = self.model
        lens = []
        for resid in self.stack("hook_resid_post"):  # [B, T, D], where the cache holds it
            x = _at(resid, pos).to(model.norm.weight.device, model.dtype)
            logits = model.lm_head(model.norm(x).to(model.lm_head.weight.device)).float()
            lens.append(logits.to(resid.device))  # back where the cache is (a cache gathered to the CPU: the CPU)
        return torch.stack(lens)

    def decompose_resid(self, pos: Pos = None) -> ResidDecomposition:
        """The final residual as a sum of embedding, per-layer attention and MLP outputs, MoE layers further split
        into shared, routed and per-slot expert contributions (weight * expert output). See ResidDecomposition."""
        cfg, L = self.model.config, len(self.model.layers)
        moe_layers = [i for i in range(L) if cfg.is_moe_layer(i)]
        moe = [f"layers.{i}.mlp" for i in moe_layers]
        has_shared = cfg.n_shared_experts > 0
        needed = ["embed_tokens.hook_out", f"layers.{L - 1}.hook_resid_post"]
        needed += [f"layers.{i}.{s}" for i in range(L) for s in ("hook_attn_out", "hook_mlp_out")]
        for m in moe:
            needed += [f"{m}.{s}" for s in ("hook_expert_out", "hook_routed_out", "gate.hook_topk_idx",
                                             "gate.hook_topk_weights", *(["hook_shared_out"] if has_shared else []))]
        self._require("decompose_resid", needed)

        def per_moe_layer(leaf: str) -> torch.Tensor:  # [L_moe, B, T, ...] at pos (empty for a dense-only model)
            parts = [self[f"{m}.{leaf}"] for m in moe]
            if leaf == "hook_expert_out":  # weight * expert output, as the MoE block sums them: [B, T, k, D]
                weights = [self[f"{m}.gate.hook_topk_weights"][..., None] for m in moe]  # [B, T, k, 1]
                parts = [out * w for out, w in zip(parts, weights, strict=True)]
            return _at(torch.stack(parts), pos, lead=1) if parts else self["embed_tokens.hook_out"].new_zeros((0,))

        return ResidDecomposition(
            embed=_at(self["embed_tokens.hook_out"], pos),
            attn=_at(self.stack("hook_attn_out"), pos, lead=1),
            mlp=_at(self.stack("hook_mlp_out"), pos, lead=1),
            moe_layers=moe_layers,
            shared=per_moe_layer("hook_shared_out") if has_shared else None,
            routed=per_moe_layer("hook_routed_out"),
            expert_slots=per_moe_layer("hook_expert_out"),
            expert_ids=per_moe_layer("gate.hook_topk_idx"),
            num_experts=cfg.n_routed_experts,
            residual=_at(self[f"layers.{L - 1}.hook_resid_post"], pos),
        )

    @torch.no_grad()
    def logit_attribution(self, target: int | torch.Tensor, pos: Pos = None) -> ResidDecomposition:
        """Direct logit attribution: ``decompose_resid(pos)`` with every term projected onto one logit.

        ``target`` is a token id (int, or an integer tensor [B] or [B, T] matching the positions) or a direction in
        residual space (float [D], or [B, (T,) D]); for a logit difference pass
        ``model.lm_head.weight[a] - model.lm_head.weight[b]``.

        The final norm is RMSNorm(x) = g * x / rms(x), rms(x) = sqrt(mean(x^2) + eps), and a logit is
        u . RMSNorm(x) with u the head's row. It is linear in x once rms is frozen at the final residual x, so

            contribution(c) = u . (g * c) / rms(x)        and the contributions sum to the logit (float rounding)

        (TransformerLens's ``apply_ln_to_stack`` does the same with LayerNorm; RMSNorm has no centring). The
        frozen scale is the linearisation: a term's contribution is not the logit change from removing it.
        """
        parts = self.decompose_resid(pos)
        x = parts.residual.float()  # [B, (T,) D]
        head = self.model.lm_head.weight
        scale = self._frozen_norm_scale(pos)  # [B, (T,) D]
        if isinstance(target, int) or not target.is_floating_point():
            target = torch.as_tensor(target, device=head.device)
            if target.dim() == 1 and x.dim() == 3:
                target = target[:, None]  # one token per batch row, at every position
            direction = head[target]  # [..., D]
        else:
            direction = target
        direction = direction.to(x.device, torch.float32)
        try:
            readout = (direction * scale).expand_as(x)  # [B, (T,) D]
        except RuntimeError as err:
            raise ValueError(f"target gives a direction of shape {tuple(direction.shape)}, which does not broadcast "
                             f"to the final residual {tuple(x.shape)}") from err

        def project(t: torch.Tensor, extra_dims: int) -> torch.Tensor:
            r = readout.reshape(readout.shape[:-1] + (1,) * extra_dims + readout.shape[-1:])
            return (t.float() * r).sum(-1) if t.numel() else t.float()

        return parts.map(project)

    # ---- TransformerLens's residual-stream helpers -------------------------------------------------------------------
    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, pos: Pos = None,
                          apply_ln: bool = False, return_labels: bool = False
                          ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """[C, B, T, D]: the residual stream as it stood before each block, up to ``layer``, as TransformerLens
        stacks it: ``resid_pre`` of layers 0..layer (``"{l}_pre"``), with ``incl_mid`` also each ``resid_mid`` before
        ``layer`` (``"{l}_mid"``); ``layer=None`` (or the number of layers) ends with the final residual
        (``"final_post"``, the final norm's input). ``pos`` selects positions; ``apply_ln`` passes the stack through
        ``apply_ln_to_stack``; ``return_labels`` also returns the labels."""
        L = len(self.model.layers)
        layer = L if layer is None else layer
        if not 0 <= layer <= L:
            raise ValueError(f"layer must lie in 0..{L} (or None for all), got {layer}")
        labels, names = [], []
        for i in range(layer + 1):
            if i == L:
                labels.append("final_post")
                names.append(f"layers.{L - 1}.hook_resid_post")
                break
            labels.append(f"{i}_pre")
            names.append(f"layers.{i}.hook_resid_pre")
            if incl_mid and i < layer:
                labels.append(f"{i}_mid")
                names.append(f"layers.{i}.hook_resid_mid")
        self._require("accumulated_resid", names)
        stack = torch.stack([_at(self[n].to(self[names[0]].device), pos) for n in names])  # [C, B, (T,) D]
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, pos=pos)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, stack: torch.Tensor, pos: Pos = None) -> torch.Tensor:
        """[..., B, (T,) D] float32: each row of ``stack`` scaled as the final norm scales the final residual x,

            row -> g * row / rms(x),       rms(x) = sqrt(mean(x^2) + eps)   (frozen at x, as TransformerLens does)

        so rows that sum to x come out summing to the final norm's output, and ``@ model.lm_head.weight.T`` turns
        each into its direct contribution to the logits. ``pos`` must be what selected the stack's positions."""
        L = len(self.model.layers)
        self._require("apply_ln_to_stack", [f"layers.{L - 1}.hook_resid_post"])
        scale = self._frozen_norm_scale(pos)  # [B, (T,) D]
        if tuple(stack.shape[stack.dim() - scale.dim() :]) != tuple(scale.shape):
            raise ValueError(f"a stack of shape {tuple(stack.shape)} does not end with the final residual's "
                             f"{tuple(scale.shape)} at pos={pos!r}; pass the pos the stack was made with")
        return stack.float() * scale.to(stack.device)

    def _frozen_norm_scale(self, pos: Pos) -> torch.Tensor:
        """[B, (T,) D] float32 g / rms(x) at the final residual x: the final RMSNorm with its rms frozen, the one
        linear map that both ``logit_attribution`` and ``apply_ln_to_stack`` apply to residual terms."""
        x = _at(self[f"layers.{len(self.model.layers) - 1}.hook_resid_post"], pos).float()  # [B, (T,) D]
        norm = self.model.norm
        inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)  # [B, (T,) 1]
        return norm.weight.to(x.device, torch.float32) * inv_rms

    def _require(self, what: str, names: list[str]) -> None:
        missing = [n for n in names if n not in self]
        if missing:
            raise KeyError(f"{what} needs probes missing from this cache, e.g. {missing[:3]} ({len(missing)} in all); "
                           "record them with run_with_cache(ids) (all probes) or include them in names=")


def _at(t: torch.Tensor, pos: Pos, lead: int = 0) -> torch.Tensor:
    """Select positions along T of a [lead..., B, T, ...] tensor."""
    return t if pos is None else t[(slice(None),) * (lead + 1) + (pos,)]
