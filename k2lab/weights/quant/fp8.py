"""FP8 weights as Kimi K2 releases them: e4m3 values with one float32 ``scale_inv`` per 128x128 block.

A block's real weight is value * scale_inv (the file stores the inverse of the scale used to quantize). An
[O, I] matrix has a [ceil(O/128), ceil(I/128)] scale grid; edge blocks may be partial: kv_a_proj_with_mqa has
576 = 4*128 + 64 rows, so its grid has 5 rows.

``FP8Format`` is this layout behind the quantization seam (base.py): every matrix of attention, the MLPs and the
experts in e4m3 (the embedding, head, norms and router stay bfloat16). Two ways to hold such weights:
- dequantize once at load into bfloat16 (the CPU path: there is no FP8 matmul there);
- keep them FP8-resident and dequantize at each use (the GPU path: memory is about the FP8 bytes):
  ``FP8Linear`` and ``FP8RoutedExperts``. Their ``.weight`` / ``expert_weights(e)`` return dequantized tensors,
  so code that reads weights (absorbed attention reads ``kv_b_proj.weight``) works unchanged.
Off the CPU each use dequantizes in one compiled pass (fused_dequant.py), and ``FP8Linear`` multiplies in FP8 where
the GPU can (fp8_matmul.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ...config import K2Config
from ...model.speed.linear import threaded_linear
from ..schema import EXPERT_PROJS, TensorSpec
from .base import QuantFormat, QuantizedLinear, QuantizedRoutedExperts, Stored, register
from .fp8_matmul import FP8, FP8_MAX, blockwise_applies, blockwise_linear, refuse_blockwise
from .fused_dequant import in_one_pass

# The exact float32 values of every pair of e4m3 bytes (512 KiB): row v packs, in one float64 slot, the values of
# the two bytes of the int16 whose unsigned reading is v (the int32 -> int16 cast wraps 32768..65535 to the
# negatives), in memory order. Eager torch casts e4m3 with scalar code on the CPU; looking pairs up in this table
# gives the same numbers about twice as fast (docs/experiments.md), which matters when experts are streamed and
# dequantized on every cache miss. Pairs rather than single bytes: widening each byte to an index costs about as
# much as the lookup itself, and a pair halves the indices.
_FP8_PAIR_VALUES = (torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.uint8).view(FP8).float()
                    .view(torch.float64))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Scale grid of an [O, I] weight: (ceil(O / b0), ceil(I / b1)); (5, 56) for K2's kv_a_proj_with_mqa."""
    return math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1])


def to_float32(weight: torch.Tensor) -> torch.Tensor:
    """e4m3 -> float32, exactly (a new tensor)."""
    if weight.device.type != "cpu" or torch.compiler.is_compiling():  # a compiled graph casts in generated code
        return weight.float()
    data = weight.contiguous().view(-1).view(torch.uint8)
    if data.numel() % 2 or data.storage_offset() % 2:  # pairs need an even count at an even offset: copy, pad
        data = torch.cat([data, data.new_zeros(data.numel() % 2)])
    pairs = data.view(torch.int16).int().bitwise_and_(0xFFFF)  # the int16 read as unsigned: a row of the table
    return _FP8_PAIR_VALUES.index_select(0, pairs).view(torch.float32)[:weight.numel()].view(weight.shape)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """weight [..., O, I] e4m3, scale_inv [..., ceil(O/b0), ceil(I/b1)] float32 -> [..., O, I] in ``dtype``.

    Each block is multiplied by its scale in float32 and rounded once to ``dtype``, as DeepSeek's
    ``weight_dequant`` kernel does.
    """
    *batch, O, I = weight.shape
    b0, b1 = block
    grid = scale_shape(weight.shape, block)
    if tuple(scale_inv.shape[-2:]) != grid:
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not match a {(O, I)} weight in {block} blocks")
    w = to_float32(weight)  # [..., O, I]
    scale = scale_inv.to(device=w.device, dtype=torch.float32)
    if O % b0 or I % b1:  # partial edge blocks: spread each scale over its block, cropped at the edges
        w.mul_(scale.repeat_interleave(b0, dim=-2)[..., :O, :].repeat_interleave(b1, dim=-1)[..., :I])
    else:  # whole blocks: view the weight as [..., O/b0, b0, I/b1, b1] tiles and scale each tile
        w.view(*batch, grid[0], b0, grid[1], b1).mul_(scale[..., :, None, :, None])
    return w.to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[O, I] float -> (e4m3 [O, I], float32 scale_inv [ceil(O/b0), ceil(I/b1)]): each block's largest magnitude
    maps to the largest e4m3 value. For synthetic checkpoints and tests; the release comes quantized."""
    O, I = weight.shape
    (nO, nI), (b0, b1) = scale_shape(weight.shape, block), block
    padded = F.pad(weight.float(), (0, nI * b1 - I, 0, nO * b0 - O))  # zeros complete the edge blocks
    tiles = padded.view(nO, b0, nI, b1)
    scale_inv = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [nO, nI]
    values = (tiles / scale_inv[:, None, :, None]).view(nO * b0, nI * b1)[:O, :I]
    return values.to(FP8).contiguous(), scale_inv


@register
@dataclass(frozen=True)
class FP8Format(QuantFormat):
    """DeepSeek-V3 / Kimi K2 FP8: each quantizable matrix as e4m3 ``weight`` [O, I] with a float32
    ``weight_scale_inv`` [ceil(O/b0), ceil(I/b1)]; everything else unquantized."""

    name: ClassVar[str] = "fp8"
    quant_method: ClassVar[str | None] = "fp8"
    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        # A scalar (block=128) or None is refused here, by name, before tuple() would fail on it
        pair = isinstance(self.block, tuple | list) and len(self.block) == 2
        if not pair or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in self.block):
            raise ValueError(f"FP8 block must be a (rows, cols) pair of positive integers, e.g. "
                             f"FP8Format(block=(128, 128)); got block={self.block!r}")
        object.__setattr__(self, "block", tuple(self.block))

    def quantizes(self, spec: TensorSpec) -> bool:
        """Every quantizable matrix (``spec.quantizable``) is stored in e4m3."""
        return spec.quantizable

    def matrix_layout(self, name: str, shape: tuple[int, int]) -> tuple[Stored, ...]:
        """An [O, I] matrix as stored: e4m3 ``weight`` [O, I], then float32 ``weight_scale_inv`` [ceil(O/b0),
        ceil(I/b1)]."""
        return (Stored(name, FP8, tuple(shape), "_fp8"),
                Stored(name + "_scale_inv", torch.float32, scale_shape(shape, self.block), "_scale_inv"))

    def quantize(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[O, I] float -> (e4m3 values [O, I], float32 scale_inv per block): each block's largest magnitude maps to
        e4m3's largest, 448."""
        return quantize(weight, self.block)

    def dequantize(self, held: tuple[torch.Tensor, ...], dtype: torch.dtype | None) -> torch.Tensor:
        """(e4m3 values, scale_inv) of a matrix (or of stacks [E, ...]) -> values * scale_inv block by block, in
        ``dtype`` (default bfloat16)."""
        values, scale_inv = held
        return in_one_pass(dequantize, values, scale_inv, self.block, dtype or torch.bfloat16)  # fused_dequant.py

    def quantization_config(self) -> dict[str, Any]:
        """config.json's entry for this format: quant_method ``fp8``, fmt ``e4m3``, dynamic activations, the block
        size."""
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block)}

    @classmethod
    def from_quantization_config(cls, config: dict[str, Any], where: str) -> FP8Format:
        # DeepSeek-V3.1 adds scale_fmt "ue8m0": its block scales are powers of two (an unsigned 8-bit exponent, for
        # kernels that round their activation scales so), still stored as float32 weight_scale_inv, so dequantizing
        # is unchanged. Any other scale format is refused.
        """The format that config.json's quantization_config describes: e4m3 in a 2-d ``weight_block_size``
        (DeepSeek-V3.1's power-of-two ``ue8m0`` scales too); ValueError naming anything else."""
        if config.get("scale_fmt") not in (None, "ue8m0"):
            raise ValueError(f"{where}: quantization_config scale_fmt={config['scale_fmt']!r} is not implemented by "
                             "k2lab (supported: 'ue8m0', power-of-two float32 scales)")
        block = config.get("weight_block_size")
        if config.get("fmt", "e4m3") != "e4m3" or not isinstance(block, (list, tuple)) or len(block) != 2:
            raise ValueError(f"{where}: quantization_config {config} is not implemented by k2lab "
                             "(supported for quant_method 'fp8': fmt 'e4m3', a 2-d weight_block_size)")
        return cls((int(block[0]), int(block[1])))

    def linear(self, in_features: int, out_features: int, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str | None = None) -> FP8Linear:
        """An ``FP8Linear`` with this format's block size."""
        return FP8Linear(in_features, out_features, self.block, dtype, device)

    def routed_experts(self, cfg: K2Config, dtype: torch.dtype = torch.bfloat16,
                       device: torch.device | str | None = None) -> FP8RoutedExperts:
        """A layer's routed experts held in e4m3 with this format's block size (``FP8RoutedExperts``)."""
        return FP8RoutedExperts(cfg, self.block, dtype, device)


class FP8Linear(QuantizedLinear):
    """A bias-free Linear whose weight stays e4m3 (``weight_fp8``) with float32 block scales (``weight_scale_inv``).
    ``.weight`` is the dequantized weight, made at each read (in ``dtype``), so the FP8 bytes are all it keeps
    between uses.

    Its product is x @ ``.weight``^T, equal to the checkpoint's arithmetic to bfloat16 rounding. With
    ``fp8_products = True`` (on a module or on the class) it reads the e4m3 bytes themselves where the GPU multiplies
    FP8 (fp8_matmul.py: Hopper), activations rounded to e4m3 in 1x128 blocks: DeepSeek-V3's serving arithmetic, faster
    and about 2.6% off per product, so off by default in a lab that compares activations."""

    fp8_products: bool = False

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int] = (128, 128),
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        super().__init__(FP8Format(block), in_features, out_features, dtype, device)
        self.block = self.format.block

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        """x [..., in] -> x @ weight^T [..., out]: through the dequantized weight, or the e4m3 bytes themselves with
        ``fp8_products`` on a GPU that multiplies FP8."""
        return fp8_product(x, self.weight_fp8, self.weight_scale_inv, self.block, self.dtype,
                           self.fp8_products and self.speed, self.speed)

    def extra_repr(self) -> str:
        """What ``print(module)`` shows after the class name: the widths and the block size."""
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 in {self.block} blocks"


class FP8RoutedExperts(QuantizedRoutedExperts):
    """Routed experts held as e4m3 stacks ``{gate,up,down}_proj_fp8`` [E, rows, cols] with scales
    ``{...}_scale_inv`` [E, ceil(rows/b0), ceil(cols/b1)]; a chosen expert is dequantized when it runs, or, run one at
    a time (``expert_linears``), multiplied in FP8 where the GPU can, as ``FP8Linear`` is."""

    fp8_products: bool = False  # as FP8Linear's

    def __init__(self, cfg: K2Config, block: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__(FP8Format(block), cfg, dtype, device)
        self.block = self.format.block

    def expert_linears(self, expert: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
        """The products h [n, D] -> h @ W^T of expert ``expert``'s gate, up and down (``fp8_product``)."""
        return tuple(partial(fp8_product, values=getattr(self, p + "_fp8")[expert],
                             scale_inv=getattr(self, p + "_scale_inv")[expert], block=self.block, dtype=self.dtype,
                             fp8_products=self.fp8_products) for p in EXPERT_PROJS)


def fp8_product(x: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                dtype: torch.dtype, fp8_products: bool = False, speed: bool = True) -> torch.Tensor:
    """x [..., I] @ W^T -> [..., O], W the e4m3 ``values`` [O, I] times ``scale_inv`` in ``block`` blocks: multiplied
    block-scaled in FP8 where the GPU can and ``fp8_products`` (fp8_matmul.py), else x @ W^T with W dequantized into
    ``dtype`` (in one pass off the CPU), its few-row products split over the CPU's threads where ``speed`` pays."""
    if fp8_products and blockwise_applies(x, values, block):
        try:
            return blockwise_linear(x, values, scale_inv)  # fp8_matmul.py
        except (RuntimeError, ValueError) as err:  # cuBLASLt refused: named once, then every product dequantises
            refuse_blockwise(x.device, err)
    return threaded_linear(x, in_one_pass(dequantize, values, scale_inv, block, dtype), speed)
