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
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from ..config import K2Config
from ..version import __version__
from .devices import available_device
from .hooks import MODEL_PROBES, canonical_probe_name, get_act_name

if TYPE_CHECKING:
    import pandas

    from .transformer import K2Model

Pos = int | slice | None  # a position selector along T; an int drops the T dimension
ResidMode = Literal["all", "attn", "mlp"]  # which terms decompose_resid's stack keeps (TransformerLens's mode)
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")

# cache.save writes a directory holding these two files.
ACTIVATIONS_FILE = "activations.safetensors"  # every tensor, by probe name
CACHE_JSON = "cache.json"  # probe order, config, k2lab version
MASK_TENSOR = "attention_mask"  # the forward's attention mask, beside the probes in ACTIVATIONS_FILE (no probe's name)
_CACHE_FORMAT, _CACHE_FORMAT_VERSION = "k2lab.ActivationCache", 1
TABLE_MAX_WIDTH = 64  # to_dataframe: the largest trailing size it lays out as a table


@dataclass
class ResidDecomposition:
    """The final residual (the input of the final norm) split into the terms that were added to it.

    Shapes below use ``*`` for the last dimension: D for ``cache.decompose_resid()``, nothing for
    ``cache.logit_attribution()`` (each term projected onto one logit). With an int ``pos``, T is dropped.

        residual = embed + attn.sum(0) + mlp.sum(0) + sum(edits.values())
        mlp[l]   = shared[j] + routed[j]             for MoE layer l = moe_layers[j]
        routed[j] = expert_slots[j].sum(-2)          slot s of token (b, t): expert expert_ids[j, b, t, s]

    ``edits`` holds what changed the residual stream itself rather than adding to it: a dictionary spliced into
    ``layers.{l}.hook_resid_post`` (its reconstruction in place of the stream: the term is reconstruction - stream,
    minus the dictionary's error), or a hook's replacement there. Each is the probe's recorded value less the sum that
    reached it; a plain forward has none.
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
    edits: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # label -> [B, T, *] (see above)

    def total(self) -> torch.Tensor:
        """embed + sum of attention and feed-forward outputs + the edits: equals ``residual`` up to float rounding."""
        return self.embed + self.attn.sum(0) + self.mlp.sum(0) + sum(self.edits.values())

    def components(self, split_moe: bool = False) -> tuple[list[str], torch.Tensor]:
        """(labels, [C, B, T, *]) in forward order: ``embed``, ``L0.attn``, ``L0.mlp``, ... (and an edit where one
        changed the stream, ``L{l}.resid_pre.edit``, ``.resid_mid.edit`` or ``.resid_post.edit``, after the terms that
        reached it). With ``split_moe`` each MoE layer's ``mlp`` is replaced by ``L{l}.shared`` and ``L{l}.routed``.
        The rows sum to ``residual``."""
        labels, parts = ["embed"], [self.embed]

        def edit(label: str) -> None:
            if label in self.edits:
                labels.append(label)
                parts.append(self.edits[label])

        for l in range(self.attn.shape[0]):
            edit(f"L{l}.resid_pre.edit")
            labels.append(f"L{l}.attn")
            parts.append(self.attn[l])
            edit(f"L{l}.resid_mid.edit")
            if l >= self.mlp.shape[0]:  # decompose_resid(layer, mlp_input=True): the layer's attention only
                continue
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
            edit(f"L{l}.resid_post.edit")
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
            edits={label: fn(t, 0) for label, t in self.edits.items()},
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
                 config: K2Config | None = None, mask: torch.Tensor | None = None):
        """``activations``: probe name -> tensor, in firing order. ``config`` defaults to ``model.config``; given both,
        they must agree (``attach``). ``mask``: the attention mask [B, T] bool the forward ran with (False on pads;
        None: no pads), which the cache keeps so that its tables and stacks leave the pads out."""
        if config is None:
            if model is None:
                raise ValueError("an ActivationCache needs the model it recorded or, without one, its config=")
            config = model.config
        if mask is not None:
            mask = torch.as_tensor(mask)
            if mask.dtype != torch.bool or mask.dim() != 2:
                raise ValueError(f"mask must be the attention mask [B, T] bool the forward ran with, got "
                                 f"{mask.dtype} {tuple(mask.shape)}")
        self._acts = activations
        self.config: K2Config = config
        self.mask: torch.Tensor | None = mask  # [B, T] bool: True for a token, False for a pad; None: no pads
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
        """What pickling (and ``torch.save``) keeps: the tensors, the mask and the config, not the model."""
        return {"activations": self._acts, "config": self.config, "mask": self.mask}

    def __setstate__(self, state: dict[str, object]) -> None:
        self._acts, self.config, self.model = state["activations"], state["config"], None
        self.mask = state.get("mask")

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> ActivationCache:
        """A new cache with every tensor on ``device``; ``dtype`` casts the floating-point tensors only (topk_idx stays
        int64). The model stays attached where it is (the analyses move what they need)."""
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype casts the cache's floating-point tensors: give a floating torch.dtype "
                             f"(torch.bfloat16, torch.float32...) or None, got {dtype!r}")
        device = available_device(device, "device")
        moved = {name: t.to(device, dtype=dtype if t.is_floating_point() else None) for name, t in self._acts.items()}
        return ActivationCache(moved, self.model, self.config, None if self.mask is None else self.mask.to(device))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the cache to the directory ``path`` -> ``path``: ``activations.safetensors`` (every tensor and the
        attention mask, on the CPU, dtypes kept) and ``cache.json`` (the probe order, the config, the k2lab version).
        No weights are written.

        The directory is made beside ``path`` under a temporary name and renamed into place, so a save that fails
        leaves nothing half-written. A cache saved earlier at ``path`` (those two files and nothing else) is replaced;
        any other existing file, or a directory holding anything else, is refused, so no file of yours is lost."""
        from safetensors.torch import save_file  # here: ``import k2lab.model`` reads no files

        path = Path(os.path.abspath(path))
        if path.exists() and not path.is_dir():
            raise FileExistsError(f"cache.save: {str(path)!r} exists and is not a saved ActivationCache (a directory "
                                  f"with {CACHE_JSON} and {ACTIVATIONS_FILE}); choose a new path or remove it")
        if path.exists():
            foreign = sorted(p.name for p in path.iterdir())
            if _is_saved_cache(path):
                foreign = [name for name in foreign if name not in (ACTIVATIONS_FILE, CACHE_JSON)]
            if foreign:
                raise FileExistsError(f"cache.save: {str(path)!r} exists and is not a saved ActivationCache alone: it "
                                      f"holds {foreign[:5]}, and a save replaces the whole directory, so they would "
                                      f"be lost; choose a new or empty path")
        shapeless = [name for name, t in self._acts.items() if t.device.type == "meta"]
        if shapeless:
            raise ValueError(f"cache.save: {shapeless[0]} (and {len(shapeless) - 1} more) are on the meta device, "
                             f"shapes without values, which cannot be written; record a model on a real device")
        meta = {"format": _CACHE_FORMAT, "format_version": _CACHE_FORMAT_VERSION, "k2lab_version": __version__,
                "probes": list(self._acts), "config": dataclasses.asdict(self.config),
                "attention_mask": self.mask is not None}
        tensors = {**self._acts, **({} if self.mask is None else {MASK_TENSOR: self.mask})}
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")
        staging.mkdir()
        try:
            save_file(_unshared(tensors), str(staging / ACTIVATIONS_FILE))
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
        ``model`` (whose config must match the saved one) the weight-reading analyses work; else attach one later.
        Every tensor's shape is checked against what the saved config makes that probe."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        meta = _read_cache_json(path)
        device = available_device(device, "device")
        try:
            tensors = load_file(str(path / ACTIVATIONS_FILE), device=str(device))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{str(path / ACTIVATIONS_FILE)!r} cannot be read as safetensors ({err}): a file cut "
                             f"short or replaced after saving") from None
        mask = tensors.pop(MASK_TENSOR, None)
        if sorted(tensors) != sorted(meta["probes"]) or (mask is not None) != bool(meta.get("attention_mask")):
            raise ValueError(f"{str(path)!r}: {ACTIVATIONS_FILE} holds {len(tensors)} tensors that are not the "
                             f"{len(meta['probes'])} probes {CACHE_JSON} lists; the directory was changed after saving")
        try:
            config = K2Config(**meta["config"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"{str(path / CACHE_JSON)!r}: its config does not fit this k2lab's K2Config ({err}); it "
                             f"was written by k2lab {meta.get('k2lab_version')}") from err
        cache = cls({name: tensors[name] for name in meta["probes"]}, model, config, mask)
        cache._check_shapes(str(path / ACTIVATIONS_FILE))
        return cache

    def _check_shapes(self, where: str) -> None:
        """Every probe's tensor has the shape the cache's config gives that probe (``probe_shape``) for the batch and
        length of its tokens, and the mask is [B, T]; raises naming ``where``, the probe and both shapes."""
        resid = self._acts.get("embed_tokens.hook_out", self._acts.get("layers.0.hook_resid_pre"))
        if resid is None:
            return  # nothing tells the batch and length; the names were checked against the probe list
        B, T = resid.shape[:2]
        if self.mask is not None and tuple(self.mask.shape) != (B, T):
            raise ValueError(f"{where}: the attention mask is {tuple(self.mask.shape)} but the tokens are {(B, T)}")
        for name, t in self._acts.items():
            want = probe_shape(name.removesuffix("_grad"), self.config, B, T)
            if want is not None and tuple(t.shape) != want:
                raise ValueError(f"{where}: {name} is {tuple(t.shape)}, but the saved config makes it {want}: the "
                                 f"file does not belong to this config")

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

        Positions are the cache's [B, T] indices; pads (``cache.mask``) have no rows, as in a routing trace's table.
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
            table = pd.DataFrame({**_index_columns(ids.shape, ("batch", "position", "slot")),
                                  "expert": _numpy(ids.flatten()), "weight": _numpy(weights.flatten())})
            return self._real_rows(table, ids.shape[-1])
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
        return self._real_rows(pd.DataFrame({**_index_columns(tensor.shape[:2], ("batch", "position")), **columns}), 1)

    def _real_rows(self, table: pandas.DataFrame, per_token: int) -> pandas.DataFrame:
        """The rows of a table laid out ``per_token`` rows per (batch, position), in [B, T] order, without the pads'."""
        if self.mask is None:
            return table
        keep = self.mask.cpu().flatten().repeat_interleave(per_token).numpy()
        return table[keep].reset_index(drop=True)

    # ---- per-layer stacks --------------------------------------------------------------------------------------------
    def layer_indices(self, suffix: str) -> list[int]:
        """The layers whose probe ``layers.{i}.<...>suffix`` is in the cache, ascending (for MoE-only probes the dense
        layers are absent)."""
        return [layer for layer, _ in self._layer_names(suffix)]

    def stack(self, suffix: str) -> torch.Tensor:
        """[L, ...]: the probe ``suffix`` of every layer, stacked along a new first axis, row i for layer i.

        ``suffix`` is the part after ``layers.{i}.``, whole or by its last components: ``"hook_resid_post"``,
        ``"self_attn.hook_pattern"``, ``"hook_topk_idx"``. A layer without the probe (a dense layer, for the router's
        and the experts' probes) has its row filled, and so do the pads' positions (``cache.mask``; a pad's query row
        of an attention pattern): NaN for floating point, -1 for indices, so that nothing averages or counts them by
        mistake. ``stack_present`` gives the layers that have the probe, as recorded."""
        layers, present = self.stack_present(suffix)
        fill = torch.nan if present.is_floating_point() else -1
        stack = present.new_full((self.config.num_hidden_layers, *present.shape[1:]), fill)
        stack[layers] = present
        leaf = self._layer_names(suffix)[0][1].rpartition(".")[2]
        if self.mask is not None and leaf != "hook_max_logit":  # [B, H]: no position axis
            pads = ~self.mask.to(stack.device)  # [B, T]
            if leaf in ("hook_attn_scores", "hook_pattern"):  # [L, B, H, T, S]: the pads' query rows
                stack.permute(0, 1, 3, 2, 4)[:, pads] = fill
            else:  # [L, B, T, ...]
                stack[:, pads] = fill
        return stack

    def stack_present(self, suffix: str) -> tuple[list[int], torch.Tensor]:
        """(the layers that have the probe ``suffix``, [L', ...] their tensors stacked as recorded, pads included)."""
        names = self._layer_names(suffix)
        tensors = [self[name] for _, name in names]
        return [layer for layer, _ in names], torch.stack([t.to(tensors[0].device) for t in tensors])

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

    def _moe_layers(self, stop: int | None = None) -> list[int]:
        stop = self.config.num_hidden_layers if stop is None else stop
        return [i for i in range(stop) if self.config.is_moe_layer(i)]

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
        for resid in self.stack_present("hook_resid_post")[1]:  # [B, T, D], where the cache holds it
            x = _at(resid, pos).to(model.norm.weight.device, model.dtype)
            logits = model.lm_head(model.norm(x).to(model.lm_head.weight.device)).float()
            lens.append(logits.to(resid.device))  # back where the cache is (a cache gathered to the CPU: the CPU)
        return torch.stack(lens)

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: ResidMode = "all",
                        apply_ln: bool = False, pos_slice: Pos = None, incl_embeds: bool = True,
                        return_labels: bool = False, *, pos: Pos = None
                        ) -> ResidDecomposition | tuple[torch.Tensor, list[str]]:
        """The residual stream as a sum of the embedding, each layer's attention and MLP outputs and any edit of the
        stream itself (a spliced dictionary's reconstruction in place of the stream), MoE layers further split into
        shared, routed and per-slot expert contributions (weight * expert output). See ResidDecomposition.

        TransformerLens's arguments, in its order: ``layer`` (None or -1: the final residual, the final norm's
        input; l: the terms that make ``resid_pre`` of layer l), ``mlp_input`` (also layer l's attention: the terms
        of its ``resid_mid``, the MLP's input), ``mode`` ("all", "attn" or "mlp": which terms the stack keeps),
        ``apply_ln`` (each term through the norm that reads that residual, its rms frozen: ``apply_ln_to_stack``),
        ``pos_slice`` (positions), ``incl_embeds``, ``return_labels``: TransformerLens's pair ``(stack [C, B, T, D],
        labels)``, the rows of ``ResidDecomposition.components()`` (``embed``, ``L0.attn``, ``L0.mlp``, ...), which
        sum to the residual. k2lab's own ``pos`` is the keyword spelling of ``pos_slice``. Needs the config only, not
        the weights, unless ``apply_ln``."""
        cfg, L = self.config, self.config.num_hidden_layers
        stop = _layer_arg(layer, L, "layer")
        if mlp_input and stop == L:
            raise ValueError("mlp_input=True reads the MLP input of layer `layer` (its resid_mid): give a layer < "
                             f"{L}; the final residual has no MLP after it")
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"mode must be 'all', 'attn' or 'mlp' (which terms the stack keeps), got {mode!r}")
        if not return_labels and (mode != "all" or not incl_embeds):
            raise ValueError("mode= and incl_embeds= choose rows of TransformerLens's stack: pass return_labels=True "
                             "(without it, k2lab's ResidDecomposition keeps every term)")
        attn_layers, mlp_layers = range(stop + int(mlp_input)), range(stop)
        moe_layers = self._moe_layers(stop)
        moe = [f"layers.{i}.mlp" for i in moe_layers]
        has_shared = cfg.n_shared_experts > 0
        residual_name = (f"layers.{L - 1}.hook_resid_post" if stop == L
                         else f"layers.{stop}.hook_resid_{'mid' if mlp_input else 'pre'}")
        needed = ["embed_tokens.hook_out", residual_name, *(f"layers.{i}.hook_attn_out" for i in attn_layers),
                  *(f"layers.{i}.hook_mlp_out" for i in mlp_layers)]
        for m in moe:
            needed += [f"{m}.{s}" for s in ("hook_expert_out", "hook_routed_out", "gate.hook_topk_idx",
                                             "gate.hook_topk_weights", *(["hook_shared_out"] if has_shared else []))]
        self._require("decompose_resid", needed)
        pos = _positions(self["embed_tokens.hook_out"].shape[1], pos, pos_slice)
        embed = self["embed_tokens.hook_out"]

        def layers_of(leaf: str, layers: range) -> torch.Tensor:  # [n, B, T, D] at pos
            if not len(layers):
                return _at(embed, pos).new_zeros((0, *_at(embed, pos).shape))
            return _at(torch.stack([self[f"layers.{i}.{leaf}"].to(embed.device) for i in layers]), pos, lead=1)

        def per_moe_layer(leaf: str) -> torch.Tensor:  # [L_moe, B, T, ...] at pos (empty for a dense-only model)
            parts = [self[f"{m}.{leaf}"] for m in moe]
            if leaf == "hook_expert_out":  # weight * expert output, as the MoE block sums them: [B, T, k, D]
                weights = [self[f"{m}.gate.hook_topk_weights"][..., None] for m in moe]  # [B, T, k, 1]
                parts = [out * w for out, w in zip(parts, weights, strict=True)]
            return _at(torch.stack(parts), pos, lead=1) if parts else embed.new_zeros((0,))

        parts = ResidDecomposition(
            embed=_at(embed, pos),
            attn=layers_of("hook_attn_out", attn_layers),
            mlp=layers_of("hook_mlp_out", mlp_layers),
            moe_layers=moe_layers,
            shared=per_moe_layer("hook_shared_out") if has_shared else None,
            routed=per_moe_layer("hook_routed_out"),
            expert_slots=per_moe_layer("hook_expert_out"),
            expert_ids=per_moe_layer("gate.hook_topk_idx"),
            num_experts=cfg.n_routed_experts,
            residual=_at(self[residual_name], pos),
            edits={label: _at(t, pos) for label, t in self._stream_edits(stop, mlp_input).items()},
        )
        if apply_ln:
            scale = self._norm_scale(self._attached_model("decompose_resid(apply_ln=True)"), stop, mlp_input, pos)
            parts = parts.map(lambda t, extra: t.float() * scale.reshape(
                scale.shape[:-1] + (1,) * extra + scale.shape[-1:]).to(t.device) if t.numel() else t.float())
        if not return_labels:
            return parts
        labels, stack = parts.components()
        keep = [i for i, label in enumerate(labels) if (label != "embed" or incl_embeds) and (
            mode == "all" or (label == "embed") or label.endswith("." + mode))]
        return stack[keep], [labels[i] for i in keep]

    def _stream_edits(self, stop: int, mlp_input: bool) -> dict[str, torch.Tensor]:
        """{label: [B, T, D]} what changed the residual stream before the residual ``decompose_resid`` reads, rather
        than adding to it: at each residual probe, its recorded value less the sum that reached it (exactly zero in a
        plain forward, where the probe holds that very sum). Where a probe is missing from the cache, its edit cannot
        be told and is left out."""
        L, edits = self.config.num_hidden_layers, {}
        previous = "embed_tokens.hook_out"  # what reached resid_pre of the next layer

        def edit(label: str, name: str, reached: list[str]) -> None:
            if name in self and all(r in self for r in reached):
                got = self[name]
                delta = got - sum(self[r].to(got.device) for r in reached)
                if bool((delta != 0).any()):
                    edits[label] = delta

        for l in range(min(stop + int(mlp_input), L)):
            edit(f"L{l}.resid_pre.edit", f"layers.{l}.hook_resid_pre", [previous])
            if l < stop or mlp_input:
                edit(f"L{l}.resid_mid.edit", f"layers.{l}.hook_resid_mid",
                     [f"layers.{l}.hook_resid_pre", f"layers.{l}.hook_attn_out"])
            if l < stop:
                edit(f"L{l}.resid_post.edit", f"layers.{l}.hook_resid_post",
                     [f"layers.{l}.hook_resid_mid", f"layers.{l}.hook_mlp_out"])
            previous = f"layers.{l}.hook_resid_post"
        return edits

    @torch.no_grad()
    def logit_attribution(self, target: int | torch.Tensor, pos: Pos = None) -> ResidDecomposition:
        """Direct logit attribution: ``decompose_resid(pos=pos)`` with every term projected onto one logit.

        ``target`` is a token id (int, or an integer tensor [B] or [B, T] matching the positions) or a direction in
        residual space (float [D], or [B, (T,) D]); for a logit difference pass
        ``model.lm_head.weight[a] - model.lm_head.weight[b]``.

        The final norm is RMSNorm(x) = g * x / rms(x), rms(x) = sqrt(mean(x^2) + eps), and a logit is
        u . RMSNorm(x) with u the head's row. It is linear in x once rms is frozen at the final residual x, so

            contribution(c) = u . (g * c) / rms(x)        and the contributions sum to the logit (float rounding)

        (TransformerLens's ``apply_ln_to_stack`` does the same with LayerNorm; RMSNorm has no centring). The
        frozen scale is the linearisation: a term's contribution is not the logit change from removing it. Under a
        spliced dictionary the terms include its edit of the stream, so they still sum to the logit.
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
        parts = self.decompose_resid(pos=pos)
        x = parts.residual.float()  # [B, (T,) D]
        scale = self._norm_scale(model, self.config.num_hidden_layers, False, pos)  # [B, (T,) D]
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
    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice: Pos = None, mlp_input: bool = False, return_labels: bool = False, *,
                          pos: Pos = None) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """[C, B, T, D]: the residual stream as it stood before each block, as TransformerLens stacks it, with its
        arguments in its order. ``layer`` None or -1: every block's ``resid_pre`` (``"{l}_pre"``) and the final
        residual (``"final_post"``, the final norm's input); l: the ``resid_pre`` of layers 0..l, and with
        ``mlp_input`` also layer l's ``resid_mid``. ``incl_mid`` adds each ``resid_mid`` before ``layer``
        (``"{l}_mid"``). ``apply_ln`` passes the stack through the norm that reads the last residual
        (``apply_ln_to_stack(stack, layer, mlp_input)``); ``pos_slice`` (k2lab's keyword ``pos``) selects positions;
        ``return_labels`` also returns the labels."""
        L = self.config.num_hidden_layers
        stop = _layer_arg(layer, L, "layer")
        if mlp_input and stop == L:
            raise ValueError(f"mlp_input=True adds layer `layer`'s resid_mid: give a layer < {L}")
        labels, names = [], []
        for i in range(stop + 1):
            if i == L:
                labels.append("final_post")
                names.append(f"layers.{L - 1}.hook_resid_post")
                break
            labels.append(f"{i}_pre")
            names.append(f"layers.{i}.hook_resid_pre")
            if (incl_mid and i < stop) or (mlp_input and i == stop):
                labels.append(f"{i}_mid")
                names.append(f"layers.{i}.hook_resid_mid")
        self._require("accumulated_resid", names)
        pos = _positions(self[names[0]].shape[1], pos, pos_slice)
        stack = torch.stack([_at(self[n].to(self[names[0]].device), pos) for n in names])  # [C, B, (T,) D]
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, None if stop == L else stop, mlp_input, pos=pos)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
                          pos_slice: Pos = None, batch_slice: int | slice | None = None, has_batch_dim: bool = True,
                          *, pos: Pos = None) -> torch.Tensor:
        """[..., B, (T,) D] float32: each row of ``residual_stack`` scaled as the norm that reads a residual scales
        it, its rms frozen there (as TransformerLens does):

            row -> g * row / rms(x),       rms(x) = sqrt(mean(x^2) + eps)

        ``layer`` None or -1: the final norm, x the final residual (rows that sum to x come out summing to the final
        norm's output, and ``@ model.lm_head.weight.T`` turns each into its direct contribution to the logits); l:
        layer l's ``input_layernorm`` at its ``resid_pre``, or with ``mlp_input`` its ``post_attention_layernorm`` at
        its ``resid_mid``. ``pos_slice`` (k2lab's keyword ``pos``) and ``batch_slice`` must be what selected the
        stack's positions and rows; ``has_batch_dim=False``: the stack has no batch axis (one sequence)."""
        model = self._attached_model("apply_ln_to_stack")
        L = self.config.num_hidden_layers
        stop = _layer_arg(layer, L, "layer")
        if mlp_input and stop == L:
            raise ValueError(f"mlp_input=True reads layer `layer`'s post_attention_layernorm: give a layer < {L}")
        x = self[f"layers.{L - 1}.hook_resid_post" if stop == L else f"layers.{stop}.hook_resid_pre"]
        pos = _positions(x.shape[1], pos, pos_slice)
        scale = self._norm_scale(model, stop, mlp_input, pos)  # [B, (T,) D]
        if batch_slice is not None:
            scale = scale[batch_slice] if isinstance(batch_slice, slice) else scale[batch_slice : batch_slice + 1]
        if not has_batch_dim:
            if scale.shape[0] != 1:
                raise ValueError(f"has_batch_dim=False reads one sequence, but the cache holds {scale.shape[0]}: pick "
                                 f"one with batch_slice=")
            scale = scale[0]
        if tuple(residual_stack.shape[residual_stack.dim() - scale.dim() :]) != tuple(scale.shape):
            raise ValueError(f"a stack of shape {tuple(residual_stack.shape)} does not end with the residual's "
                             f"{tuple(scale.shape)} at pos_slice={pos!r}, batch_slice={batch_slice!r}; pass what "
                             f"made the stack")
        return residual_stack.float() * scale.to(residual_stack.device)

    @torch.no_grad()
    def logit_attrs(self, residual_stack: torch.Tensor, tokens: int | torch.Tensor,
                    incorrect_tokens: int | torch.Tensor | None = None, pos_slice: Pos = None,
                    batch_slice: int | slice | None = None, has_batch_dim: bool = True, *,
                    pos: Pos = None) -> torch.Tensor:
        """TransformerLens's ``logit_attrs``: each row of ``residual_stack`` [C, B, (T,) D] through the final norm (its
        rms frozen at the final residual: ``apply_ln_to_stack``) and onto the head's row of ``tokens`` (an id, or ids
        [B] or [B, T]), less the row of ``incorrect_tokens`` when given (a logit difference) -> [C, B, (T,)]."""
        model = self._attached_model("logit_attrs")
        head, V = model.lm_head.weight, self.config.vocab_size

        def rows(ids: int | torch.Tensor, name: str) -> torch.Tensor:
            ids = torch.as_tensor(ids, device=head.device)
            if ids.is_floating_point() or ids.dtype == torch.bool or bool(((ids < 0) | (ids >= V)).any()):
                raise ValueError(f"{name} must be token ids in 0..{V - 1} (an int, or ints [B] or [B, T]), got {ids!r}")
            return head[ids].to(residual_stack.device, torch.float32)  # [..., D]

        direction = rows(tokens, "tokens")
        if incorrect_tokens is not None:
            direction = direction - rows(incorrect_tokens, "incorrect_tokens")
        scaled = self.apply_ln_to_stack(residual_stack, None, False, pos_slice, batch_slice, has_batch_dim, pos=pos)
        if direction.dim() == 2 and scaled.dim() == 4:  # one id per sequence, at every position
            direction = direction[:, None]
        try:
            return (scaled * direction).sum(-1)
        except RuntimeError as err:
            raise ValueError(f"tokens give directions of shape {tuple(direction.shape)}, which do not broadcast to the "
                             f"stack {tuple(scaled.shape)}") from err

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

    def _norm_scale(self, model: K2Model, layer: int, mlp_input: bool, pos: Pos) -> torch.Tensor:
        """[B, (T,) D] float32 g / rms(x) at the residual x that a norm reads: the final norm at the final residual
        (``layer`` = L), else layer ``layer``'s input_layernorm at its resid_pre (post_attention_layernorm at its
        resid_mid with ``mlp_input``): the norm with its rms frozen, the linear map that ``logit_attribution``,
        ``apply_ln_to_stack`` and ``decompose_resid(apply_ln=True)`` apply to residual terms."""
        L = self.config.num_hidden_layers
        if layer == L:
            name, norm = f"layers.{L - 1}.hook_resid_post", model.norm
        else:
            block = model.layers[layer]
            name = f"layers.{layer}.hook_resid_{'mid' if mlp_input else 'pre'}"
            norm = block.post_attention_layernorm if mlp_input else block.input_layernorm
        self._require("the norm's frozen scale", [name])
        x = _at(self[name], pos).float()  # [B, (T,) D]
        inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)  # [B, (T,) 1]
        return norm.weight.to(x.device, torch.float32) * inv_rms

    def _require(self, what: str, names: list[str]) -> None:
        missing = [n for n in names if n not in self]
        if missing:
            raise KeyError(f"{what} needs probes missing from this cache, e.g. {missing[:3]} ({len(missing)} in all); "
                           "record them with run_with_cache(ids) (all probes) or include them in names=")


def probe_shape(name: str, cfg: K2Config, B: int, T: int) -> tuple[int, ...] | None:
    """The shape a forward of ``cfg`` over B sequences of T tokens without a cache gives the probe ``name`` (as each
    module's probe comments give it), or None for a probe whose shape depends on more (attention scores over a cache,
    a spliced dictionary's features)."""
    D, H, E, k = cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts, cfg.num_experts_per_tok
    R, N, C = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    tails = {"hook_logits": (cfg.vocab_size,), "hook_q_latent": (cfg.q_lora_rank,), "hook_kv_latent": (C,),
             "hook_q_nope": (H, N), "hook_q_pe": (H, R), "hook_rot_q_pe": (H, R), "hook_k_pe": (R,),
             "hook_rot_k_pe": (R,), "hook_z": (H, cfg.v_head_dim), "hook_scores": (E,), "hook_choice_scores": (E,),
             "hook_topk_idx": (k,), "hook_topk_weights": (k,), "hook_expert_out": (k, D)}
    leaf = name.rpartition(".")[2]
    if leaf in ("hook_attn_scores", "hook_pattern"):
        return None  # [B, H, T, S]: S counts the cached positions too
    if leaf == "hook_max_logit":
        return (B, H)
    if leaf == "hook_logits" and name.endswith("gate.hook_logits"):
        return (B, T, E)
    if leaf in tails:
        return (B, T, *tails[leaf])
    return (B, T, D) if leaf.startswith("hook_") and leaf != "hook_features" else None


def _layer_arg(layer: int | None, num_layers: int, name: str) -> int:
    """A TransformerLens layer argument as the index of the residual it reads up to: None or -1 -> ``num_layers``
    (the final residual), else 0..num_layers."""
    if layer is None or layer == -1:
        return num_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= num_layers:
        raise ValueError(f"{name} must be None or -1 (the final residual) or an int in 0..{num_layers}, got {layer!r}")
    return layer


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
    for key, kind in (("probes", list), ("config", dict)):
        if not isinstance(meta.get(key), kind):
            raise ValueError(f"{str(file)!r}: its {key!r} field is missing or not a {kind.__name__} "
                             f"(got {type(meta.get(key)).__name__}); cache.save writes the probe names and the config")
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
