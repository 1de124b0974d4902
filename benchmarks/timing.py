"""Shared timing for the benchmarks: alternate the contenders round by round (so a busy, shared machine slows each
alike) and keep every round's time. Ratios within a round, not absolute times, are the figures to quote."""

from __future__ import annotations

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
                      warmup: int = 1) -> dict[tuple[str, int], list[float]]:
    """Seconds per call of each run at each thread count, one entry per timed round: every round times every run at
    every thread count in turn, so slow spells of a shared machine fall on all of them alike, and entry i of two runs
    at one thread count comes from the same round. The order changes from round to round (``round_order``) so that
    each run follows each other equally often: a run inherits its neighbour's freed memory and evicted caches, and in
    a rotation of one order each run would follow the same neighbour in every round but those where it goes first.
    The first ``warmup`` rounds are not timed; torch is left at the largest thread count."""
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
    return times


def alternate(runs: dict[str, Callable[[], object]], rounds: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each run at torch's current thread count (``alternate_threads`` at one count)."""
    import torch

    threads = torch.get_num_threads()
    return {name: statistics.median(t) for (name, _), t in alternate_threads(runs, [threads], rounds, warmup).items()}
