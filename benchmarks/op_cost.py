"""How many ops an eager decode step can afford: what one eager op costs on this CPU, against the ops the step needs.

    python -m benchmarks.op_cost [--rounds 41] [--threads 1 2]

On ``benchmarks.vs_hf``'s model at 512 context, timed in alternating rounds: the model's decode step (the plain
call), the eager floor (``benchmarks.eager_floor``: the same step hand-written with the fewest ops), the bare GEMVs
over the step's matrices (the ceiling, taken as vs_hf takes it: the faster of F.linear and k2lab's split
``linear``), and three steps of a copy of the model shrunk until its weights fit in the cache (every width divided by
8; the same layers, experts, top-k and context): the eager floor, the model's step, and the step as ``generate`` runs
it (inside inference mode, where the model does not walk its modules to ask whether anything observes it). Each
step's ops are counted with a dispatch mode, products with a weight or the cache apart. What a step costs beyond the
ceiling, over the ops it issues besides its products, is what one of those ops costs inside it. A shrunk step's whole
time over all its ops is what an op costs with no weight stream between them: the shrunk floor's against the shrunk
model's says whether the model's ops each cost more than the floor's, or whether there are only more of them. A step
reaches the ceiling target (80%) only if everything but its products costs at most a quarter of the GEMVs' time: the
last row divides that allowance by the floor's cost per op, the most ops such a step could issue, against the floor's
and the model's counts.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F

import k2lab
from k2lab.config import K2Config
from k2lab.model.linear import linear

from .eager_floor import check_supported, minimal_decode_step
from .replay import HEAVY_OPS, AtenOps
from .timing import alternate_threads, decode_step, prefilled, weight_reads
from .vs_hf import BENCH, decode_matrices, table

# The ops that read a weight matrix or the cache: the products (and fused attention) that benchmarks.replay replays.
PRODUCTS = {op.overloadpacket.__name__ for op in HEAVY_OPS}
CONTEXT = 512
CEILING_TARGET = 0.8


def op_counts(run: Callable[[], object]) -> Counter:
    """How many times each aten op runs in one call of ``run`` (views included: each is a dispatch), in either
    mode (``AtenOps``)."""
    counts: Counter = Counter()

    class Count(AtenOps):
        def seen(self, func, args: tuple, kwargs: dict) -> None:
            counts[func.overloadpacket.__name__] += 1

    with Count():
        run()
    return counts


def small_ops(counts: Counter) -> int:
    """The ops of a count that are not products with a weight or the cache."""
    return sum(n for name, n in counts.items() if name not in PRODUCTS)


def shrunk(cfg: K2Config, factor: int) -> K2Config:
    """The same model with every width divided by ``factor``: the same layers, experts, top-k and code path."""
    return cfg.replace(vocab_size=cfg.vocab_size // factor, hidden_size=cfg.hidden_size // factor,
                       intermediate_size=cfg.intermediate_size // factor,
                       moe_intermediate_size=cfg.moe_intermediate_size // factor,
                       q_lora_rank=cfg.q_lora_rank // factor, kv_lora_rank=cfg.kv_lora_rank // factor,
                       qk_nope_head_dim=cfg.qk_nope_head_dim // factor,
                       qk_rope_head_dim=cfg.qk_rope_head_dim // factor, v_head_dim=cfg.v_head_dim // factor)


def floor_step(model: k2lab.K2Model, context: int) -> Callable[[], torch.Tensor]:
    """A run of the eager floor's decode step of ``model`` after ``context`` random tokens (the prompt and token of
    ``timing.decode_step``)."""
    check_supported(model)
    cache, token = prefilled(model, context)
    return lambda: minimal_decode_step(model, cache, int(token))


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    args = parser.parse_args()
    threads = args.threads
    torch.manual_seed(0)
    model, small = k2lab.K2Model(BENCH).eval(), k2lab.K2Model(shrunk(BENCH, 8)).eval()
    steps = {"step": decode_step(model, CONTEXT), "floor": floor_step(model, CONTEXT),
             "shrunk floor": floor_step(small, CONTEXT), "shrunk step": decode_step(small, CONTEXT),
             "shrunk generate step": decode_step(small, CONTEXT, mode=torch.inference_mode)}
    counts = {name: op_counts(run) for name, run in steps.items()}
    runs = {**steps, "gemv": weight_reads(F.linear, decode_matrices(BENCH, CONTEXT))[0],
            "gemv split": weight_reads(linear, decode_matrices(BENCH, CONTEXT))[0]}
    load_before = os.getloadavg()
    t = alternate_threads(runs, threads, args.rounds)
    t.update({("ceiling", n): min(t["gemv", n], t["gemv split", n]) for n in threads})  # as vs_hf takes it
    load_after = os.getloadavg()

    def per_op(name: str, n: int) -> float:  # seconds per op besides the products, beyond the bare GEMVs
        return (t[name, n] - t["ceiling", n]) / small_ops(counts[name])

    rows = [(f"{name} at {CONTEXT} context (ms)", "", [f"{t[key, n] * 1e3:.2f}" for n in threads])
            for key, name in (("step", "the model's decode step"), ("floor", "the eager floor"),
                              ("ceiling", "bare GEMVs over the same matrices, the faster of F.linear and split"))]
    for key, name in (("step", "the model's step"), ("floor", "the eager floor")):
        rows.append((f"{name}: ops besides products ({small_ops(counts[key])} of {sum(counts[key].values())}); "
                     "time beyond the GEMVs per op (us)", "", [f"{per_op(key, n) * 1e6:.1f}" for n in threads]))
    for key, name in (("shrunk floor", "the eager floor"), ("shrunk step", "the model's step"),
                      ("shrunk generate step", "the model's step as generate runs it")):
        ops = sum(counts[key].values())
        rows.append((f"{name}, every width / 8, weights in cache ({ops} ops): time per op (us)", "",
                     [f"{t[key, n] / ops * 1e6:.1f}" for n in threads]))
    rows.append((f"ops besides products a step could issue at {CEILING_TARGET:.0%} of the ceiling, at the floor's "
                 "cost per op", "",
                 [f"{t['ceiling', n] * (1 / CEILING_TARGET - 1) / per_op('floor', n):.0f}" for n in threads]))
    print(f"{args.rounds} alternating rounds, medians; load {load_before[0]:.2f} -> {load_after[0]:.2f} "
          f"on {os.cpu_count()} cores")
    print(table(rows, threads))


if __name__ == "__main__":
    main()
