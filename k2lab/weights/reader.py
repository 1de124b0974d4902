"""What is in a K2 checkpoint folder: config.json, safetensors files named by ``model.safetensors.index.json``
(or one ``model.safetensors``), tensors named as released (one per routed expert), FP8 e4m3 matrices with a
float32 ``<name>_scale_inv``.

``Checkpoint.weights(cfg)`` checks, from the headers alone, that every tensor ``cfg`` needs is there, shaped as
config.json implies and stored in a dtype k2lab reads, FP8 ones with their scales. Errors name the tensor and
the file. Nothing is ever unpickled: only safetensors is read.

Tensor data is read with positioned reads at the offsets the header gives, not through ``safe_open``:
safe_open maps the whole file, and every page read through that map counts in the process's resident memory
until the handle closes (an expert cache of 2 GiB would look like the 17 GB of experts it streamed), while
reopening a handle per read re-parses a 2,300-entry header (~5 ms). safe_open still validates each header.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..analysis.accounting import checkpoint_tensors
from ..config import K2Config
from .quant.fp8 import dequantize, scale_shape

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
# The safetensors dtypes k2lab reads; K2 stores e4m3 matrices, bfloat16 embedding/head/norms/router and a
# float32 correction bias.
DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# Stale tensors some checkpoints carry that hold nothing k2lab computes from.
IGNORED_TENSORS = re.compile(r".*rotary_emb\.(inv_freq|original_inv_freq)$")


class CheckpointError(ValueError):
    """A checkpoint that disagrees with its config or with the safetensors format; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: where a tensor's bytes lie and how to read them."""

    name: str
    file: Path
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class StoredWeight:
    """A model tensor as stored: its data and, for an e4m3 matrix, its block scales."""

    data: TensorInfo
    scale: TensorInfo | None = None
    block: tuple[int, int] | None = None  # the FP8 block size, with a scale

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0)


class Checkpoint:
    """The safetensors files of a checkpoint folder: which file holds each tensor, and its header entry."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        if (self.folder / INDEX_FILE).is_file():
            self.source = self.folder / INDEX_FILE
            self.weight_map = read_weight_map(self.source)
        elif (self.folder / SINGLE_FILE).is_file():
            self.source = self.folder / SINGLE_FILE
            self.weight_map = dict.fromkeys(self._header(SINGLE_FILE), SINGLE_FILE)
        else:
            bins = any(self.folder.glob("*.bin"))
            hint = " (k2lab reads safetensors only and never unpickles .bin files)" if bins else ""
            raise FileNotFoundError(f"{self.folder} holds neither {INDEX_FILE} nor {SINGLE_FILE}{hint}")

    def file_of(self, name: str) -> str:
        """The file (relative to the folder) holding tensor ``name``, as the index says."""
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name} is not in {self.source}")
        return self.weight_map[name]

    def info(self, name: str) -> TensorInfo:
        file = self.file_of(name)
        header = self._header(file)
        if name not in header:
            raise CheckpointError(f"{self.folder / file} has no tensor {name}, though {self.source.name} puts it there")
        return header[name]

    def _header(self, file: str) -> dict[str, TensorInfo]:
        """Parse (once) the header of one file, after safetensors has validated it."""
        if file in self._headers:
            return self._headers[file]
        path = self.folder / file
        if not path.is_file():
            raise FileNotFoundError(f"shard {file} named by {self.source.name} is missing from {self.folder}")
        try:
            with safe_open(path, "pt"):  # checks the header length, its JSON, and that the data covers the file
                pass
        except SafetensorError as err:
            raise CheckpointError(f"{path} is not a valid safetensors file (corrupt or truncated?): {err}") from err
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            entries = json.loads(f.read(length))
        entries.pop("__metadata__", None)
        self._headers[file] = {
            name: TensorInfo(name, path, e["dtype"], tuple(e["shape"]), 8 + length + e["data_offsets"][0],
                             e["data_offsets"][1] - e["data_offsets"][0])
            for name, e in entries.items()
        }
        return self._headers[file]

    def check_unexpected(self, cfg: K2Config) -> None:
        """Refuse tensors the model of ``cfg`` has no place for (stale rotary buffers and the multi-token-prediction
        blocks config.json announces aside: see ``mtp_tensors``)."""
        specs = checkpoint_tensors(cfg)
        expected = {s.name for s in specs} | {s.name + SCALE_SUFFIX for s in specs if s.fp8}
        unexpected = sorted(n for n in self.weight_map if n not in expected and not IGNORED_TENSORS.match(n)
                            and not is_mtp_tensor(n, cfg))
        if unexpected:
            more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
            raise CheckpointError(f"{self.source}: tensors not in the model config.json describes: "
                                  f"{unexpected[:3]}{more}")

    def weights(self, cfg: K2Config) -> dict[str, StoredWeight]:
        """Every tensor ``cfg`` needs (checkpoint names), checked from the headers: present, shaped as the config
        implies, stored in a dtype k2lab reads; e4m3 ones only where the release has them, with their scales."""
        out: dict[str, StoredWeight] = {}
        for spec in checkpoint_tensors(cfg):
            data = self.info(spec.name)
            if data.shape != spec.shape:
                raise CheckpointError(f"{data.file}: tensor {spec.name} has shape {data.shape}, but config.json "
                                      f"implies {spec.shape}")
            if data.dtype not in DTYPES:
                raise CheckpointError(f"{data.file}: tensor {spec.name} is stored as {data.dtype}, which k2lab does "
                                      f"not read (supported: {sorted(DTYPES)})")
            scale = None
            if data.dtype == "F8_E4M3":
                if not spec.fp8 or cfg.fp8_block_size is None:
                    why = "config.json has no FP8 quantization_config" if spec.fp8 else "K2 keeps it in bfloat16"
                    raise CheckpointError(f"{data.file}: tensor {spec.name} is stored as F8_E4M3, but {why}")
                if spec.name + SCALE_SUFFIX not in self.weight_map:
                    raise CheckpointError(f"{data.file}: FP8 tensor {spec.name} has no {spec.name}{SCALE_SUFFIX} "
                                          f"in {self.source.name}")
                scale = self.info(spec.name + SCALE_SUFFIX)
                grid = scale_shape(spec.shape, cfg.fp8_block_size)
                if scale.shape != grid or scale.dtype != "F32":
                    raise CheckpointError(f"{scale.file}: {scale.name} is {scale.dtype} {scale.shape}, but a "
                                          f"{spec.shape} weight in {cfg.fp8_block_size} blocks needs F32 {grid}")
            out[spec.name] = StoredWeight(data, scale, cfg.fp8_block_size if scale is not None else None)
        return out

    def read(self, info: TensorInfo, device: torch.device | str = "cpu") -> torch.Tensor:
        """A new tensor on ``device`` holding the stored values, read from the file at the header's offset. For
        the meta device nothing is read: a pipeline stage on another process holds that part of the model."""
        device = torch.device(device)
        out = torch.empty(info.shape, dtype=DTYPES[info.dtype], device="meta" if device.type == "meta" else "cpu")
        if out.is_meta:
            return out
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        with info.file.open("rb", buffering=0) as f:
            f.seek(info.offset)
            done = 0
            while done < info.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise CheckpointError(f"{info.file} ends inside tensor {info.name}")
                done += n
        return out.to(device)

    def read_weight(self, weight: StoredWeight, dtype: torch.dtype | None,
                    device: torch.device | str = "cpu") -> torch.Tensor:
        """A model tensor on ``device`` in ``dtype`` (default: as stored; e4m3 matrices are dequantized, there).
        The router's correction bias stays float32: its steps are ~1e-3, and bfloat16 would change which experts
        are chosen."""
        tensor = self.read(weight.data, device)
        if weight.data.name.endswith("e_score_correction_bias"):
            return tensor.float()
        if weight.scale is not None:
            return dequantize(tensor, self.read(weight.scale, device), weight.block, dtype or torch.bfloat16)
        return tensor if dtype is None else tensor.to(dtype)


def is_mtp_tensor(name: str, cfg: K2Config) -> bool:
    """Whether ``name`` belongs to one of the multi-token-prediction blocks after the main ones."""
    if not name.startswith("model.layers."):
        return False
    layer = name.split(".")[2]
    first = cfg.num_hidden_layers
    return layer.isdigit() and first <= int(layer) < first + cfg.num_nextn_predict_layers


def read_weight_map(index: Path) -> dict[str, str]:
    """Tensor name -> file name, from a safetensors index."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index} is not a safetensors index with a 'weight_map': {err}") from err
    return weight_map
