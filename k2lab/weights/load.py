"""``k2lab.load``: a K2 model from a checkpoint folder or a Hub repo id; whole or a prefix of its blocks; FP8
dequantized at load or FP8-resident; routed experts resident or streamed; on one device or spread by a map.

Each step can fail before the next begins, and nothing is returned until the last one succeeds:
1. the source: a folder, or only the needed files from the Hub (hub.py);
2. config.json, sliced to ``num_layers`` blocks;
3. every needed tensor checked from the headers (checkpoint.py) and every block placed (placement.py);
4. the model built on the meta device, with FP8-resident modules (fp8.py) and streamed experts (streaming.py)
   where they apply;
5. each resident tensor read once and assigned.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import LocalEntryNotFoundError
from tqdm.auto import tqdm

from ..config import K2Config
from ..model.moe import MoE
from ..model.transformer import K2Model
from ..weights import hub
from .placement import DeviceMap, resolve_device_map, unit_of
from .quant.fp8 import EXPERT_PROJS, FP8Linear, FP8RoutedExperts
from .reader import DTYPES, Checkpoint, CheckpointError, StoredWeight
from .streaming import ExpertCache, StreamedExperts

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_PROGRESS_BYTES = 2**30  # loads reading more than this show a progress bar unless told otherwise


def load(path_or_repo_id: str | Path, *, dtype: torch.dtype | None = None, revision: str | None = None,
         num_layers: int | None = None, expert_budget_bytes: int | None = None, device_map: DeviceMap = None,
         fp8_resident: bool | None = None, progress: bool | None = None) -> K2Model:
    """Load a K2 / DeepseekV3 checkpoint in the release layout.

    path_or_repo_id: a local folder, or a Hub repo id such as ``moonshotai/Kimi-K2-Instruct`` (cached; only the
        shards the load needs are fetched; ``HF_HUB_OFFLINE=1`` uses the cache alone).
    dtype: the weights' dtype. Default: bfloat16 for FP8 checkpoints, as stored otherwise. The router's
        correction bias always stays float32.
    revision: a Hub branch, tag or commit.
    num_layers: keep the first N blocks plus the final norm and the head: a logit-lens view of a prefix of the
        real model.
    expert_budget_bytes: routed experts stay in the files and are read on first use into one LRU cache of at
        most this many bytes; ``model.expert_cache.stats`` counts hits, misses, bytes read, evictions, peak.
    device_map: None (the CPU), ``"auto"`` (blocks balanced by bytes over the visible GPUs; the CPU if none) or
        {module prefix: device} over ``embed_tokens``, ``layers.{i}``, ``norm``, ``lm_head`` (``""``: the rest).
    fp8_resident: keep FP8 matrices as e4m3 and dequantize at each use (memory ~ the FP8 bytes). Default: on
        GPUs yes; on the CPU no (dequantized once at load).
    progress: tqdm bars for downloads and reads. Default: only for reads over 1 GiB.

    Raises naming the file and tensor: a missing shard, a tensor absent from the index, a shape that disagrees
    with config.json, a corrupt or truncated file, an unsupported dtype or quantization.
    """
    if not isinstance(path_or_repo_id, (str, os.PathLike)) or not str(path_or_repo_id):
        raise TypeError(f"path_or_repo_id must be a checkpoint folder or a Hub repo id, got {path_or_repo_id!r}")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)):
        raise ValueError(f"num_layers must be an integer, got {num_layers!r}")
    dtype = _resolve_dtype(dtype)
    if expert_budget_bytes is not None and (isinstance(expert_budget_bytes, bool)
                                            or not isinstance(expert_budget_bytes, int) or expert_budget_bytes < 0):
        raise ValueError(f"expert_budget_bytes must be a whole number of bytes >= 0 (e.g. 2**30 for 1 GiB) or None, "
                         f"got {expert_budget_bytes!r}")
    folder = _source_folder(path_or_repo_id, revision, num_layers, progress)
    full = K2Config.from_hf(folder / "config.json")
    cfg = slice_layers(full, num_layers)
    checkpoint = Checkpoint(folder)
    checkpoint.check_unexpected(full)
    weights = checkpoint.weights(cfg)
    quantized = any(w.scale is not None for w in weights.values())
    devices = resolve_device_map(cfg, device_map, fp8=quantized and fp8_resident is not False,
                                 expert_budget_bytes=expert_budget_bytes)
    assembly = _Assembly(cfg, checkpoint, weights, devices, dtype or (torch.bfloat16 if quantized else None),
                         fp8_resident)
    cache = ExpertCache(expert_budget_bytes, assembly.fetch_expert) if expert_budget_bytes is not None else None
    model = assembly.skeleton(cache)
    model.load_state_dict(assembly.state(streamed=cache is not None, progress=progress), strict=True, assign=True)
    if cache is not None:
        model.expert_cache = cache
    return model


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A floating dtype, given as a torch.dtype or by name ("bfloat16", "torch.float32")."""
    named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if dtype is not None and not (isinstance(named, torch.dtype) and named.is_floating_point):
        raise ValueError(f"dtype must be a floating torch dtype or its name (torch.bfloat16, 'float32', ...), "
                         f"got {dtype!r}")
    return named


def slice_layers(cfg: K2Config, num_layers: int | None) -> K2Config:
    """The first ``num_layers`` blocks of ``cfg`` (all when None)."""
    if num_layers is None:
        return cfg
    if not 1 <= num_layers <= cfg.num_hidden_layers:
        raise ValueError(f"num_layers={num_layers}: choose 1..{cfg.num_hidden_layers}, the blocks the checkpoint has")
    return cfg.replace(num_hidden_layers=num_layers,
                       first_k_dense_replace=min(cfg.first_k_dense_replace, num_layers))


def _source_folder(path_or_repo_id: str | Path, revision: str | None, num_layers: int | None,
                   progress: bool | None) -> Path:
    local = Path(path_or_repo_id).expanduser()
    if local.is_dir():
        return local
    if isinstance(path_or_repo_id, Path) or not hub.is_repo_id(path_or_repo_id):
        raise FileNotFoundError(f"{path_or_repo_id} is neither a checkpoint folder nor a Hub repo id")
    try:
        config = hub.fetch_file(path_or_repo_id, "config.json", revision)
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"{path_or_repo_id}: no such folder, and not in the Hub cache (offline, or the Hub "
                                f"could not be reached)") from None
    if config is None:
        raise FileNotFoundError(f"Hub repo {path_or_repo_id} has no config.json")
    cfg = slice_layers(K2Config.from_hf(config), num_layers)
    return hub.download(path_or_repo_id, cfg, revision, progress)


@dataclass
class _Assembly:
    """How each checkpoint tensor is held in the model: on which device, dequantized or as e4m3."""

    cfg: K2Config
    checkpoint: Checkpoint
    weights: dict[str, StoredWeight]
    devices: dict[str, torch.device]  # placement unit -> device
    dtype: torch.dtype | None
    fp8_resident: bool | None

    def __post_init__(self) -> None:
        # Streamed experts are read long after the load: a file changed since would give other weights silently.
        files = {w.data.file for w in self.weights.values()}
        self.file_stamps = {f: _stamp(f) for f in files}
        # A layer's routed experts are held alike (one stack, or one cache format): e4m3 only if all are stored so.
        self.experts_fp8 = {
            i: self._device_keeps_fp8(f"layers.{i}") and all(
                self.weights[f"model.layers.{i}.mlp.experts.{e}.{p}.weight"].scale is not None
                for e in range(self.cfg.n_routed_experts) for p in EXPERT_PROJS)
            for i in range(self.cfg.num_hidden_layers) if self.cfg.is_moe_layer(i)
        }

    def _device_keeps_fp8(self, unit: str) -> bool:
        return self.fp8_resident if self.fp8_resident is not None else self.devices[unit].type != "cpu"

    def keeps_fp8(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` stays e4m3 in memory: stored so, and on a device that keeps FP8
        (GPUs, unless ``fp8_resident`` says otherwise)."""
        expert = _EXPERT.fullmatch(name)
        if expert is not None:
            return self.experts_fp8[int(expert[1])]
        return self.weights[name].scale is not None and self._device_keeps_fp8(unit_of(name))

    def skeleton(self, cache: ExpertCache | None) -> K2Model:
        """The model on the meta device, with FP8-resident and streamed modules where they apply."""
        model = K2Model(self.cfg, device="meta")
        block, dtype = self.cfg.fp8_block_size, self.dtype or torch.bfloat16
        for name in self.weights:
            if _EXPERT.fullmatch(name) is None and self.keeps_fp8(name):
                path = name.removeprefix("model.").removesuffix(".weight")
                linear = model.get_submodule(path)
                parent, _, leaf = path.rpartition(".")
                setattr(model.get_submodule(parent), leaf,
                        FP8Linear(linear.in_features, linear.out_features, block, dtype, device="meta"))
        for i, layer in enumerate(model.layers):
            if not isinstance(layer.mlp, MoE):
                continue
            fp8 = self.experts_fp8[i]
            if cache is not None:
                stored = DTYPES[self.weights[f"model.layers.{i}.mlp.experts.0.gate_proj.weight"].data.dtype]
                layer.mlp.experts = StreamedExperts(self.cfg.n_routed_experts, i, cache, block if fp8 else None,
                                                    dtype if fp8 else self.dtype or stored, self.devices[f"layers.{i}"])
            elif fp8:
                layer.mlp.experts = FP8RoutedExperts(self.cfg, dtype, device="meta")
        return model

    def held(self, name: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensor ``name`` as the model holds it, keyed by state-dict name: a dequantized (or converted)
        tensor, or the e4m3 values and their scales. Routed experts are keyed by their layer's stacks."""
        expert = _EXPERT.fullmatch(name)
        key = name.removeprefix("model.") if expert is None else f"layers.{expert[1]}.mlp.experts.{expert[3]}"
        weight, device = self.weights[name], self.devices[unit_of(name)]
        if weight.scale is not None:  # a scale is 1/16,384 of its matrix: read it twice rather than miss a NaN
            scale = self.checkpoint.read(weight.scale)
            if not scale.isfinite().all():
                raise CheckpointError(f"{weight.scale.file}: {weight.scale.name} holds non-finite block scales "
                                      f"({int((~scale.isfinite()).sum())} of {scale.numel()} are NaN or infinite)")
        if self.keeps_fp8(name):
            return {f"{key}_fp8": self.checkpoint.read(weight.data, device),
                    f"{key}_scale_inv": self.checkpoint.read(weight.scale, device)}
        return {key: self.checkpoint.read_weight(weight, self.dtype, device)}

    def state(self, streamed: bool, progress: bool | None) -> dict[str, torch.Tensor]:
        """Every resident tensor, read once; routed experts stacked into [E, ...] tensors."""
        names = [n for n in self.weights if not (streamed and _EXPERT.fullmatch(n))]
        total = sum(self.weights[n].nbytes for n in names)
        show = progress if progress is not None else total > _PROGRESS_BYTES
        state: dict[str, torch.Tensor] = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc="k2lab.load", disable=not show) as bar:
            for name in names:
                expert = _EXPERT.fullmatch(name)
                for key, tensor in self.held(name).items():
                    if expert is None:
                        state[key] = tensor
                        continue
                    if key not in state:  # this layer's first expert: allocate the stack
                        state[key] = torch.empty((self.cfg.n_routed_experts, *tensor.shape), dtype=tensor.dtype,
                                                 device=tensor.device)
                    state[key][int(expert[2])] = tensor
                bar.update(self.weights[name].nbytes)
        return state

    def _check_unchanged(self, file: Path) -> None:
        if _stamp(file) != self.file_stamps[file]:
            raise CheckpointError(f"{file} changed on disk since the model was loaded (size or modification time); "
                                  "its streamed experts can no longer be read: load the model again")

    def fetch_expert(self, layer: int, expert: int) -> tuple[tuple[torch.Tensor, ...], int]:
        """One routed expert for the cache: (gate, up, down) or their e4m3 values and scales; and bytes read."""
        names = [f"model.layers.{layer}.mlp.experts.{expert}.{p}.weight" for p in EXPERT_PROJS]
        for name in names:
            self._check_unchanged(self.weights[name].data.file)
        tensors = tuple(t for name in names for t in self.held(name).values())
        return tensors, sum(self.weights[name].nbytes for name in names)


def _stamp(file: Path) -> tuple[int, int] | None:
    """A file's size and modification time, None if it is gone."""
    try:
        stat = file.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns
