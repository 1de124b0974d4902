"""The quantization seam: one ``QuantFormat`` per way a checkpoint stores its matrices.

A format is chosen from config.json's ``quantization_config`` (``format_from_quantization_config``) and travels
beside the K2Config, which describes the architecture only. It owns, per matrix:

- which matrices it quantizes (``quantizes``) and what the files hold for one (``layout``: names, dtypes, shapes);
- the bytes that takes (``tensor_bytes``: accounting and ``plan`` ask it);
- ``quantize`` (the writer) and ``dequantize`` (the reader, the resident modules, the streamed experts);
- the modules that keep its matrices quantized in memory and dequantize them at each use (``linear``,
  ``routed_experts``);
- the ``quantization_config`` it writes.

``UNQUANTIZED`` is the format of plain bfloat16 / float32 checkpoints, and of matrices dequantized at load, so no
code path asks "is this FP8?". A new format is one file subclassing ``QuantFormat``, decorated with ``@register``,
and imported in ``quant/__init__.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ...config import K2Config
from ...model.moe import Experts
from ...model.speed.linear import threaded_linear
from ..schema import EXPERT_PROJS, TensorSpec


@dataclass(frozen=True)
class Stored:
    """One tensor in the files for a checkpoint tensor. ``held``: the suffix its module buffer takes when the
    matrix stays quantized in memory (``weight`` + ``_fp8`` -> ``weight_fp8``); None: checked, never held."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    held: str | None = ""

    @property
    def nbytes(self) -> int:
        """The tensor's bytes: its elements times its dtype's size."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class QuantFormat:
    """How a checkpoint stores its matrices. Subclasses set ``name`` (and ``quant_method`` to be chosen from a
    quantization_config) and implement the quantized side; this base is the unquantized format."""

    name: ClassVar[str] = "unquantized"
    quant_method: ClassVar[str | None] = None  # config.json's quantization_config["quant_method"]

    @property
    def quantized(self) -> bool:
        """Whether this format quantizes anything (every format but ``UNQUANTIZED``)."""
        return self.quant_method is not None

    def quantizes(self, spec: TensorSpec) -> bool:
        """Whether this format stores ``spec`` quantized (else: one float tensor)."""
        return False

    def matrix_layout(self, name: str, shape: tuple[int, int]) -> tuple[Stored, ...]:
        """What the files hold for a quantized [O, I] matrix named ``name`` (``...proj.weight``), values first."""
        raise NotImplementedError(f"{self.name} stores no matrix quantized")

    def layout(self, spec: TensorSpec, dtype: torch.dtype = torch.bfloat16) -> tuple[Stored, ...]:
        """What the files hold for ``spec``: its quantized tensors, or one tensor in ``dtype`` (or the spec's own)."""
        if self.quantizes(spec):
            return self.matrix_layout(spec.name, spec.shape)  # type: ignore[arg-type]
        return (Stored(spec.name, spec.dtype or dtype, spec.shape),)

    def tensor_bytes(self, spec: TensorSpec, dtype: torch.dtype = torch.bfloat16, scales: bool = True) -> int:
        """Bytes ``spec`` takes as stored; ``scales=False`` counts a quantized matrix's values alone."""
        parts = self.layout(spec, dtype)
        return sum(p.nbytes for p in (parts if scales else parts[:1]))

    def quantize(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[O, I] float -> the tensors of ``matrix_layout`` (the writer's side)."""
        raise NotImplementedError(f"{self.name} stores no matrix quantized")

    def dequantize(self, held: tuple[torch.Tensor, ...], dtype: torch.dtype | None) -> torch.Tensor:
        """The held tensors of one matrix (or stacks of them, [E, ...]) -> [..., O, I] in ``dtype``. Unquantized: the
        tensor itself, converted (None keeps its dtype)."""
        (tensor,) = held
        return tensor if dtype is None else tensor.to(dtype)

    def check_unheld(self, spec: TensorSpec, stored: Stored, tensor: torch.Tensor) -> None:
        """Check the value of a stored tensor of ``spec`` that is not held (INT4's ``weight_shape``); raise
        ValueError if wrong."""

    def quantization_config(self) -> dict[str, Any] | None:
        """The config.json entry announcing this format (None: none)."""
        return None

    @classmethod
    def from_quantization_config(cls, config: dict[str, Any], where: str) -> QuantFormat:
        """This format as ``config`` (whose quant_method is ``cls.quant_method``) describes it; ValueError naming any
        setting k2lab does not implement."""
        raise NotImplementedError

    # ---- modules holding a format's matrices quantized ---------------------------------------------------------
    def linear(self, in_features: int, out_features: int, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str | None = None) -> nn.Module:
        """A bias-free Linear keeping its weight in this format (``.weight`` dequantized at each read)."""
        return QuantizedLinear(self, in_features, out_features, dtype, device)

    def routed_experts(self, cfg: K2Config, dtype: torch.dtype = torch.bfloat16,
                       device: torch.device | str | None = None) -> Experts:
        """A layer's routed experts stacked in this format, the chosen expert dequantized when it runs."""
        return QuantizedRoutedExperts(self, cfg, dtype, device)

    def held_layout(self, name: str, shape: tuple[int, int]) -> tuple[Stored, ...]:
        """The stored tensors of a quantized [O, I] matrix that a module holds, in order."""
        return tuple(s for s in self.matrix_layout(name, shape) if s.held is not None)


UNQUANTIZED = QuantFormat()
"""The format of a checkpoint stored in plain floats (bfloat16 for the release): nothing quantized."""
_REGISTRY: dict[str, type[QuantFormat]] = {}  # quant_method -> format
_BY_NAME: dict[str, QuantFormat] = {UNQUANTIZED.name: UNQUANTIZED}  # name -> the release's settings


def register(cls: type[QuantFormat]) -> type[QuantFormat]:
    """Class decorator: make a format choosable from config.json (by its quant_method) and by name (its default
    settings, those of the release that uses it)."""
    if cls.quant_method is None or cls.quant_method in _REGISTRY:
        raise ValueError(f"{cls.__name__}: quant_method {cls.quant_method!r} is missing or registered twice")
    _REGISTRY[cls.quant_method] = cls
    _BY_NAME[cls.name] = cls()
    return cls


def format_from_quantization_config(config: dict[str, Any] | None, where: str = "config.json") -> QuantFormat:
    """The stored format a config.json's ``quantization_config`` announces (None or empty: unquantized)."""
    if not config:
        return UNQUANTIZED
    if not isinstance(config, dict):
        raise ValueError(f"{where}: quantization_config must be a mapping, got {config!r}")
    method = config.get("quant_method")
    if method not in _REGISTRY:
        raise ValueError(f"{where}: quantization_config quant_method {method!r} is not implemented by k2lab "
                         f"(supported: {sorted(_REGISTRY)})")
    return _REGISTRY[method].from_quantization_config(config, where)


def resolve_format(format: QuantFormat | str) -> QuantFormat:
    """The format a public function was asked for: a QuantFormat, or a name: ``"fp8"`` (e4m3 in 128x128 blocks, the
    K2 release), ``"int4"``, ``"unquantized"``."""
    if isinstance(format, QuantFormat):
        return format
    if not isinstance(format, str) or format not in _BY_NAME:
        raise ValueError(f"format must be a QuantFormat or one of {sorted(_BY_NAME)}, got {format!r}")
    return _BY_NAME[format]


# ---- resident modules: the stored tensors as buffers, dequantized at each use -------------------------------------

class QuantizedResident(nn.Module):
    """Base of the modules keeping a format's stored tensors. ``model.to(...)``, ``.float()``, ``.cuda()`` move those
    tensors without converting them (``.float()`` would quadruple FP8 bytes, ``.half()`` round scales); a dtype change
    goes to ``self.dtype``, the dtype the weights are dequantized into."""

    dtype: torch.dtype

    def _apply(self, fn, recurse=True):
        stored = dict(self._buffers)
        # Where, and in which dtype, fn sends an ordinary float tensor from here.
        probe = fn(torch.empty(0, dtype=self.dtype, device=next(iter(stored.values())).device))
        self._buffers.clear()
        super()._apply(fn, recurse)
        self._buffers.update({  # (a meta tensor has no values to move: to_empty gets empty ones)
            name: torch.empty_like(b, device=probe.device) if b.is_meta else b.to(probe.device)
            for name, b in stored.items()
        })
        self.dtype = probe.dtype
        return self


class QuantizedLinear(QuantizedResident):
    """A bias-free Linear whose weight stays in ``format`` (buffers ``weight{suffix}``: FP8's ``weight_fp8`` and
    ``weight_scale_inv``). ``.weight`` is the dequantized weight, made at each read in ``dtype``, so code that reads
    weights (absorbed attention reads ``kv_b_proj.weight``) works unchanged."""

    def __init__(self, format: QuantFormat, in_features: int, out_features: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__()
        self.format, self.in_features, self.out_features, self.dtype = format, in_features, out_features, dtype
        self.suffixes = []
        for part in format.held_layout("weight", (out_features, in_features)):  # buffers: stored values, not trained
            self.register_buffer("weight" + part.held, torch.empty(part.shape, dtype=part.dtype, device=device))
            self.suffixes.append(part.held)

    @property
    def weight(self) -> torch.Tensor:  # [out, in] in self.dtype
        """The dequantized weight [out, in] in ``dtype``, made anew at each read."""
        return self.format.dequantize(tuple(getattr(self, "weight" + s) for s in self.suffixes), self.dtype)

    speed = True  # K2Model.speed: False runs F.linear always

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x @ weight^T [..., out], through the dequantized weight."""
        return threaded_linear(x, self.weight, self.speed)  # F.linear but for a decode step's few rows on the CPU

    def extra_repr(self) -> str:
        """What ``print(module)`` shows after the class name: the widths and the format."""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.format}"


class QuantizedRoutedExperts(QuantizedResident, Experts):
    """Routed experts held as stacks of ``format``'s stored tensors, ``{gate,up,down}_proj{suffix}`` [E, ...]; a
    chosen expert is dequantized when it runs (``expert_weights``); ``MoE`` runs them as it runs any experts."""

    def __init__(self, format: QuantFormat, cfg: K2Config, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.format, self.num_experts, self.dtype = format, E, dtype
        for proj, shape in zip(EXPERT_PROJS, ((I, D), (I, D), (D, I)), strict=True):
            parts = format.held_layout(proj, shape)
            for part in parts:
                self.register_buffer(proj + part.held, torch.empty(E, *part.shape, dtype=part.dtype, device=device))
        self.suffixes = [part.held for part in parts]

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, D], up [I, D], down [D, I]) of expert ``expert``, dequantized to ``dtype`` from the stored
        stacks."""
        return tuple(  # type: ignore[return-value]
            self.format.dequantize(tuple(getattr(self, p + s)[expert] for s in self.suffixes), self.dtype)
            for p in EXPERT_PROJS
        )

    def chosen_weights(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The matrices of the experts ``idx`` [...] names, gathered from the stored stacks by the routing tensor itself
        and dequantized: (gate [..., I, D], up [..., I, D], down [..., D, I]). No expert id is read back to Python, so
        a compiled step traces it and a GPU runs it without a host sync (model/speed/indexed_experts.py)."""
        return tuple(  # type: ignore[return-value]
            self.format.dequantize(tuple(gather(getattr(self, p + s), idx) for s in self.suffixes), self.dtype)
            for p in EXPERT_PROJS
        )

    def extra_repr(self) -> str:
        """What ``print(module)`` shows after the class name: the number of experts and the format."""
        return f"{self.num_experts} experts, {self.format}"


def gather(stack: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``stack[idx]``: the rows of a stored stack [E, ...] that ``idx`` [...] names -> [..., ...]. Float8 rows are
    gathered as their bytes (torch before 2.9 has no CPU indexing for float8 dtypes), the same values."""
    if stack.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return stack.view(torch.uint8)[idx].view(stack.dtype)
    return stack[idx]
