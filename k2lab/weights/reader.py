"""What is in a K2 checkpoint folder: config.json, safetensors files named by ``model.safetensors.index.json``
(or one ``model.safetensors``), tensors named as released (one per routed expert), matrices stored as the
checkpoint's format says (FP8 e4m3 with a float32 ``<name>_scale_inv``; packed INT4 with group scales; or plain).

``Checkpoint.weights(cfg, format)`` checks, from the headers alone, that every tensor ``cfg`` needs is there, shaped
as config.json implies and stored as the format lays it out. Errors name the tensor and the file. Nothing is ever
unpickled: only safetensors is read.

Tensor data is read with positioned reads at the offsets the header gives, not through ``safe_open``:
safe_open maps the whole file, and every page read through that map counts in the process's resident memory
until the handle closes (an expert cache of 2 GiB would look like the 17 GB of experts it streamed), while
reopening a handle per read re-parses a 2,300-entry header (~5 ms). safe_open still validates each header.
"""

from __future__ import annotations

import ctypes
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import K2Config
from ..hf_config import read_hf_json
from .quant import UNQUANTIZED, QuantFormat, Stored, format_from_quantization_config
from .schema import TensorSpec, checkpoint_tensors

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# The safetensors dtypes k2lab reads: the float dtypes of unquantized tensors, and the stored formats' own.
FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
DTYPES = {**FLOAT_DTYPES, "F8_E4M3": torch.float8_e4m3fn, "I32": torch.int32}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Stale tensors some checkpoints carry that hold nothing k2lab computes from.
IGNORED_TENSORS = re.compile(r".*rotary_emb\.(inv_freq|original_inv_freq)$")


def read_config(source: str | Path | dict) -> tuple[K2Config, QuantFormat]:
    """A checkpoint's config.json (a path to the file or its folder, or the parsed dict): the architecture
    (``k2lab.hf_config``: what is accepted, what is refused by name), and the stored format its
    ``quantization_config`` announces (``UNQUANTIZED`` without one)."""
    raw, where = read_hf_json(source)
    fmt = format_from_quantization_config(raw.get("quantization_config"), where)
    return K2Config.from_hf_dict(raw, where), fmt


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
    """A model tensor as stored: its header entries, in the order ``format.layout(spec)`` gives (one for an
    unquantized tensor; values then scales for a quantized matrix)."""

    spec: TensorSpec
    parts: tuple[TensorInfo, ...]
    format: QuantFormat  # UNQUANTIZED for a tensor stored as one float tensor

    @property
    def layout(self) -> tuple[Stored, ...]:
        """What the files hold for this tensor (``format.layout``), in the order of ``parts``."""
        return self.format.layout(self.spec, DTYPES[self.parts[0].dtype])

    @property
    def quantized(self) -> bool:
        """Whether the tensor is stored quantized (values and scales) rather than as one float tensor."""
        return self.format.quantized

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the files, every part counted."""
        return sum(part.nbytes for part in self.parts)


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
        """The header entry (dtype, shape, byte offset and size) of tensor ``name``; CheckpointError when its file lacks
        it."""
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

    def check_unexpected(self, cfg: K2Config, format: QuantFormat) -> None:
        """Refuse tensors the model of ``cfg`` stored in ``format`` has no place for (stale rotary buffers and the
        multi-token-prediction blocks config.json announces aside: see ``schema.mtp_tensors``)."""
        expected = {part.name for spec in checkpoint_tensors(cfg) for part in format.layout(spec)}
        unexpected = sorted(n for n in self.weight_map if n not in expected and not IGNORED_TENSORS.match(n)
                            and not is_mtp_tensor(n, cfg))
        if unexpected:
            more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
            raise CheckpointError(f"{self.source}: tensors not in the model config.json describes: "
                                  f"{unexpected[:3]}{more}")

    def weights(self, cfg: K2Config, format: QuantFormat) -> dict[str, StoredWeight]:
        """Every tensor ``cfg`` needs (checkpoint names), checked from the headers: present, shaped as the config
        implies, stored as ``format`` lays it out (quantized matrices with every companion tensor, the rest in a
        float dtype)."""
        return {spec.name: self._stored(spec, format) if format.quantizes(spec) else self._plain(spec, format)
                for spec in checkpoint_tensors(cfg)}

    def _plain(self, spec: TensorSpec, format: QuantFormat) -> StoredWeight:
        data = self._checked_values(spec.name, spec.shape)
        if data.dtype not in FLOAT_DTYPES:
            why = (f"config.json's quantization_config ({format.name}) leaves it unquantized" if format.quantized
                   else "config.json has no quantization_config") if spec.quantizable else "K2 keeps it in bfloat16"
            raise CheckpointError(f"{data.file}: tensor {spec.name} is stored as {data.dtype}, but {why}")
        return StoredWeight(spec, (data,), UNQUANTIZED)

    def _stored(self, spec: TensorSpec, format: QuantFormat) -> StoredWeight:
        values, *companions = format.layout(spec)
        data = self._checked_values(values.name, values.shape)
        if data.dtype != DTYPE_NAMES[values.dtype]:
            raise CheckpointError(f"{data.file}: tensor {values.name} is stored as {data.dtype}, but config.json's "
                                  f"quantization_config ({format}) stores it as {DTYPE_NAMES[values.dtype]}")
        parts = [data]
        for want in companions:
            if want.name not in self.weight_map:
                raise CheckpointError(f"{data.file}: {format.name.upper()} tensor {spec.name} has no {want.name} in "
                                      f"{self.source.name}")
            part = self.info(want.name)
            if part.shape != want.shape or part.dtype != DTYPE_NAMES[want.dtype]:
                raise CheckpointError(f"{part.file}: {part.name} is {part.dtype} {part.shape}, but a {spec.shape} "
                                      f"weight in {format} needs {DTYPE_NAMES[want.dtype]} {want.shape}")
            parts.append(part)
        return StoredWeight(spec, tuple(parts), format)

    def _checked_values(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        """The header entry of ``name``, shaped ``shape`` and in a dtype k2lab reads."""
        data = self.info(name)
        if data.shape != shape:
            raise CheckpointError(f"{data.file}: tensor {name} has shape {data.shape}, but config.json implies {shape}")
        if data.dtype not in DTYPES:
            raise CheckpointError(f"{data.file}: tensor {name} is stored as {data.dtype}, which k2lab does not read "
                                  f"(supported: {sorted(DTYPES)})")
        return data

    def read(self, info: TensorInfo, device: torch.device | str = "cpu") -> torch.Tensor:
        """A new tensor on ``device`` holding the stored values, read from the file at the header's offset. For
        the meta device nothing is read: a pipeline stage on another process holds that part of the model."""
        device = torch.device(device)
        out = torch.empty(info.shape, dtype=DTYPES[info.dtype], device="meta" if device.type == "meta" else "cpu")
        if out.is_meta:
            return out
        view = byte_view(out)
        with info.file.open("rb", buffering=0) as f:
            f.seek(info.offset)
            done = 0
            while done < info.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise CheckpointError(f"{info.file} ends inside tensor {info.name}")
                done += n
        return out.to(device)

    def read_held(self, weight: StoredWeight, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        """The stored tensors of ``weight`` that a module holds (all but checked-only ones such as INT4's
        ``weight_shape``, whose values are checked here), read as stored."""
        held = []
        for i, (info, part) in enumerate(zip(weight.parts, weight.layout, strict=True)):
            if part.held is not None:
                tensor = self.read(info, device)
                # A quantized matrix's scales (every float part after its values) are checked as they are read: a
                # NaN or infinite scale would make every logit NaN with nothing to say where it came from.
                if i > 0 and tensor.is_floating_point() and not tensor.is_meta and not tensor.isfinite().all():
                    bad = int((~tensor.isfinite()).sum())
                    raise CheckpointError(f"{info.file}: {info.name} holds non-finite block scales ({bad} of "
                                          f"{tensor.numel()} are NaN or infinite)")
                held.append(tensor)
            elif torch.device(device).type != "meta":  # (a meta stage reads nothing: another process checks it)
                tensor = self.read(info)
                try:
                    weight.format.check_unheld(weight.spec, part, tensor)
                except ValueError as err:
                    raise CheckpointError(f"{info.file}: {err}") from err
        return tuple(held)

    def read_weight(self, weight: StoredWeight, dtype: torch.dtype | None,
                    device: torch.device | str = "cpu") -> torch.Tensor:
        """A model tensor on ``device`` in ``dtype`` (default: as stored; quantized matrices are dequantized, there,
        into bfloat16 by default). A tensor with a dtype of its own (the correction bias) keeps it."""
        return weight.format.dequantize(self.read_held(weight, device), weight.spec.dtype or dtype)


def is_mtp_tensor(name: str, cfg: K2Config) -> bool:
    """Whether ``name`` belongs to one of the multi-token-prediction blocks after the main ones."""
    if not name.startswith("model.layers."):
        return False
    layer = name.split(".")[2]
    first = cfg.num_hidden_layers
    return layer.isdigit() and first <= int(layer) < first + cfg.num_nextn_predict_layers


def read_weight_map(index: Path) -> dict[str, str]:
    """Tensor name -> file name, from a safetensors index. Every file it names must be a bare file name, in the index's
    own folder: an entry such as ``../elsewhere/x.safetensors`` or an absolute path is refused, naming the entry, so
    that an index cannot make a load read any file of the machine."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index} is not a safetensors index with a 'weight_map': {err}") from err
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names, got "
                              f"{type(weight_map).__name__}")
    for name, file in weight_map.items():
        if not is_bare_file_name(file):
            raise CheckpointError(f"{index}: weight_map[{name!r}] = {file!r} is not a file name in the checkpoint's "
                                  f"folder; an index names its shards by bare file name (model-1-of-61.safetensors)")
    return weight_map


def is_bare_file_name(name: object) -> bool:
    """Whether ``name`` names a file in a folder and nowhere else: a non-empty string with no directory part (no
    separator, not ``.`` or ``..``, not absolute on any system)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and ":" not in name and "\x00" not in name)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview of its own memory, for files to read into and
    write from without a copy. Through ctypes rather than ``Tensor.numpy()``: numpy is no dependency of the core.
    The view does not keep ``tensor`` alive: the caller holds it while the view is used."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"byte_view needs a contiguous CPU tensor, got one on {tensor.device} "
                         f"(contiguous: {tensor.is_contiguous()})")
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
