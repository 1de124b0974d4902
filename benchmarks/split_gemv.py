"""Few-row products with a weight: F.linear against k2lab's ``linear`` (equal blocks of weight rows, one per thread), at
one thread and all cores.

    python -m benchmarks.split_gemv [--rows 1 4 16] [--rounds 15] [--step-rounds 41]

- step: a decode step of ``benchmarks.vs_hf``'s model (random weights) at 512 and 4,096 cached tokens, and of
  4 sequences at 512, with its products split as shipped and with every product left to F.linear
  (``SPLIT_MIN_BLOCK`` set out of reach), in alternating rounds;
- matrices: each matrix of such a step alone, then all of them in turn, for 1, 4 and 16 rows (a decode step of
  that many sequences), each cycled over copies that fill 64 MB so that every product reads its weight from
  memory as a decode step does, not from cache; time per pass over the case's matrices. Results are checked
  equal to F.linear's first.
At one thread ``linear`` is F.linear; what it changes is how the time falls with a second thread.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from k2lab.model import linear as linear_module
from k2lab.model.linear import linear

from . import timing
from .timing import alternate_threads, weight_reads
from .vs_hf import BENCH, build_pair, decode_matrices


def check_equal(shapes: list[tuple[int, int]], rows: int, threads: list[int]) -> None:
    """Raise unless ``linear`` gives F.linear's result for every shape and thread count."""
    gen = torch.Generator().manual_seed(1)
    for (out_features, in_features), n in itertools.product(shapes, threads):
        torch.set_num_threads(n)
        w, x = torch.randn(out_features, in_features, generator=gen), torch.randn(rows, in_features, generator=gen)
        torch.testing.assert_close(linear(x, w), F.linear(x, w), msg=f"{rows} rows x {w.shape} at {n} threads")


def decode_step(model, context: int, min_block: int, batch: int = 1) -> Callable[[], object]:
    """One decode step of ``batch`` sequences at ``context`` cached tokens (``timing.decode_step``) with
    ``linear_module.SPLIT_MIN_BLOCK = min_block``."""
    step = timing.decode_step(model, context, batch)

    def run():
        linear_module.SPLIT_MIN_BLOCK = min_block
        return step()
    return run


def print_rows(title: str, names: list[str], times: dict, threads: list[int], scale: float, unit: str) -> None:
    """One line per name: "<old> / <new>  new/old" at each thread count."""
    header = "".join(f"{f'{n} thread(s): F.linear / linear ({unit}), ratio':>46s}" for n in threads)
    print(f"\n{title:34s}{header}")
    for name in names:
        cells = [f"{times[f'{name}|F.linear', n] * scale:9.1f} / {times[f'{name}|linear', n] * scale:7.1f}  "
                 f"{times[f'{name}|linear', n] / times[f'{name}|F.linear', n]:6.2f}" for n in threads]
        print(f"{name:34s}" + "".join(f"{c:>46s}" for c in cells))


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--step-rounds", type=int, default=41)
    args = parser.parse_args()
    threads = sorted({1, os.cpu_count() or 1})
    shipped = linear_module.SPLIT_MIN_BLOCK
    print(f"{BENCH.num_hidden_layers}-layer benchmark config of benchmarks.vs_hf, float32; medians")

    _, model = build_pair(BENCH)
    steps = {"decode step at 512": (512, 1), "decode step at 4096": (4096, 1),
             "decode step, 4 sequences at 512": (512, 4)}
    runs = {f"{name}|{which}": decode_step(model, context, block, batch) for name, (context, batch) in steps.items()
            for which, block in (("F.linear", 1 << 62), ("linear", shipped))}
    times = alternate_threads(runs, threads, args.step_rounds)
    linear_module.SPLIT_MIN_BLOCK = shipped
    print_rows(f"model ({args.step_rounds} rounds)", list(steps), times, threads, 1e3, "ms")

    step = [s for s in decode_matrices(BENCH, 0) if s[0]]  # the active weight matrices of one decode step
    shapes = sorted(set(step), key=lambda s: s[0] * s[1])
    for rows in args.rows:
        check_equal(shapes, rows, threads)
        cases = {f"{r} x {c}": [(r, c)] for r, c in shapes} | {f"a whole step's {len(step)} matrices": step}
        runs = {f"{name}|{which}": weight_reads(product, matrices, rows) for name, matrices in cases.items()
                for which, product in (("F.linear", F.linear), ("linear", linear))}
        times = alternate_threads({key: run for key, (run, _) in runs.items()}, threads, args.rounds)
        times = {(key, n): t / runs[key][1] for (key, n), t in times.items()}  # per pass over the case's matrices
        print_rows(f"{rows} row(s) @ weight^T ({args.rounds} rounds)", list(cases), times, threads, 1e6, "us")
    print(f"\nload average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
