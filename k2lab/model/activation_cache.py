"""The activation cache: what ``model.run_with_cache`` recorded, plus the analyses that read the residual stream.

    logits, cache = model.run_with_cache(ids)
    cache["layers.1.mlp.gate.hook_topk_idx"]        # [B, T, k]
    cache.stack("hook_resid_post")                  # [L, B, T, D]
    cache.logit_lens()                              # [L, B, T, V]: final norm + head on every layer's output
    parts = cache.decompose_resid()                 # embedding + attention + MLP (+ shared, routed, slots)
    attr = cache.logit_attribution(token_id)        # the same parts, each projected onto one logit
    cache["resid_post", 3], cache["pattern", -1]    # TransformerLens habits: short names (k2lab.get_act_name)
    cache["blocks.3.hook_resid_post"]               # ... and TransformerLens's spellings of probe names
    stack, labels = cache.accumulated_resid(return_labels=True)   # [C, B, T, D] the residual after each block
    cache.apply_ln_to_stack(stack) @ model.lm_head.weight.T       # through the final norm (scale frozen): logit lens
    heads, labels = cache.stack_head_results(pos_slice=-1, return_labels=True)   # [L*H, B, D] each head's write
    experts = cache.stack_expert_results(3)         # [E, B, T, D] each routed expert's weighted write at layer 3
    cache.to_dataframe(("topk_idx", 3))             # the router's choice as a table (pandas, the lab extra)
    cache.save("run/") ; ActivationCache.load("run/", model=model)   # tensors + config; the weights stay out

The residual stream is a sum: every block adds its attention and feed-forward outputs to what came before, so the
input of the final norm is

    x_final = embed + sum_l attn_out[l] + sum_l mlp_out[l]
    attn_out[l] = sum_h z[l, h] @ W_O[l, h]^T                                               (o_proj has no bias)
    mlp_out[l] = shared[l] + routed[l] = shared[l] + sum_j w[l, j] * expert_out[l, j]     (MoE layers)

and direct logit attribution asks how much each term pushes one logit when it passes straight to the head.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import operator
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import K2Config
from ..version import __version__
from .hooks import MODEL_PROBES, canonical_probe_name, get_act_name

if TYPE_CHECKING:
    import pandas

    from .transformer import K2Model

Pos = int | slice | None  # a position selector along T; an int drops the T dimension
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")

# cache.save writes a directory holding these two files.
ACTIVATIONS_FILE = "activations.safetensors"  # every tensor, by probe name
CACHE_JSON = "cache.json"  # probe order, config, k2lab version
_CACHE_FORMAT, _CACHE_FORMAT_VERSION = "k2lab.ActivationCache", 1
TABLE_MAX_WIDTH = 64  # to_dataframe: the largest trailing size it lays out as a table


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
        return _per_expert(self.expert_slots[j], self.expert_ids[j], self.num_experts)

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
    """Probe name -> recorded tensor (detached), for one forward of a model. A read-only mapping.

    Keys are probe names; TransformerLens's spellings (``cache["blocks.3.attn.hook_z"]``), a ``(short name,
    layer)`` pair or a model-level short name also work: ``cache["resid_post", 3]``, ``cache["topk_idx", -1]`` (the
    last layer), ``cache["logits"]`` (see ``k2lab.get_act_name``). Gradients from ``run_with_cache(incl_bwd=True)``
    are under ``name + "_grad"``.

    The cache holds the model's config (``cache.config``) and the model itself (``cache.model``), whose weights
    ``logit_lens``, ``logit_attribution``, ``apply_ln_to_stack`` and ``stack_head_results`` read. Pickling
    (``torch.save(cache)``) and ``cache.save(path)`` keep the tensors and the config only, so a cache costs its
    tensors' bytes, not the model's; afterwards ``cache.model`` is None until ``cache.attach(model)``.
    """

    def __init__(self, activations: dict[str, torch.Tensor], model: K2Model | None,
                 config: K2Config | None = None):
        """``activations``: probe name -> tensor, in firing order. ``config`` defaults to ``model.config``; given both,
        they must agree (``attach``)."""
        if config is None:
            if model is None:
                raise ValueError("an ActivationCache needs the model it recorded or, without one, its config=")
            config = model.config
        self._acts = activations
        self.config: K2Config = config
        self.model: K2Model | None = None
        if model is not None:
            self.attach(model)

    def attach(self, model: K2Model) -> ActivationCache:
        """Give the cache the model whose weights its weight-reading analyses use (after unpickling or ``load``).
        The model's config must equal the cache's. Returns the cache."""
        config = getattr(model, "config", None)
        if not isinstance(config, K2Config):
            raise TypeError(f"attach takes the K2Model the cache was recorded from, got {type(model).__name__}")
        if config != self.config:
            differ = [f"{f.name}: cache {getattr(self.config, f.name)!r}, model {getattr(config, f.name)!r}"
                      for f in dataclasses.fields(K2Config) if getattr(self.config, f.name) != getattr(config, f.name)]
            raise ValueError(f"cannot attach a model whose config differs from the cache's: {'; '.join(differ)}")
        self.model = model
        return self

    def _attached_model(self, what: str) -> K2Model:
        if self.model is None:
            raise RuntimeError(f"{what} reads the model's weights, and this cache has no model attached (a pickled or "
                               "saved cache keeps its tensors and config only): call cache.attach(model), or "
                               "ActivationCache.load(path, model=model)")
        return self.model

    # ---- pickling, devices, files -----------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, object]:
        """What pickling (and ``torch.save``) keeps: the tensors and the config, not the model."""
        return {"activations": self._acts, "config": self.config}

    def __setstate__(self, state: dict[str, object]) -> None:
        self._acts, self.config, self.model = state["activations"], state["config"], None

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> ActivationCache:
        """A new cache with every tensor on ``device``; ``dtype`` casts the floating-point tensors only (topk_idx stays
        int64). The model stays attached where it is (the analyses move what they need)."""
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype casts the cache's floating-point tensors: give a floating torch.dtype "
                             f"(torch.bfloat16, torch.float32...) or None, got {dtype!r}")
        moved = {name: t.to(device, dtype=dtype if t.is_floating_point() else None) for name, t in self._acts.items()}
        return ActivationCache(moved, self.model, self.config)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the cache to the directory ``path`` -> ``path``: ``activations.safetensors`` (every tensor, on the CPU,
        dtypes kept) and ``cache.json`` (the probe order, the config, the k2lab version). No weights are written.

        The directory is made beside ``path`` under a temporary name and renamed into place, so a save that fails
        leaves nothing half-written. A cache saved earlier at ``path`` is replaced; any other existing file, or a
        non-empty directory that is not a saved cache, is refused."""
        from safetensors.torch import save_file  # here: ``import k2lab.model`` reads no files

        path = Path(os.path.abspath(path))
        if path.exists() and not _is_saved_cache(path) and not (path.is_dir() and not any(path.iterdir())):
            raise FileExistsError(f"cache.save: {str(path)!r} exists and is not a saved ActivationCache (a directory "
                                  f"with {CACHE_JSON} and {ACTIVATIONS_FILE}); choose a new path or remove it")
        meta = {"format": _CACHE_FORMAT, "format_version": _CACHE_FORMAT_VERSION, "k2lab_version": __version__,
                "probes": list(self._acts), "config": dataclasses.asdict(self.config)}
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")
        staging.mkdir()
        try:
            save_file(_unshared(self._acts), str(staging / ACTIVATIONS_FILE))
            (staging / CACHE_JSON).write_text(json.dumps(meta, indent=1) + "\n")
            _move_into_place(staging, path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, model: K2Model | None = None,
             device: torch.device | str = "cpu") -> ActivationCache:
        """A cache written by ``cache.save(path)``, its tensors on ``device``, in the saved probe order. With
        ``model`` (whose config must match the saved one) the weight-reading analyses work; else attach one later."""
        from safetensors.torch import load_file

        path = Path(path)
        meta = _read_cache_json(path)
        tensors = load_file(str(path / ACTIVATIONS_FILE), device=str(torch.device(device)))
        if sorted(tensors) != sorted(meta["probes"]):
            raise ValueError(f"{str(path)!r}: {ACTIVATIONS_FILE} holds {len(tensors)} tensors that are not the "
                             f"{len(meta['probes'])} probes {CACHE_JSON} lists; the directory was changed after saving")
        try:
            config = K2Config(**meta["config"])
        except TypeError as err:
            raise ValueError(f"{str(path / CACHE_JSON)!r}: its config does not fit this k2lab's K2Config ({err}); it "
                             f"was written by k2lab {meta.get('k2lab_version')}") from err
        return cls({name: tensors[name] for name in meta["probes"]}, model, config)

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
        """A probe name from a name (k2lab's or TransformerLens's spelling), a short model-level name, or a (short
        name, layer) pair (layer may be < 0)."""
        if isinstance(key, tuple):
            if len(key) != 2 or not isinstance(key[1], int):
                raise KeyError(f"a cache key is a probe name or a (short name, layer) pair, got {key!r}")
            short, layer = key
            L = self.config.num_hidden_layers
            if not -L <= layer < L:
                raise KeyError(f"layer {layer} out of range for {L} layers")
            return get_act_name(short, layer % L)
        if not isinstance(key, str):
            raise KeyError(f"a cache key is a probe name or a (short name, layer) pair, got {key!r}")
        key = canonical_probe_name(key)
        if key not in self._acts and key in MODEL_PROBES:
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

    def to_dataframe(self, name: str | tuple[str, int]) -> pandas.DataFrame:
        """A probe as a pandas table (pandas comes with ``pip install k2lab[lab]``), for the probes that read as one:

        - the router's choice, ``...mlp.gate.hook_topk_idx`` or ``hook_topk_weights`` (both are read): one row per
          (batch, position, slot), columns ``batch, position, slot, expert, weight``;
        - ``self_attn.hook_max_logit`` [B, H] (any [B, n] probe): one row per (batch, head), ``batch, head, value``;
        - any other [B, T, n] probe with n <= 64 (a small model's router scores, ``k_pe``...): one row per (batch,
          position), columns ``batch, position`` and one per value, ``expert_{e}`` for the router's [B, T, E]
          probes, ``index_{i}`` for others.

        Bigger probes raise: read them as tensors, ``cache[name]`` or ``cache.stack(suffix)``."""
        try:
            import pandas as pd
        except ImportError as err:
            raise ImportError("cache.to_dataframe needs pandas, which k2lab's lab extra brings: "
                              "pip install k2lab[lab] (or pip install pandas)") from err
        name = self._name(name)
        tensor = self[name]
        gate = re.fullmatch(r"(.*\.gate\.)hook_topk_(idx|weights)", name)
        if gate:
            idx_name, weights_name = gate[1] + "hook_topk_idx", gate[1] + "hook_topk_weights"
            self._require("to_dataframe of the router's choice", [idx_name, weights_name])
            ids, weights = self[idx_name], self[weights_name]  # [B, T, k] each
            return pd.DataFrame({**_index_columns(ids.shape, ("batch", "position", "slot")),
                                 "expert": _numpy(ids.flatten()), "weight": _numpy(weights.flatten())})
        if tensor.dim() not in (2, 3) or tensor.shape[-1] > TABLE_MAX_WIDTH:
            raise ValueError(f"{name} is {list(tensor.shape)}, too big for a table: to_dataframe lays out [B, T, n] "
                             f"and [B, n] probes with n <= {TABLE_MAX_WIDTH}, and the router's topk_idx/topk_weights; "
                             f"read it as a tensor: cache[{name!r}], or cache.stack(suffix) across layers")
        axis = ("head" if name.endswith("self_attn.hook_max_logit")
                else "expert" if re.search(r"\.gate\.hook_(logits|scores|choice_scores)$", name) else "index")
        if tensor.dim() == 2:  # [B, n]: one row per value
            return pd.DataFrame({**_index_columns(tensor.shape, ("batch", axis)), "value": _numpy(tensor.flatten())})
        values = _numpy(tensor.flatten(0, 1))  # [B*T, n]
        columns = {f"{axis}_{i}": values[:, i] for i in range(tensor.shape[-1])}
        return pd.DataFrame({**_index_columns(tensor.shape[:2], ("batch", "position")), **columns})

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

    def _moe_layers(self) -> list[int]:
        return [i for i in range(self.config.num_hidden_layers) if self.config.is_moe_layer(i)]

    # ---- reading the residual stream ---------------------------------------------------------------------------------
    @torch.no_grad()
    def logit_lens(self, pos: Pos = None) -> torch.Tensor:
        """[L, B, T, V] float32, on the cache's device: ``lm_head(norm(resid_post[l]))`` for every layer l, as if the
        model stopped there.

        The last layer's row is the model's logits (same ops on the same tensor). Each layer goes through the head
        on its own, so peak memory is one layer's logits on top of the result; pick ``pos`` (e.g. -1) for long
        prompts and big vocabularies.
        """
        model = self._attached_model("logit_lens")
        names = [f"layers.{i}.hook_resid_post" for i in range(self.config.num_hidden_layers)]
        self._require("logit_lens", names)
        pos = _positions(self[names[0]].shape[1], pos)
        lens = []
        for resid in self.stack("hook_resid_post"):  # [B, T, D], where the cache holds it
            x = _at(resid, pos).to(model.norm.weight.device, model.dtype)
            logits = model.lm_head(model.norm(x).to(model.lm_head.weight.device)).float()
            lens.append(logits.to(resid.device))  # back where the cache is (a cache gathered to the CPU: the CPU)
        return torch.stack(lens)

    def decompose_resid(self, pos: Pos = None, *, pos_slice: Pos = None, return_labels: bool = False
                        ) -> ResidDecomposition | tuple[torch.Tensor, list[str]]:
        """The final residual as a sum of embedding, per-layer attention and MLP outputs, MoE layers further split
        into shared, routed and per-slot expert contributions (weight * expert output). See ResidDecomposition.

        ``return_labels=True`` returns TransformerLens's pair instead: ``(stack [C, B, T, D], labels)``, the rows of
        ``ResidDecomposition.components()`` (``embed``, ``L0.attn``, ``L0.mlp``, ...), which sum to the final residual.
        ``pos_slice`` is TransformerLens's spelling of ``pos``. Needs the config only, not the weights."""
        cfg, L = self.config, self.config.num_hidden_layers
        moe_layers = self._moe_layers()
        moe = [f"layers.{i}.mlp" for i in moe_layers]
        has_shared = cfg.n_shared_experts > 0
        needed = ["embed_tokens.hook_out", f"layers.{L - 1}.hook_resid_post"]
        needed += [f"layers.{i}.{s}" for i in range(L) for s in ("hook_attn_out", "hook_mlp_out")]
        for m in moe:
            needed += [f"{m}.{s}" for s in ("hook_expert_out", "hook_routed_out", "gate.hook_topk_idx",
                                             "gate.hook_topk_weights", *(["hook_shared_out"] if has_shared else []))]
        self._require("decompose_resid", needed)
        pos = _positions(self["embed_tokens.hook_out"].shape[1], pos, pos_slice)

        def per_moe_layer(leaf: str) -> torch.Tensor:  # [L_moe, B, T, ...] at pos (empty for a dense-only model)
            parts = [self[f"{m}.{leaf}"] for m in moe]
            if leaf == "hook_expert_out":  # weight * expert output, as the MoE block sums them: [B, T, k, D]
                weights = [self[f"{m}.gate.hook_topk_weights"][..., None] for m in moe]  # [B, T, k, 1]
                parts = [out * w for out, w in zip(parts, weights, strict=True)]
            return _at(torch.stack(parts), pos, lead=1) if parts else self["embed_tokens.hook_out"].new_zeros((0,))

        parts = ResidDecomposition(
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
        if return_labels:
            labels, stack = parts.components()
            return stack, labels
        return parts

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
        model = self._attached_model("logit_attribution")
        head = model.lm_head.weight
        is_token_id = isinstance(target, int) or not target.is_floating_point()
        if is_token_id:
            target = torch.as_tensor(target, device=head.device)
            V = self.config.vocab_size
            outside = (target < 0) | (target >= V)
            if outside.any():
                raise IndexError(f"target token id {target[outside].flatten()[0].item()} is outside the vocabulary: "
                                 f"token ids lie in 0..{V - 1}")
        parts = self.decompose_resid(pos)
        x = parts.residual.float()  # [B, (T,) D]
        scale = self._frozen_norm_scale(model, pos)  # [B, (T,) D]
        if is_token_id:
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
                          apply_ln: bool = False, return_labels: bool = False, *, pos_slice: Pos = None
                          ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """[C, B, T, D]: the residual stream as it stood before each block, up to ``layer``, as TransformerLens
        stacks it: ``resid_pre`` of layers 0..layer (``"{l}_pre"``), with ``incl_mid`` also each ``resid_mid`` before
        ``layer`` (``"{l}_mid"``); ``layer=None`` (or the number of layers) ends with the final residual
        (``"final_post"``, the final norm's input). ``pos`` (or TransformerLens's ``pos_slice``) selects positions;
        ``apply_ln`` passes the stack through ``apply_ln_to_stack``; ``return_labels`` also returns the labels."""
        L = self.config.num_hidden_layers
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
        pos = _positions(self[names[0]].shape[1], pos, pos_slice)
        stack = torch.stack([_at(self[n].to(self[names[0]].device), pos) for n in names])  # [C, B, (T,) D]
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, pos=pos)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, stack: torch.Tensor, pos: Pos = None, *, pos_slice: Pos = None) -> torch.Tensor:
        """[..., B, (T,) D] float32: each row of ``stack`` scaled as the final norm scales the final residual x,

            row -> g * row / rms(x),       rms(x) = sqrt(mean(x^2) + eps)   (frozen at x, as TransformerLens does)

        so rows that sum to x come out summing to the final norm's output, and ``@ model.lm_head.weight.T`` turns
        each into its direct contribution to the logits. ``pos`` (or ``pos_slice``) must be what selected the stack's
        positions."""
        model = self._attached_model("apply_ln_to_stack")
        final = f"layers.{self.config.num_hidden_layers - 1}.hook_resid_post"
        self._require("apply_ln_to_stack", [final])
        pos = _positions(self[final].shape[1], pos, pos_slice)
        scale = self._frozen_norm_scale(model, pos)  # [B, (T,) D]
        if tuple(stack.shape[stack.dim() - scale.dim() :]) != tuple(scale.shape):
            raise ValueError(f"a stack of shape {tuple(stack.shape)} does not end with the final residual's "
                             f"{tuple(scale.shape)} at pos={pos!r}; pass the pos the stack was made with")
        return stack.float() * scale.to(stack.device)

    @torch.no_grad()
    def stack_head_results(self, layer: int | None = -1, *, pos_slice: Pos = None, pos: Pos = None,
                           return_labels: bool = False, apply_ln: bool = False
                           ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """[L'*H, B, T, D] float32: each attention head's write to the residual, as TransformerLens stacks it. Row
        l*H + h (label ``"L{l}H{h}"``) is head h of layer l through o_proj:

            result[l, h] = z[..., h, :] @ W_O[:, h*V:(h+1)*V]^T      z = self_attn.hook_z [B, T, H, V], W_O [D, H*V]

        so a layer's H rows sum to its ``hook_attn_out`` (o_proj has no bias). ``layer``: the heads of the layers
        strictly before it (1..L); -1 or None, of every layer. ``pos_slice`` (or ``pos``) selects positions;
        ``apply_ln`` passes the stack through ``apply_ln_to_stack``. An o_proj whose weight is not a plain float
        matrix (a quantized module) is run once per head, on z with the other heads zeroed (it is linear)."""
        model = self._attached_model("stack_head_results")
        L, H = self.config.num_hidden_layers, self.config.num_attention_heads
        if layer is None or layer == -1:
            layer = L
        if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= L:
            raise ValueError(f"layer must be in 1..{L} (the heads of the layers before it), or -1 or None for every "
                             f"layer; got {layer!r}")
        names = [f"layers.{i}.self_attn.hook_z" for i in range(layer)]
        self._require("stack_head_results", names)
        pos = _positions(self[names[0]].shape[1], pos, pos_slice)
        device = self[names[0]].device
        per_layer = [_head_results(_at(self[name], pos), model.layers[i].self_attn.o_proj, model.dtype).to(device)
                     for i, name in enumerate(names)]  # each [H, B, (T,) D]
        stack = torch.cat(per_layer)  # [layer * H, B, (T,) D]
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, pos=pos)
        labels = [f"L{i}H{h}" for i in range(layer) for h in range(H)]
        return (stack, labels) if return_labels else stack

    def stack_expert_results(self, layer: int, *, pos_slice: Pos = None, pos: Pos = None,
                             return_labels: bool = False) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """[E, B, T, D]: each routed expert's weighted write at MoE layer ``layer`` (label ``"L{l}E{e}"``),
        w * expert_e(x) where the token chose expert e and zero where it did not. The rows sum to the layer's
        ``hook_routed_out``, and with ``hook_shared_out`` to its ``hook_mlp_out``. ``layer`` may count from the end
        (-1); ``pos_slice`` (or ``pos``) selects positions. Needs the config only, not the weights."""
        L = self.config.num_hidden_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not -L <= layer < L:
            raise ValueError(f"layer must be an int in {-L}..{L - 1}, got {layer!r}")
        layer %= L
        if not self.config.is_moe_layer(layer):
            raise ValueError(f"layer {layer} is a dense layer, with no routed experts; MoE layers: "
                             f"{self._moe_layers()}")
        names = [f"layers.{layer}.mlp.{leaf}" for leaf in ("hook_expert_out", "gate.hook_topk_idx",
                                                             "gate.hook_topk_weights")]
        self._require("stack_expert_results", names)
        expert_out, ids, weights = (self[name] for name in names)  # [B, T, k, D], [B, T, k], [B, T, k]
        pos = _positions(ids.shape[1], pos, pos_slice)
        slots = _at(expert_out * weights[..., None], pos)  # [B, (T,) k, D], as decompose_resid weighs them
        stack = _per_expert(slots, _at(ids, pos), self.config.n_routed_experts)  # [E, B, (T,) D]
        labels = [f"L{layer}E{e}" for e in range(self.config.n_routed_experts)]
        return (stack, labels) if return_labels else stack

    def _frozen_norm_scale(self, model: K2Model, pos: Pos) -> torch.Tensor:
        """[B, (T,) D] float32 g / rms(x) at the final residual x: the final RMSNorm with its rms frozen, the one
        linear map that both ``logit_attribution`` and ``apply_ln_to_stack`` apply to residual terms."""
        x = _at(self[f"layers.{self.config.num_hidden_layers - 1}.hook_resid_post"], pos).float()  # [B, (T,) D]
        norm = model.norm
        inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)  # [B, (T,) 1]
        return norm.weight.to(x.device, torch.float32) * inv_rms

    def _require(self, what: str, names: list[str]) -> None:
        missing = [n for n in names if n not in self]
        if missing:
            raise KeyError(f"{what} needs probes missing from this cache, e.g. {missing[:3]} ({len(missing)} in all); "
                           "record them with run_with_cache(ids) (all probes) or include them in names=")


def _positions(length: int, pos: Pos, pos_slice: Pos = None) -> Pos:
    """The position selector given as ``pos`` or as ``pos_slice`` (TransformerLens's spelling), checked against the
    cache's ``length`` positions: None (all), a slice, or an int in -length..length-1 (which drops T)."""
    if pos is not None and pos_slice is not None:
        raise ValueError(f"give pos= or pos_slice= (two spellings of one position selector), not both: got "
                         f"pos={pos!r}, pos_slice={pos_slice!r}")
    argument, value = ("pos_slice", pos_slice) if pos_slice is not None else ("pos", pos)
    if value is None or isinstance(value, slice):
        return value
    try:
        index = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        index = None
    if index is None:
        raise TypeError(f"{argument} selects positions: give an int, a slice or None, got {value!r}")
    if not -length <= index < length:
        raise IndexError(f"{argument}={index} is outside the {length} positions of this cache: give an int in "
                         f"{-length}..{length - 1}, a slice, or None")
    return index


def _at(t: torch.Tensor, pos: Pos, lead: int = 0) -> torch.Tensor:
    """Select positions along T of a [lead..., B, T, ...] tensor (``pos`` checked by ``_positions``)."""
    return t if pos is None else t[(slice(None),) * (lead + 1) + (pos,)]


def _per_expert(slots: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per-slot contributions gathered by expert: slots [B, (T,) k, (D)] filled by experts ids [B, (T,) k] ->
    [E, B, (T,) (D)], zero where a token did not choose the expert."""
    one_hot = torch.nn.functional.one_hot(ids, num_experts).to(slots.dtype)  # [B, (T,) k, E]
    lead = "bt"[: ids.dim() - 1]  # "b" when an int pos dropped T
    last = "d" if slots.dim() > ids.dim() else ""  # "" once projected onto a logit
    return torch.einsum(f"{lead}ke,{lead}k{last}->e{lead}{last}", one_hot, slots)


def _head_results(z: torch.Tensor, o_proj: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """z [B, (T,) H, V] -> [H, B, (T,) D] float32 on z's device: each head's share of ``o_proj(z.flatten(-2))``.

    A plain Linear: its weight [D, H*V] viewed as [D, H, V], one product per head. Any other o_proj (a quantized
    module, whose stored tensors are not the matrix): the module itself on z with every other head zeroed, in the
    model's ``dtype``; o_proj is linear without a bias, so those H outputs sum to o_proj(z)."""
    H, V = z.shape[-2:]
    if isinstance(o_proj, nn.Linear) and o_proj.weight.is_floating_point():
        per_head = o_proj.weight.detach().to(z.device, torch.float32).unflatten(1, (H, V))  # [D, H, V]
        return torch.einsum("...hv,dhv->h...d", z.float(), per_head)
    device = next((t.device for t in (*o_proj.parameters(), *o_proj.buffers())), z.device)
    heads = []
    for h in range(H):
        alone = torch.zeros(z.shape, dtype=dtype, device=device)  # [B, (T,) H, V]
        alone[..., h, :] = z[..., h, :]
        heads.append(o_proj(alone.flatten(-2)).float().to(z.device))  # [B, (T,) D]
    return torch.stack(heads)


def _index_columns(shape: torch.Size | tuple[int, ...], names: tuple[str, ...]) -> dict[str, object]:
    """name -> the flattened index along that dimension of a tensor of ``shape`` (row-major, as ``flatten`` orders)."""
    grids = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
    return {name: grid.flatten().numpy() for name, grid in zip(names, grids, strict=True)}


def _numpy(t: torch.Tensor) -> object:
    """A tensor as a NumPy array on the CPU (bfloat16, which NumPy lacks, as float32)."""
    return (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy()


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors on the CPU, contiguous, each with a storage of its own: safetensors refuses tensors sharing memory,
    and a cache shares it where one probe is the same tensor as another (layer 0's resid_pre is the embedding) or a
    view of the same buffer (q_nope and q_pe)."""
    seen, out = set(), {}
    for name, t in tensors.items():
        t = t.detach().to("cpu")
        if not t.is_contiguous() or t.untyped_storage().data_ptr() in seen:
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _read_cache_json(path: Path) -> dict:
    """The metadata of the cache saved at ``path``; raises, naming the path, where there is none."""
    file = path / CACHE_JSON
    if not file.is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a saved ActivationCache: it has no {CACHE_JSON} "
                                "(cache.save(path) writes one)")
    try:
        meta = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(file)!r} is not valid JSON: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != _CACHE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{str(file)!r} does not describe an ActivationCache (format {found!r}, expected "
                         f"{_CACHE_FORMAT!r})")
    if meta.get("format_version") != _CACHE_FORMAT_VERSION:
        raise ValueError(f"{str(file)!r} has format_version {meta.get('format_version')!r}; this k2lab reads "
                         f"version {_CACHE_FORMAT_VERSION}")
    return meta


def _is_saved_cache(path: Path) -> bool:
    try:
        _read_cache_json(path)
    except (OSError, ValueError):
        return False
    return True


def _move_into_place(staging: Path, path: Path) -> None:
    """Rename the finished directory ``staging`` to ``path``; what was at ``path`` (a saved cache, an empty directory)
    is set aside first and deleted only once the new one is in place, or put back if the rename fails."""
    retired = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.old") if path.exists() else None
    if retired is not None:
        os.rename(path, retired)
    try:
        os.rename(staging, path)
    except BaseException:
        if retired is not None:
            os.rename(retired, path)
        raise
    if retired is not None:
        shutil.rmtree(retired)
