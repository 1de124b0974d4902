"""Speed room: FP8 products with block scales, on GPUs whose tensor cores multiply e4m3 (``torch._scaled_mm``).

Replaces ``FP8Linear``'s product x @ dequantize(W)^T, which writes W in bfloat16 at every use (two bytes per weight,
then read again by the product, where the stored weight is one byte), on GPUs that run DeepSeek-V3's scaling recipe
in cuBLASLt: compute capability 9.x (Hopper: H100, H200) with CUDA >= 12.9. The recipe:

- the weight as stored: e4m3 [O, I] with one float32 scale per 128x128 block (``weight_scale_inv`` [O/128, I/128]);
- the activations quantized on the fly to e4m3 with one float32 scale per row and 128 columns (1x128): each block's
  largest magnitude maps to e4m3's largest value, 448 (``quantize_activations``, as DeepSeek-V3's inference does);
- the tensor cores multiply e4m3 blocks, scale each 128-column partial sum by its two scales and accumulate in
  float32, written in bfloat16.

What the speed costs: the activations' rounding to e4m3 (3 mantissa bits), so the product equals
dequantise-then-matmul to that rounding (a relative error of about 2.6% on the outputs for Gaussian activations,
where bfloat16 operands cost 0.3%), not to bfloat16's: the numerics of DeepSeek-V3's inference and of FP8 serving
stacks. ``emulate_blockwise`` computes the same recipe in float32 on any device: the GPU's product equals it to
bfloat16 rounding, which ``benchmarks/gpu_check.py`` checks along with its distance to dequantise-then-matmul.
So it is opt-in: ``FP8Linear.fp8_products = True`` (and ``FP8RoutedExperts.fp8_products``) turns it on; by default
the GPU dequantises, then multiplies, as the CPU always does.

cuBLASLt's layouts (torch/aten ScaledBlas.cpp): x [M, K] row-major with scales [M, K/128] column-major; the weight as
the column-major [K, O] view of the stored [O, I] and its scales as the [I/128, O/128] view of the stored grid.
"""

from __future__ import annotations

import warnings

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
BLOCK = 128  # DeepSeek's recipe: 128x128 weight blocks, 1x128 activation blocks
# Rows are padded with zeros to a multiple of 16, as torch requires of the product's other two dimensions: issue 42
# saw cuBLASLt refuse a block-scaled product of one row, and a decode step's product, which reads the whole weight,
# costs no more for 16 rows.
ROWS_MULTIPLE = 16
# Devices whose cuBLASLt refused a block-scaled product at run time (device index -> why): their products take the
# dequantised path from then on.
_REFUSED: dict[int, str] = {}


@torch.compiler.assume_constant_result
def blockwise_unsupported(device_index: int) -> str:
    """Why CUDA device ``device_index`` cannot run block-scaled FP8 products ("" when it can). A compiled graph reads
    this once while tracing: it depends only on the device, and on a refusal recorded before the trace."""
    if device_index in _REFUSED:
        return _REFUSED[device_index]
    if torch.version.hip is not None:
        return "ROCm's hipBLASLt has no 1x128 / 128x128 block scaling"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    major, minor = torch.cuda.get_device_capability(device_index)
    if major != 9:
        return (f"cuBLASLt's 1x128 / 128x128 block scaling needs compute capability 9.x (Hopper); this GPU is "
                f"{major}.{minor}")
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 9):
        return f"cuBLASLt's 1x128 / 128x128 block scaling needs CUDA >= 12.9; torch was built with {torch.version.cuda}"
    return ""


def blockwise_applies(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether x [..., I] @ weight [O, I]^T (e4m3 in ``block`` blocks) can run block-scaled here: a CUDA device that
    supports it, K2's 128x128 blocks, I a multiple of 128 and O of 16, bfloat16 or float16 activations (the output
    dtype; a float32 model keeps the exact product)."""
    O, I = weight.shape
    return (weight.device.type == "cuda" and tuple(block) == (BLOCK, BLOCK) and I % BLOCK == 0
            and O % ROWS_MULTIPLE == 0 and x.dtype in (torch.bfloat16, torch.float16)
            and not blockwise_unsupported(weight.device.index or 0))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (e4m3 values [M, K], float32 scales [M, K/128]): each row's 128-column block
    divided by its largest magnitude / 448, so that x ~ values * scale block by block."""
    M, K = x.shape
    blocks = x.float().view(M, K // BLOCK, BLOCK)  # [M, K/128, 128]
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [M, K/128] (an all-zero block keeps zeros)
    return (blocks / scale[..., None]).to(FP8).view(M, K), scale


def blockwise_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [..., I] @ W^T -> [..., O] in x's dtype, W the e4m3 ``weight`` [O, I] times its 128x128 ``scale_inv``
    [ceil(O/128), I/128], multiplied in FP8 by ``torch._scaled_mm`` (``blockwise_applies`` must hold)."""
    *lead, I = x.shape
    return blockwise_product(x.reshape(-1, I), weight, scale_inv).view(*lead, weight.shape[0])


# An operator of its own, opaque to torch.compile: inductor would otherwise be free to lay out the activation scales
# its own way, and cuBLASLt takes only the layouts below.
@torch.library.custom_op("k2lab::blockwise_fp8_product", mutates_args=())
def blockwise_product(rows: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """rows [M, I] @ W^T -> [M, O] (``blockwise_linear``)."""
    M, I = rows.shape
    padded = -M % ROWS_MULTIPLE
    if padded:
        rows = torch.cat([rows, rows.new_zeros(padded, I)])  # [M', I] zero rows: zero scales, zero outputs
    values, scale = quantize_activations(rows)
    out = torch._scaled_mm(values, weight.t(), scale_a=scale.t().contiguous().t(), scale_b=scale_inv.t(),
                           out_dtype=rows.dtype)  # [M', O]
    return out[:M] if padded else out


@blockwise_product.register_fake
def _(rows: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weight.shape[0])


def refuse_blockwise(device: torch.device, error: Exception) -> None:
    """Record that ``device`` refused a block-scaled product (``error``): its products take the dequantised path from
    now on, after one warning that says why."""
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    reason = f"torch._scaled_mm refused it: {first_line}"
    _REFUSED[device.index or 0] = reason
    warnings.warn(f"FP8 products on {device} take the dequantised path: {reason}", RuntimeWarning, stacklevel=3)


def emulate_blockwise(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the block-scaled product computes, in float32 on any device: x [..., I] rounded to e4m3 in 1x128 blocks
    (``quantize_activations``) @ ``weight`` [O, I]^T (the dequantised float32 weight) -> [..., O] float32."""
    *lead, I = x.shape
    values, scale = quantize_activations(x.reshape(-1, I))
    rows = (values.float().view(-1, I // BLOCK, BLOCK) * scale[..., None]).view(-1, I)  # [M, I] as rounded
    return (rows @ weight.float().t()).view(*lead, weight.shape[0])
