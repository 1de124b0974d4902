"""FP8 weights as Kimi K2 releases them: e4m3 values with one float32 ``scale_inv`` per 128x128 block.

A block's real weight is value * scale_inv (the file stores the inverse of the scale used to quantize). An
[O, I] matrix has a [ceil(O/128), ceil(I/128)] scale grid; edge blocks may be partial: kv_a_proj_with_mqa has
576 = 4*128 + 64 rows, so its grid has 5 rows.

Two ways to hold such weights:
- dequantize once at load into bfloat16 (the CPU path: there is no FP8 matmul there);
- keep them FP8-resident and dequantize at each use (the GPU path: memory is about the FP8 bytes):
  ``FP8Linear`` and ``FP8RoutedExperts``. Their ``.weight`` / ``expert_weights(e)`` return dequantized tensors,
  so code that reads weights (absorbed attention reads ``kv_b_proj.weight``) works unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...config import K2Config
from ...model.moe import RoutedExperts

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")

# The exact float32 value of each of the 256 e4m3 bytes. On the CPU torch casts e4m3 with scalar code; looking
# bytes up in this table gives the same numbers about twice as fast (docs/experiments.md), which matters when
# experts are streamed and dequantized on every cache miss.
_FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float().numpy()


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Scale grid of an [O, I] weight: (ceil(O / b0), ceil(I / b1)); (5, 56) for K2's kv_a_proj_with_mqa."""
    return math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1])


def to_float32(weight: torch.Tensor) -> torch.Tensor:
    """e4m3 -> float32, exactly (a new tensor)."""
    if weight.device.type != "cpu":
        return weight.float()
    return torch.from_numpy(_FP8_VALUES[weight.contiguous().view(torch.uint8).numpy()])


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


class _FP8Resident(nn.Module):
    """Base of the FP8-resident modules. ``model.to(...)``, ``.float()``, ``.cuda()`` move the e4m3 values and the
    float32 scales without converting them (``.float()`` would quadruple the bytes, ``.half()`` round the scales);
    a dtype change goes to ``self.dtype``, the dtype the weights are dequantized into."""

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


class FP8Linear(_FP8Resident):
    """A bias-free Linear whose weight stays e4m3 with block scales. ``.weight`` is the dequantized weight, made
    at each read (in ``dtype``), so the FP8 bytes are all it keeps between uses."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int],
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features, self.block, self.dtype = in_features, out_features, block, dtype
        # Buffers, not parameters: e4m3 values are not trained.
        self.register_buffer("weight_fp8", torch.empty(out_features, in_features, dtype=FP8, device=device))
        grid = scale_shape((out_features, in_features), block)
        self.register_buffer("weight_scale_inv", torch.empty(grid, dtype=torch.float32, device=device))

    @property
    def weight(self) -> torch.Tensor:  # [out, in] in self.dtype
        return dequantize(self.weight_fp8, self.weight_scale_inv, self.block, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 in {self.block} blocks"


class FP8RoutedExperts(_FP8Resident, RoutedExperts):
    """Routed experts held as e4m3 stacks ``{gate,up,down}_proj_fp8`` [E, rows, cols] with scales
    ``{...}_scale_inv`` [E, ceil(rows/b0), ceil(cols/b1)]; a chosen expert is dequantized when it runs."""

    def __init__(self, cfg: K2Config, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        nn.Module.__init__(self)  # dispatch (forward) is inherited; only the storage differs, so no dense stacks
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.block, self.dtype = E, cfg.fp8_block_size, dtype
        for proj, shape in zip(EXPERT_PROJS, ((I, D), (I, D), (D, I)), strict=True):
            self.register_buffer(f"{proj}_fp8", torch.empty(E, *shape, dtype=FP8, device=device))
            grid = scale_shape(shape, self.block)
            self.register_buffer(f"{proj}_scale_inv", torch.empty(E, *grid, dtype=torch.float32, device=device))

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(  # type: ignore[return-value]
            dequantize(getattr(self, f"{p}_fp8")[expert], getattr(self, f"{p}_scale_inv")[expert], self.block,
                       self.dtype)
            for p in EXPERT_PROJS
        )
