"""Shared timing for the benchmarks: alternate the contenders round by round (so a busy, shared machine
slows each alike) and report medians. Ratios, not absolute times, are the figures to quote."""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable


def round_order(count: int, round_: int) -> list[int]:
    """The order in which ``count`` runs go in a given round: rows of a Williams design, in which every run
    follows every other equally often, once each in every ``count`` rounds (``2 * count`` when ``count`` is odd,
    the rows then read backwards every other cycle). The first row goes 0, 1, count - 1, 2, count - 2, ...; each
    next row adds one to every entry, modulo ``count``."""
    first = [0] + [(j + 1) // 2 if j % 2 else count - j // 2 for j in range(1, count)]
    row = [(entry + round_) % count for entry in first]
    return row[::-1] if count % 2 and (round_ // count) % 2 else row


def alternate_threads(runs: dict[str, Callable[[], object]], threads: list[int], rounds: int,
                      warmup: int = 1) -> dict[tuple[str, int], float]:
    """Median seconds per call of each run at each thread count: every round times every run at every thread
    count in turn, so slow spells of a shared machine fall on all of them alike. The order changes from round to
    round (``round_order``) so that each run follows each other equally often: a run inherits its neighbour's
    freed memory and evicted caches, and in a rotation of one order each run follows the same neighbour in every
    round but those where it goes first. The first ``warmup`` rounds are not timed; torch is left at the largest
    thread count."""
    import torch

    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in runs for n in threads}
    names = list(runs)
    for round_ in range(warmup + rounds):
        order = [names[i] for i in round_order(len(names), round_)]
        for n in threads:
            torch.set_num_threads(n)
            for name in order:
                start = time.perf_counter()
                runs[name]()
                if round_ >= warmup:
                    times[name, n].append(time.perf_counter() - start)
    torch.set_num_threads(max(threads))
    return {key: statistics.median(t) for key, t in times.items()}


def alternate(runs: dict[str, Callable[[], object]], rounds: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each run at torch's current thread count (``alternate_threads`` at one count)."""
    import torch

    threads = torch.get_num_threads()
    return {name: t for (name, _), t in alternate_threads(runs, [threads], rounds, warmup).items()}


def tensor_copy(num_bytes: int) -> Callable[[], object]:
    """A run that copies one tensor to another, reading and writing ``num_bytes`` each: what the memory bandwidth
    allows."""
    import torch

    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def copy_bandwidth(num_bytes: int = 1 << 30, rounds: int = 5) -> float:
    """Measured memory bandwidth in bytes/s: a large tensor copy reads and writes ``num_bytes`` each."""
    return 2 * num_bytes / alternate({"copy": tensor_copy(num_bytes)}, rounds=rounds)["copy"]


def matmul_rate(n: int = 2048, dtype=None, rounds: int = 5) -> float:
    """Measured float32 (or ``dtype``) matmul rate in FLOP/s on square n x n matrices."""
    import torch

    a = torch.randn(n, n, dtype=dtype or torch.float32)
    b = torch.randn(n, n, dtype=dtype or torch.float32)
    seconds = alternate({"mm": lambda: a @ b}, rounds=rounds)["mm"]
    return 2 * n**3 / seconds


def prefilled(model, context: int, batch: int = 1) -> tuple[object, object]:
    """A latent cache holding a prompt of ``context`` random tokens for ``batch`` sequences (room for one more), and
    the next token of each [batch, 1]: what a timed decode step starts from."""
    import torch

    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(batch, capacity=context + 1)
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (batch, context), generator=gen), cache=cache)
    return cache, torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen)


def decode_step(model, context: int, batch: int = 1, mode: Callable[[], object] | None = None
                ) -> Callable[[], object]:
    """A run of one decode step of ``batch`` random sequences after a prompt of ``context`` tokens (the model's call as
    generate's loop makes it, inside ``mode()``, e.g. ``torch.inference_mode``, when given), returning its logits; the
    cache is cropped back after each run, so every run sees the same context."""
    cache, token = prefilled(model, context, batch)

    def run():
        with mode() if mode is not None else contextlib.nullcontext():
            logits = model(token, cache=cache)
        cache.crop(context)
        return logits

    return run


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
