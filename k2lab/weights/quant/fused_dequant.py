"""Speed room: a quantized matrix dequantized in one pass on a GPU, with no float32 copy in memory.

Replaces the eager ``dequantize`` of a format (fp8.py, int4.py) wherever it runs eagerly off the CPU: the FP8 linears'
``.weight``, a chosen expert's matrices, streamed experts. Eagerly, ``dequantize`` writes the values widened to
float32, multiplies them by their scales in place, then rounds them to the compute dtype: three passes over a
float32 buffer twice the size of the bfloat16 result (for one K2 expert matrix [2048, 7168], 59 MB written and read
twice more). Compiled by ``torch.compile``, the same function becomes one kernel that reads the stored values and
scales and writes the result in the compute dtype; the float32 product lives only in registers. The arithmetic is the
same (each value widened exactly, multiplied by its scale in float32, rounded once), so the result equals the eager
one bit for bit (tests/weights/test_fused_dequant.py).

Where it does not run:
- on the CPU eagerly, whose exact path (FP8: the lookup table of fp8.py) stays, as loading and streaming use it;
- inside a graph being compiled (a compiled decode step): ``dequantize`` is traced there, and inductor fuses it with
  what reads the weight.
If compiling fails (no Triton, no C++ compiler), the function runs eagerly from then on, after a warning that says why.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch._dynamo.exc import BackendCompilerFailed

# Each dequantize function's kernel, compiled on its first use; or, once compiling it failed, why (it runs eagerly).
_KERNELS: dict[Callable[..., torch.Tensor], Callable[..., torch.Tensor] | str] = {}


def in_one_pass(dequantize: Callable[..., torch.Tensor], stored: torch.Tensor, *args) -> torch.Tensor:
    """``dequantize(stored, *args)``: one compiled kernel when ``stored`` is on a GPU and no graph is being traced;
    eagerly otherwise (the CPU's exact path, or the code a compiled graph traces)."""
    if stored.device.type in ("cpu", "meta") or torch.compiler.is_compiling():
        return dequantize(stored, *args)
    return run_compiled(dequantize, stored, *args)


def run_compiled(dequantize: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``dequantize(*args)`` through its compiled kernel (on any device); eagerly, after a warning naming why, once
    compiling it failed."""
    kernel = _KERNELS.get(dequantize)
    if kernel is None:  # shapes are symbols: one kernel for every matrix of the same rank, block and dtype
        kernel = _KERNELS[dequantize] = torch.compile(dequantize, fullgraph=True, dynamic=True)
    if isinstance(kernel, str):
        return dequantize(*args)
    try:
        return kernel(*args)
    except BackendCompilerFailed as err:  # no Triton, no C++ compiler, an inductor bug
        cause = err.inner_exception
        _KERNELS[dequantize] = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"
        warnings.warn(f"{dequantize.__module__}.{dequantize.__name__} could not be compiled into one kernel "
                      f"({_KERNELS[dequantize]}); it runs eagerly from now on, through a float32 copy of each "
                      "matrix", RuntimeWarning, stacklevel=3)
        return dequantize(*args)
