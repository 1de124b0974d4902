"""Speed room: a few-row product x @ W^T split over the CPU's threads (what a decode step multiplies).

Replaces ``F.linear`` in ``layers.Linear`` (and in the quantized linears of ``k2lab.weights.quant``) where
``split_pays``: a decode step on the CPU at more than one thread. There, torch hands such a product to a BLAS kernel
that runs it on one thread however many torch has, although the product only streams the weight from memory and memory
serves two threads faster than one. A batched product runs one batch entry per thread, so ``split_linear`` cuts the
weight into equal blocks of rows (a free view, up to one per thread) and runs the product as one batched product over
them. What a decode step gains at two threads is measured by ``python -m benchmarks.vs_hf`` (docs/speed.md). Equal to
``F.linear`` to float32 rounding.
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


def split_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [..., in] @ weight [out, in]^T is a product ``split_linear`` speeds up: at most ``SPLIT_MAX_ROWS``
    rows (``layers.Linear`` asks only for a decode step's: one new token per sequence), on the CPU, at more than one
    thread, against a contiguous weight of the same width that cuts into blocks of at least ``SPLIT_MIN_BLOCK``
    weights. One thread, GPUs, many rows and small weights run ``F.linear`` unchanged."""
    if (x.numel() > SPLIT_MAX_ROWS * x.shape[-1] or x.device.type != "cpu" or x.shape[-1] != weight.shape[-1]
            or not weight.is_contiguous()):
        return False
    threads = thread_count()
    if threads == 1:
        return False
    blocks = split_count(weight.shape[0], threads)
    return blocks > 1 and weight.numel() >= SPLIT_MIN_BLOCK * blocks


def split_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T -> [..., out] with one block of weight rows per thread (``split_count``
    blocks), also inside a compiled graph. For a product ``split_pays`` says yes to."""
    rows, (out_features, in_features) = x.numel() // x.shape[-1], weight.shape
    n = split_count(out_features, thread_count())
    block = out_features // n
    blocks_t = weight.as_strided((n, in_features, block), (block * in_features, 1, in_features))  # [n, in, out/n]
    out = torch.bmm(x.reshape(rows, in_features).expand(n, rows, in_features), blocks_t)  # [n, rows, out/n]
    if rows > 1:
        out = out.transpose(0, 1)  # [rows, n, out/n]
    return out.reshape(*x.shape[:-1], out_features)


def threaded_linear(x: torch.Tensor, weight: torch.Tensor, speed: bool = True) -> torch.Tensor:
    """``F.linear(x, weight)``, run by ``split_linear`` where ``speed`` and ``split_pays``: the product of the quantized
    linears (``k2lab.weights.quant``), whose weights are made at each use."""
    return split_linear(x, weight) if speed and split_pays(x, weight) else F.linear(x, weight)
