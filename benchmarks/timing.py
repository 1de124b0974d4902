"""Shared timing for the benchmarks: alternate the contenders round by round (so a busy, shared machine
slows each alike) and report medians. Ratios, not absolute times, are the figures to quote."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable


def alternate(runs: dict[str, Callable[[], object]], rounds: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each run, timed in alternating rounds after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for run in runs.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth(num_bytes: int = 1 << 30, rounds: int = 5) -> float:
    """Measured memory bandwidth in bytes/s: a large tensor copy reads and writes ``num_bytes`` each."""
    import torch

    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    seconds = alternate({"copy": lambda: dst.copy_(src)}, rounds=rounds)["copy"]
    return 2 * num_bytes / seconds


def matmul_rate(n: int = 2048, dtype=None, rounds: int = 5) -> float:
    """Measured float32 (or ``dtype``) matmul rate in FLOP/s on square n x n matrices."""
    import torch

    a = torch.randn(n, n, dtype=dtype or torch.float32)
    b = torch.randn(n, n, dtype=dtype or torch.float32)
    seconds = alternate({"mm": lambda: a @ b}, rounds=rounds)["mm"]
    return 2 * n**3 / seconds


COLD_BYTES = 64 << 20  # more than this CPU's last-level cache (32 MB)
CALL_BYTES = 16 << 20  # weights one timed call reads at least


def weight_reads(product: Callable, shapes: list[tuple[int, int]], rows: int = 1
                 ) -> tuple[Callable[[], object], int]:
    """Bare products of ``rows`` rows with weights of these shapes, as a decode step reads its weights: a run that
    makes ``passes`` passes, each one ``product`` call with every one of ``shapes``' matrices in turn, from copies
    that fill COLD_BYTES used in rotation (so each weight comes from memory, not cache); and ``passes``. A run
    reads at least CALL_BYTES, so that one disturbed product (the first after a thread-count switch or a long
    neighbour) does not make a sample. A whole decode step's matrices fill COLD_BYTES alone: one pass, one copy."""
    import torch

    gen = torch.Generator().manual_seed(0)
    sizes = [r * c for r, c in shapes]
    copies = max(1, COLD_BYTES // (4 * sum(sizes)))
    matrices = iter(torch.randn(copies * sum(sizes), generator=gen).split(sizes * copies))
    rotation = itertools.cycle([[next(matrices).view(shape) for shape in shapes] for _ in range(copies)])
    inputs = {cols: torch.randn(rows, cols, generator=gen) for _, cols in shapes}
    passes = max(1, -(-CALL_BYTES // (4 * sum(sizes))))
    return lambda: [product(inputs[w.shape[1]], w) for _ in range(passes) for w in next(rotation)], passes
