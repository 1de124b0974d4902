"""Writing checkpoints in the K2 release layout, one tensor at a time.

The layout: config.json (with the FP8 ``quantization_config``); shards ``model-{i}-of-{n}.safetensors`` holding
whole blocks in order, the embedding with the first and the final norm and head with the last;
``model.safetensors.index.json`` naming every tensor's shard; one tensor per routed expert; e4m3 matrices with
a float32 ``<name>_scale_inv``; bfloat16 elsewhere, the correction bias in float32.

A safetensors header lists every tensor's offset, so it is written first, from the shapes alone; then each
tensor is asked for when its turn comes and written out. A true-size MoE layer (17 GB of FP8 experts) is thus
written with one expert in memory at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..analysis.accounting import TensorSpec, checkpoint_tensors
from ..config import K2Config
from .placement import unit_of
from .quant.fp8 import FP8, quantize, scale_shape
from .reader import DTYPES, INDEX_FILE, SCALE_SUFFIX

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# A tensor for a spec: a float tensor (quantized here if the spec is FP8), or already (e4m3 values, scale_inv).
TensorSource = Callable[[TensorSpec], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]


def write_checkpoint(folder: str | Path, cfg: K2Config, source: TensorSource, *, num_shards: int = 1,
                     fp8: bool = True, dtype: torch.dtype = torch.bfloat16,
                     extra: Mapping[str, torch.Tensor] | None = None, progress: bool = False) -> Path:
    """Write the checkpoint of ``cfg`` into ``folder`` in the release layout; returns the folder.

    ``source(spec)`` gives each tensor when it is written. ``fp8``: the release's e4m3 matrices in
    ``cfg.fp8_block_size`` blocks; otherwise every matrix in ``dtype``. ``extra``: more tensors for the first
    shard, as given (tests add the stale ``rotary_emb.inv_freq`` some checkpoints carry).
    """
    if fp8 and cfg.fp8_block_size is None:
        raise ValueError("fp8=True needs cfg.fp8_block_size")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf = cfg.to_hf() if fp8 else cfg.replace(fp8_block_size=None).to_hf()
    (folder / "config.json").write_text(json.dumps(hf, indent=2))

    specs = checkpoint_tensors(cfg)
    units = list(dict.fromkeys(_shard_unit(s.name) for s in specs))  # embedding, each block, norm + head
    shard_of = {unit: i * num_shards // len(units) for i, unit in enumerate(units)}  # whole units, in order
    weight_map, total = {}, 0
    bar = tqdm(total=len(specs), desc="writing", unit="tensor", disable=not progress)
    for shard in range(num_shards):
        name = f"model-{shard + 1}-of-{num_shards}.safetensors"
        mine = [s for s in specs if shard_of[_shard_unit(s.name)] == shard]
        extras = dict(extra or {}) if shard == 0 else {}
        layout = [entry for s in mine for entry in _stored(s, cfg, fp8, dtype)]
        layout += [(n, t.dtype, tuple(t.shape)) for n, t in extras.items()]
        with (folder / name).open("wb") as f:
            _write_header(f, layout)
            for spec in mine:
                for tensor in _tensors(spec, source(spec), cfg, fp8, dtype):
                    f.write(tensor.contiguous().view(-1).view(torch.uint8).numpy())
                bar.update()
            for tensor in extras.values():
                f.write(tensor.contiguous().view(-1).view(torch.uint8).numpy())
        for entry_name, entry_dtype, shape in layout:
            weight_map[entry_name] = name
            total += _nbytes(entry_dtype, shape)
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return folder


def _shard_unit(name: str) -> str:
    """What stays together in one shard: the embedding, a block, or the final norm with the head."""
    unit = unit_of(name)
    return "norm+lm_head" if unit in ("norm", "lm_head") else unit


def _stored(spec: TensorSpec, cfg: K2Config, fp8: bool, dtype: torch.dtype) -> list[tuple]:
    """(name, dtype, shape) of what ``spec`` is stored as: one tensor, or e4m3 values and their scales."""
    if fp8 and spec.fp8:
        return [(spec.name, FP8, spec.shape),
                (spec.name + SCALE_SUFFIX, torch.float32, scale_shape(spec.shape, cfg.fp8_block_size))]
    if spec.name.endswith("e_score_correction_bias"):
        return [(spec.name, torch.float32, spec.shape)]
    return [(spec.name, dtype, spec.shape)]


def _tensors(spec: TensorSpec, given: torch.Tensor | tuple[torch.Tensor, torch.Tensor], cfg: K2Config,
             fp8: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors to write for ``spec`` from what the source gave, checked against the header's layout."""
    if fp8 and spec.fp8:
        tensors = list(given) if isinstance(given, tuple) else list(quantize(given, cfg.fp8_block_size))
    else:
        tensors = [given.to(torch.float32 if spec.name.endswith("e_score_correction_bias") else dtype)]
    for tensor, (name, want_dtype, shape) in zip(tensors, _stored(spec, cfg, fp8, dtype), strict=True):
        if tensor.dtype != want_dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"source gave {name} as {tensor.dtype} {tuple(tensor.shape)}; the layout needs "
                             f"{want_dtype} {tuple(shape)}")
    return [t.cpu() for t in tensors]


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _write_header(f, layout: list[tuple]) -> None:
    """safetensors: 8-byte little-endian header length, the JSON header (padded to 8 bytes), then the data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in layout:
        end = offset + _nbytes(dtype, shape)
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
