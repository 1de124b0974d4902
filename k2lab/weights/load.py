"""``k2lab.load``: a K2 model from a checkpoint folder or a Hub repo id; whole or a prefix of its blocks; quantized
matrices (FP8, INT4) dequantized at load or kept quantized; routed experts resident or streamed; on one device or
spread by a map.

Each step can fail before the next begins, and nothing is returned until the last one succeeds:
1. the source: a folder, or only the needed files from the Hub (download.py);
2. config.json: the architecture, sliced to ``num_layers`` blocks, and the stored format (reader.read_config, quant/);
3. every needed tensor checked from the headers (reader.py) and every block placed (placement.py);
4. the model built on the meta device, with quantized-resident modules (the format's) and streamed experts
   (streaming.py) where they apply;
5. each resident tensor read once and assigned.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import LocalEntryNotFoundError
from tqdm.auto import tqdm

from .. import hub
from ..config import K2Config
from ..model.moe import MoE
from ..model.transformer import K2Model
from .download import download
from .placement import DeviceMap, resolve_device_map, unit_of
from .quant import UNQUANTIZED, QuantFormat
from .reader import DTYPES, Checkpoint, CheckpointError, StoredWeight, is_mtp_tensor, read_config
from .schema import EXPERT_PROJS, EXPERT_TENSOR, expert_tensor
from .streaming import ExpertCache, StreamedExperts

logger = logging.getLogger(__name__)
_PROGRESS_BYTES = 2**30  # loads reading more than this show a progress bar unless told otherwise


def load(path_or_repo_id: str | Path, *, dtype: torch.dtype | None = None, revision: str | None = None,
         num_layers: int | None = None, expert_budget_bytes: int | None = None, device_map: DeviceMap = None,
         quantized_resident: bool | None = None, progress: bool | None = None) -> K2Model:
    """Load a K2 / DeepseekV3 checkpoint in the release layout (unquantized, FP8 or INT4 experts, as its config.json's
    ``quantization_config`` says).

    path_or_repo_id: a local folder, or a Hub repo id such as ``moonshotai/Kimi-K2-Instruct`` (cached; only the
        shards the load needs are fetched; ``HF_HUB_OFFLINE=1`` uses the cache alone).
    dtype: the weights' dtype. Default: bfloat16 for quantized checkpoints, as stored otherwise. The router's
        correction bias always stays float32.
    revision: a Hub branch, tag or commit.
    num_layers: keep the first N blocks plus the final norm and the head: a logit-lens view of a prefix of the
        real model.
    expert_budget_bytes: routed experts stay in the files and are read on first use into one LRU cache of at
        most this many bytes; ``model.expert_cache.stats`` counts hits, misses, bytes read, evictions, peak.
    device_map: None (the CPU); one device for every block (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a GPU index, a
        ``torch.device``); ``"auto"`` (blocks balanced by bytes over the visible GPUs; the CPU if none); or
        {module prefix: device} over ``embed_tokens``, ``layers.{i}``, ``norm``, ``lm_head`` (``""``: the rest).
    quantized_resident: keep quantized matrices as stored (FP8 e4m3, packed INT4) and dequantize at each use (memory
        ~ the stored bytes). Default: on GPUs yes; on the CPU no (dequantized once at load).
    progress: tqdm bars for downloads and reads. Default: only for reads over 1 GiB.

    ``model.load_notes`` lists what was left out on purpose: DeepSeek-V3/R1/V3.1's multi-token-prediction block
    (``model.layers.61.*``) is counted by ``count_parameters(cfg).mtp`` but not loaded.

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
    config, full, fmt = read_source_config(path_or_repo_id, revision)
    cfg = slice_layers(full, num_layers)
    # A folder is read in place; from the Hub only the files the sliced config needs are fetched.
    folder = config.parent if Path(path_or_repo_id).expanduser().is_dir() else \
        download(path_or_repo_id, cfg, revision, progress)
    checkpoint = Checkpoint(folder)
    checkpoint.check_unexpected(full, fmt)
    weights = checkpoint.weights(cfg, fmt)
    devices = resolve_device_map(cfg, device_map, format=fmt if quantized_resident is not False else UNQUANTIZED,
                                 expert_budget_bytes=expert_budget_bytes)
    assembly = _Assembly(cfg, fmt, checkpoint, weights, devices,
                         dtype or (torch.bfloat16 if fmt.quantized else None), quantized_resident)
    cache = ExpertCache(expert_budget_bytes, assembly.fetch_expert) if expert_budget_bytes is not None else None
    model = assembly.skeleton(cache)
    model.load_state_dict(assembly.state(streamed=cache is not None, progress=progress), strict=True, assign=True)
    if cache is not None:
        model.expert_cache = cache
    model.load_notes = _mtp_notes(checkpoint, full)
    model.tokenizer = _tokenizer_in(folder)
    return model


def _mtp_notes(checkpoint: Checkpoint, cfg: K2Config) -> list[str]:
    """What the load left out on purpose: the multi-token-prediction blocks, named in ``model.load_notes``."""
    skipped = [n for n in checkpoint.weight_map if is_mtp_tensor(n, cfg)]
    if not skipped:
        return []
    first = cfg.num_hidden_layers
    blocks = f"model.layers.{first}.*" if cfg.num_nextn_predict_layers == 1 else \
        f"model.layers.{first}..{first + cfg.num_nextn_predict_layers - 1}.*"
    note = (f"skipped {len(skipped)} tensors of the multi-token-prediction block(s) {blocks} "
            f"(num_nextn_predict_layers={cfg.num_nextn_predict_layers}): they draft the token after next for "
            "speculative decoding and play no part in the main model's logits, which k2lab computes")
    logger.info(note)
    return [note]


def _tokenizer_in(folder: Path):
    """The tokenizer shipped beside the weights (K2's tiktoken.model and tokenizer_config.json, or a
    tokenizer.json), or None."""
    from ..tokenizer.release import load_tokenizer, release_layout

    return load_tokenizer(folder) if release_layout(folder) is not None else None


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
    return cfg.replace(num_hidden_layers=num_layers, first_k_dense_replace=min(cfg.first_k_dense_replace, num_layers),
                       num_nextn_predict_layers=0)  # a prefix has no MTP block after it


def read_source_config(path_or_repo_id: str | Path, revision: str | None = None, num_layers: int | None = None
                       ) -> tuple[Path, K2Config, QuantFormat]:
    """A checkpoint's config.json without reading any weights, from a local folder or (that one file) from the Hub:
    the file read, the architecture sliced to ``num_layers`` blocks (all when None), and the stored format.

    Raises FileNotFoundError for a source that is neither a folder nor a repo id, a repo without config.json, and a
    repo id not in the cache while offline (huggingface_hub's own error there does not say which source failed).
    """
    local = Path(path_or_repo_id).expanduser()
    if local.is_dir():
        config = local / "config.json"
    elif isinstance(path_or_repo_id, Path) or not hub.is_repo_id(path_or_repo_id):
        raise FileNotFoundError(f"{path_or_repo_id} is neither a checkpoint folder nor a Hub repo id")
    else:
        try:
            fetched = hub.fetch_file(path_or_repo_id, "config.json", revision)
        except LocalEntryNotFoundError:
            raise FileNotFoundError(f"{path_or_repo_id}: no such folder, and not in the Hub cache (offline, or the "
                                    f"Hub could not be reached)") from None
        if fetched is None:
            raise FileNotFoundError(f"Hub repo {path_or_repo_id} has no config.json")
        config = fetched
    cfg, fmt = read_config(config)
    return config, slice_layers(cfg, num_layers), fmt


@dataclass
class _Assembly:
    """How each checkpoint tensor is held in the model: on which device, dequantized or as stored."""

    cfg: K2Config
    format: QuantFormat  # the checkpoint's
    checkpoint: Checkpoint
    weights: dict[str, StoredWeight]
    devices: dict[str, torch.device]  # placement unit -> device
    dtype: torch.dtype | None
    resident: bool | None  # keep quantized matrices as stored (None: on GPUs)

    def __post_init__(self) -> None:
        # Streamed experts are read long after the load: a file changed since would give other weights silently.
        files = {part.file for weight in self.weights.values() for part in weight.parts}
        self.file_stamps = {f: _stamp(f) for f in files}

    def held_format(self, name: str) -> QuantFormat:
        """The format checkpoint tensor ``name`` is held in: the checkpoint's, for a quantized matrix on a device that
        keeps them quantized (GPUs, unless ``resident`` says otherwise); else UNQUANTIZED (dequantized at load). A
        layer's routed experts are held alike (one stack, or one cache format): as its expert 0's gate_proj."""
        expert = EXPERT_TENSOR.fullmatch(name)
        if expert is not None:
            name = expert_tensor(int(expert[1]), 0, "gate_proj")
        weight, device = self.weights[name], self.devices[unit_of(name)]
        keeps = self.resident if self.resident is not None else device.type != "cpu"
        return weight.format if keeps and weight.quantized else UNQUANTIZED

    def skeleton(self, cache: ExpertCache | None) -> K2Model:
        """The model on the meta device, with quantized-resident and streamed modules where they apply."""
        model = K2Model(self.cfg, device="meta")
        dtype = self.dtype or torch.bfloat16
        for name in self.weights:
            fmt = self.held_format(name)
            if EXPERT_TENSOR.fullmatch(name) is None and fmt.quantized:
                path = name.removeprefix("model.").removesuffix(".weight")
                linear = model.get_submodule(path)
                parent, _, leaf = path.rpartition(".")
                setattr(model.get_submodule(parent), leaf,
                        fmt.linear(linear.in_features, linear.out_features, dtype, device="meta"))
        for i, layer in enumerate(model.layers):
            if not isinstance(layer.mlp, MoE):
                continue
            first = expert_tensor(i, 0, "gate_proj")
            fmt = self.held_format(first)
            if cache is not None:
                stored = DTYPES[self.weights[first].parts[0].dtype]
                layer.mlp.experts = StreamedExperts(self.cfg.n_routed_experts, i, cache, fmt,
                                                    dtype if fmt.quantized else self.dtype or stored,
                                                    self.devices[f"layers.{i}"])
            elif fmt.quantized:
                layer.mlp.experts = fmt.routed_experts(self.cfg, dtype, device="meta")
        return model

    def held(self, name: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensor ``name`` as the model holds it, keyed by state-dict name: a dequantized (or converted)
        tensor, or the stored tensors a quantized module keeps (``..._fp8``, ``..._scale_inv``). Routed experts are
        keyed by their layer's stacks."""
        expert = EXPERT_TENSOR.fullmatch(name)
        key = name.removeprefix("model.") if expert is None else f"layers.{expert[1]}.mlp.experts.{expert[3]}"
        weight, device, fmt = self.weights[name], self.devices[unit_of(name)], self.held_format(name)
        if fmt.quantized:
            suffixes = [part.held for part in weight.layout if part.held is not None]
            return {key + suffix: tensor
                    for suffix, tensor in zip(suffixes, self.checkpoint.read_held(weight, device), strict=True)}
        return {key: self.checkpoint.read_weight(weight, self.dtype, device)}

    def state(self, streamed: bool, progress: bool | None) -> dict[str, torch.Tensor]:
        """Every resident tensor, read once; routed experts stacked into [E, ...] tensors."""
        names = [n for n in self.weights if not (streamed and EXPERT_TENSOR.fullmatch(n))]
        total = sum(self.weights[n].nbytes for n in names)
        show = progress if progress is not None else total > _PROGRESS_BYTES
        state: dict[str, torch.Tensor] = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc="k2lab.load", disable=not show) as bar:
            for name in names:
                expert = EXPERT_TENSOR.fullmatch(name)
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
        """One routed expert for the cache: (gate, up, down), or their stored tensors in turn (FP8: gate's values and
        scales, up's, down's); and the bytes read."""
        names = [expert_tensor(layer, expert, p) for p in EXPERT_PROJS]
        for part in (part for name in names for part in self.weights[name].parts):
            self._check_unchanged(part.file)
        tensors = tuple(t for name in names for t in self.held(name).values())
        return tensors, sum(self.weights[name].nbytes for name in names)


def _stamp(file: Path) -> tuple[int, int] | None:
    """A file's size and modification time, None if it is gone."""
    try:
        stat = file.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns
