"""Writing checkpoints in the K2 release layout, one tensor at a time.

The layout: config.json (with the stored format's ``quantization_config``); shards ``model-{i}-of-{n}.safetensors``
holding whole blocks in order, the embedding with the first and the final norm and head with the last;
``model.safetensors.index.json`` naming every tensor's shard; one tensor per routed expert; quantized matrices as the
format lays them out (FP8: e4m3 with a float32 ``<name>_scale_inv``; INT4: K2-Thinking's packed experts); bfloat16
elsewhere, the correction bias in float32.

A safetensors header lists every tensor's offset, so it is written first, from the shapes alone; then each
tensor is asked for when its turn comes and written out. A true-size MoE layer (17 GB of FP8 experts) is thus
written with one expert in memory at a time. ``save_checkpoint`` writes a K2Model's own weights this way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import K2Config
from ..model.transformer import K2Model
from .placement import unit_of
from .quant import QuantFormat, resolve_format
from .quant.base import QuantizedResident
from .reader import DTYPE_NAMES, INDEX_FILE, byte_view
from .schema import EXPERT_TENSOR, TensorSpec, checkpoint_tensors
from .streaming import StreamedExperts

_SHARD = re.compile(r"model(-\d+-of-\d+)?\.safetensors")  # a shard name, replaced by a new write
# A tensor for a spec: a float tensor (quantized here if the format quantizes the spec), or the format's stored
# tensors already made (FP8: e4m3 values and scale_inv).
TensorSource = Callable[[TensorSpec], torch.Tensor | tuple[torch.Tensor, ...]]


def write_checkpoint(folder: str | Path, cfg: K2Config, source: TensorSource, *, num_shards: int = 1,
                     format: QuantFormat | str = "fp8", dtype: torch.dtype = torch.bfloat16,
                     extra: Mapping[str, torch.Tensor] | None = None, progress: bool = False) -> Path:
    """Write the checkpoint of ``cfg`` into ``folder`` in the release layout; returns the folder.

    ``source(spec)`` gives each tensor when it is written. ``format`` (a QuantFormat or a name: ``"fp8"``,
    ``"int4"``, ``"unquantized"``): how matrices are stored; ``"fp8"``, the default, is the release's e4m3 matrices
    in 128x128 blocks, ``"unquantized"`` every matrix in ``dtype``. ``extra``: more tensors for the first shard, as
    given (tests add the stale ``rotary_emb.inv_freq`` some checkpoints carry).

    Nothing is half-written: the arguments are checked before the first byte, the files go into a temporary
    sibling folder, and only a complete checkpoint replaces ``folder`` (its other files, such as a tokenizer, are
    kept). On any failure ``folder`` is as it was. A folder that cannot be swapped (a mount point, or in a parent
    that cannot be written) gets the temporary folder inside it instead, and the finished files are renamed into
    place one by one.
    """
    folder = Path(folder)
    fmt = resolve_format(format)
    _check_write_args(folder, cfg, source, num_shards, dtype, extra)
    swap = not (folder.is_dir() and (os.path.ismount(folder) or not os.access(folder.parent, os.W_OK)))
    tag = f"writing-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging = folder.with_name(f".{folder.name}.{tag}") if swap else folder / f".{tag}"
    try:
        staging.mkdir()
    except OSError as error:
        raise PermissionError(f"folder {folder}: cannot write there or beside it ({error})") from None
    try:
        _write_files(staging, cfg, source, num_shards=num_shards, fmt=fmt, dtype=dtype, extra=extra,
                     progress=progress)
        (_replace_folder if swap else _replace_files)(folder, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def save_checkpoint(model: K2Model, folder: str | Path, *, num_shards: int = 1,
                    format: QuantFormat | str = "fp8") -> Path:
    """Write a model into ``folder`` in the release layout, per-expert tensor names, its matrices in ``format`` (a
    QuantFormat or a name; default: FP8 in 128x128 blocks, as released), in ``num_shards`` shards of whole blocks;
    returns the folder. A model whose weights are not all in memory as plain tensors (streamed experts,
    quantized-resident matrices, meta tensors) is refused before anything is written; the write itself replaces
    ``folder`` only once complete (``write_checkpoint``)."""
    _check_saveable(model)
    state = model.state_dict()

    def tensor(spec: TensorSpec) -> torch.Tensor:
        expert = EXPERT_TENSOR.fullmatch(spec.name)
        if expert:
            layer, index, proj = expert.groups()
            return state[f"layers.{layer}.mlp.experts.{proj}"][int(index)]
        return state[spec.name.removeprefix("model.")]

    return write_checkpoint(folder, model.config, tensor, num_shards=num_shards, format=format)


def _check_saveable(model: K2Model) -> None:
    if not isinstance(model, K2Model):
        raise TypeError(f"model must be a K2Model, got {type(model).__name__}")
    for name, module in model.named_modules():
        if isinstance(module, StreamedExperts):
            raise ValueError(f"model cannot be saved: its routed experts are streamed from the files (load without "
                             f"expert_budget_bytes); {name} is a {type(module).__name__}")
        if isinstance(module, QuantizedResident):
            raise ValueError(f"model cannot be saved: it holds quantized-resident weights (load with "
                             f"quantized_resident=False); {name} is a {type(module).__name__}")
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            raise ValueError(f"model cannot be saved: {name} is on the meta device (it has no values)")


def _check_write_args(folder: Path, cfg: K2Config, source: TensorSource, num_shards: int, dtype: torch.dtype,
                      extra: Mapping[str, torch.Tensor] | None) -> None:
    """Everything about a write that can be known before it starts; the parent folder is made if missing."""
    if not isinstance(cfg, K2Config):
        raise TypeError(f"cfg must be a K2Config, got {type(cfg).__name__}")
    if not callable(source):
        raise TypeError(f"source must be a function of a TensorSpec, got {type(source).__name__}")
    units = len(dict.fromkeys(_shard_unit(s.name) for s in checkpoint_tensors(cfg)))
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or not 1 <= num_shards <= units:
        raise ValueError(f"num_shards must be an integer in 1..{units} (whole blocks per shard), got {num_shards!r}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of the safetensors dtypes {sorted(map(str, DTYPE_NAMES))}, got {dtype!r}")
    for name, tensor in (extra or {}).items():
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"extra[{name!r}] must be a tensor of a safetensors dtype, got {type(tensor).__name__}")
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"folder {folder} exists and is not a folder")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(f"folder {folder}: cannot make its parent folder ({error})") from None


def _replace_folder(folder: Path, staging: Path) -> None:
    """Put the complete ``staging`` folder in place of ``folder``. What ``folder`` holds besides a checkpoint (a
    tokenizer, a log) moves over by renaming; its old shards, index and config go."""
    if not folder.exists():
        staging.rename(folder)
        return
    replaced = ("config.json", INDEX_FILE, *(p.name for p in staging.iterdir()))
    kept = [old for old in folder.iterdir() if not (old.name in replaced or _SHARD.fullmatch(old.name))]
    retired = staging.with_name(staging.name.replace(".writing-", ".replaced-"))
    moved = []
    try:
        for old in kept:
            old.rename(staging / old.name)
            moved.append(old)
        folder.rename(retired)
        staging.rename(folder)
    except BaseException:  # put back what moved: folder is as it was
        if retired.exists():
            retired.rename(folder)
        for old in moved:
            (staging / old.name).rename(old)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def _replace_files(folder: Path, staging: Path) -> None:
    """Move the complete checkpoint in ``staging`` (inside ``folder``) into ``folder`` file by file, each rename
    atomic: shards first, then the index and config.json that name them; old shards no longer named go."""
    old_shards = [p for p in folder.iterdir() if _SHARD.fullmatch(p.name)]
    written = sorted(staging.iterdir(), key=lambda p: (p.name == INDEX_FILE, p.name == "config.json", p.name))
    for new in written:
        os.replace(new, folder / new.name)
    names = {p.name for p in written}
    for old in old_shards:
        if old.name not in names:
            old.unlink()
    staging.rmdir()


def _write_files(folder: Path, cfg: K2Config, source: TensorSource, *, num_shards: int, fmt: QuantFormat,
                 dtype: torch.dtype, extra: Mapping[str, torch.Tensor] | None, progress: bool) -> None:
    (folder / "config.json").write_text(json.dumps(cfg.to_hf(fmt.quantization_config()), indent=2))

    specs = checkpoint_tensors(cfg)
    units = list(dict.fromkeys(_shard_unit(s.name) for s in specs))  # embedding, each block, norm + head
    shard_of = {unit: i * num_shards // len(units) for i, unit in enumerate(units)}  # whole units, in order
    weight_map, total = {}, 0
    bar = tqdm(total=len(specs), desc="writing", unit="tensor", disable=not progress)
    for shard in range(num_shards):
        name = f"model-{shard + 1}-of-{num_shards}.safetensors"
        mine = [s for s in specs if shard_of[_shard_unit(s.name)] == shard]
        extras = dict(extra or {}) if shard == 0 else {}
        layout = [(p.name, p.dtype, p.shape) for s in mine for p in fmt.layout(s, dtype)]
        layout += [(n, t.dtype, tuple(t.shape)) for n, t in extras.items()]
        with (folder / name).open("wb") as f:
            _write_header(f, layout)
            for spec in mine:
                for tensor in _tensors(spec, source(spec), fmt, dtype):
                    _write_tensor(f, tensor)
                bar.update()
            for tensor in extras.values():
                _write_tensor(f, tensor)
        for entry_name, entry_dtype, shape in layout:
            weight_map[entry_name] = name
            total += _nbytes(entry_dtype, shape)
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _shard_unit(name: str) -> str:
    """What stays together in one shard: the embedding, a block, or the final norm with the head."""
    unit = unit_of(name)
    return "norm+lm_head" if unit in ("norm", "lm_head") else unit


def _tensors(spec: TensorSpec, given: torch.Tensor | tuple[torch.Tensor, ...], fmt: QuantFormat,
             dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors to write for ``spec`` from what the source gave, checked against the header's layout."""
    layout = fmt.layout(spec, dtype)
    if isinstance(given, tuple):
        tensors = list(given)
    elif fmt.quantizes(spec):
        tensors = list(fmt.quantize(spec.name, given))
    else:
        tensors = [given.to(layout[0].dtype)]
    if len(tensors) != len(layout):
        raise ValueError(f"source gave {len(tensors)} tensor(s) for {spec.name}; {fmt} stores {len(layout)}")
    for tensor, want in zip(tensors, layout, strict=True):
        if tensor.dtype != want.dtype or tuple(tensor.shape) != tuple(want.shape):
            raise ValueError(f"source gave {want.name} as {tensor.dtype} {tuple(tensor.shape)}; the layout needs "
                             f"{want.dtype} {tuple(want.shape)}")
    return [t.cpu() for t in tensors]


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _write_tensor(f, tensor: torch.Tensor) -> None:
    """A CPU tensor's bytes, as they lie in memory."""
    data = tensor.contiguous()  # held here while the file reads from its memory
    f.write(byte_view(data))


def _write_header(f, layout: list[tuple]) -> None:
    """safetensors: 8-byte little-endian header length, the JSON header (padded to 8 bytes), then the data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in layout:
        end = offset + _nbytes(dtype, shape)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
