"""Speed room: a few-row product x @ W^T split over the CPU's threads (what a decode step multiplies).

Replaces ``F.linear`` in ``layers.Linear`` for a decode step on the CPU: one new token per sequence, at most
``SPLIT_MAX_ROWS`` rows. There, torch hands such a product to a BLAS kernel that runs it on one thread however many
torch has, although the product only streams the weight from memory and memory serves two threads faster than one.
A batched product runs one batch entry per thread, so ``split_linear`` cuts the weight into equal blocks of rows (a
free view, up to one per thread) and runs the product as one batched product over them. What a decode step gains at
two threads is measured by ``python -m benchmarks.vs_hf`` (docs/speed.md). Equal to ``F.linear`` to float32
rounding; one thread, GPUs, many rows and small weights go to ``F.linear`` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Products with at most this many rows are split: BLAS threads products of more rows itself.
SPLIT_MAX_ROWS = 16
# Each block holds at least this many weights: below that, the batched call costs more than it saves.
SPLIT_MIN_BLOCK = 1 << 16


def split_count(out_features: int, threads: int) -> int:
    """Into how many equal blocks of rows to cut a weight of ``out_features`` rows for ``threads`` threads: the
    most, up to ``threads``, that divide it evenly (a bmm needs equal blocks); 1 means not at all."""
    return next(n for n in range(threads, 0, -1) if out_features % n == 0)


@torch.compiler.assume_constant_result
def thread_count() -> int:
    """torch's thread count. torch.compile reads it once while tracing and bakes it into the graph instead of breaking
    the graph at every product; that is sound because a compiled graph is guarded on the thread count (PyTorch's
    global state guard), so a change of threads recompiles."""
    return torch.get_num_threads()


def split_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T -> [..., out] with one block of weight rows per thread (``split_count``
    blocks), also inside a compiled graph; ``F.linear`` where a split would not pay."""
    threads = thread_count()
    rows = x.numel() // max(x.shape[-1], 1)
    if (threads == 1 or rows > SPLIT_MAX_ROWS or x.device.type != "cpu" or not weight.is_contiguous()
            or x.shape[-1] != weight.shape[-1]):
        return F.linear(x, weight)  # and F.linear names a width mismatch
    out_features, in_features = weight.shape
    n = split_count(out_features, threads)
    if n == 1 or weight.numel() < SPLIT_MIN_BLOCK * n:
        return F.linear(x, weight)
    block = out_features // n
    blocks_t = weight.as_strided((n, in_features, block), (block * in_features, 1, in_features))  # [n, in, out/n]
    out = torch.bmm(x.reshape(rows, in_features).expand(n, rows, in_features), blocks_t)  # [n, rows, out/n]
    if rows > 1:
        out = out.transpose(0, 1)  # [rows, n, out/n]
    return out.reshape(*x.shape[:-1], out_features)
