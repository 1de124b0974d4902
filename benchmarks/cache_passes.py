"""How flat in context can the absorbed decode step be? Its two products over the latent cache, timed alone.

    python -m benchmarks.cache_passes [--contexts 512 4096] [--rounds 21] [--threads 1 2]

The absorbed step reads each layer's cache [S, C+R] twice, in two products with few rows on the query side
(``MultiHeadLatentAttention._absorbed``): the scores, cache rows first ([S, C+R] @ [C+R, H*T]), and the values, the
softmax pattern against the c_KV columns of the same rows ([H*T, S] @ [S, C]). This times both, over every layer's
cache of ``benchmarks.vs_hf``'s model, as the step issues them, from copies used in rotation so that each pass reads
its cache from memory as a step does; with the model's 8 heads and, for comparison, with K2's 64. Beside them: the
cache's bytes read twice at the measured copy bandwidth, and the model's own decode step (random weights, eager, the
plain call) at each context. The step at the longest context cannot cost less than its cost at the shortest plus
what the passes add between the two, so that sum over the shortest-context step is the flattest ratio these kernels
allow; the step's measured ratio is printed beside it.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Callable

import torch

import k2lab
from k2lab.config import K2Config

from .timing import COLD_BYTES, alternate_threads, decode_step, tensor_copy
from .vs_hf import BENCH, table

K2_HEADS = 64
COPY_BYTES = 1 << 28


def cache_passes(cfg: K2Config, context: int, heads: int) -> tuple[Callable[[], object], float]:
    """(run, FLOPs of one run): both passes over each layer's cache at ``context`` tokens for one decode token of
    ``heads`` query rows, the caches cycled over copies that fill COLD_BYTES."""
    gen = torch.Generator().manual_seed(0)
    C, width, layers = cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.num_hidden_layers
    copies = max(1, COLD_BYTES // (4 * context * width * layers))
    rotation = itertools.cycle([[torch.randn(1, context, width, generator=gen) for _ in range(layers)]
                                for _ in range(copies)])
    query = torch.randn(1, heads, width, generator=gen)  # [1, H, C+R]
    pattern = torch.randn(1, heads, context, generator=gen).softmax(-1)  # [1, H, S]

    def run() -> None:
        for entries in next(rotation):  # [1, S, C+R]
            torch.bmm(entries, query.transpose(1, 2))  # [1, S, H] scores
            torch.bmm(pattern, entries[..., :C])  # [1, H, C] values

    return run, 2.0 * heads * context * (width + C) * layers


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs=2, default=[512, 4096])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    args = parser.parse_args()
    cfg, threads = BENCH, args.threads
    short, long = args.contexts
    torch.manual_seed(0)
    model = k2lab.K2Model(cfg).eval()
    runs, flops = {"copy": tensor_copy(COPY_BYTES)}, {}
    for context, heads in itertools.product(args.contexts, (cfg.num_attention_heads, K2_HEADS)):
        runs[context, heads], flops[context, heads] = cache_passes(cfg, context, heads)
    for context in args.contexts:
        runs["step", context] = decode_step(model, context)
    load_before = os.getloadavg()
    t = alternate_threads(runs, threads, args.rounds)
    H, width = cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    print(f"{cfg.num_hidden_layers} layers' caches [S, {width}] float32; "
          f"threads {threads}; {args.rounds} rounds, medians; load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")

    def cells(fn) -> list[str]:
        return [fn(n) for n in threads]

    def reread(context: int, n: int) -> float:  # seconds to read a context's caches twice at the copy bandwidth
        return 2 * 4 * context * width * cfg.num_hidden_layers / (2 * COPY_BYTES / t["copy", n])

    def flattest(n: int, passes: Callable[[int, int], float]) -> float:
        """The step at the short context plus what the passes add up to the long one, over the former."""
        step = t[("step", short), n]
        return (step + passes(long, n) - passes(short, n)) / step

    rows = []
    for context in args.contexts:
        rows += [(f"both passes at {context}, {H} query rows (ms)", "",
                  cells(lambda n, c=context: f"{t[(c, H), n] * 1e3:.2f}")),
                 ("  the cache read twice at the copy bandwidth (ms)", "",
                  cells(lambda n, c=context: f"{reread(c, n) * 1e3:.2f}"))]
    for heads in (H, K2_HEADS):
        rows.append((f"pass rate at {long}, {heads} query rows (GFLOP/s)", "",
                     cells(lambda n, h=heads: f"{flops[long, h] / t[(long, h), n] / 1e9:.0f}")))
    rows += [(f"decode step at {short}; {long} (ms)", "",
              cells(lambda n: f"{t[('step', short), n] * 1e3:.1f}; {t[('step', long), n] * 1e3:.1f}")),
             (f"step at {long} / at {short}, measured", "flat",
              cells(lambda n: f"{t[('step', long), n] / t[('step', short), n]:.2f}")),
             ("  the flattest these passes allow", "",
              cells(lambda n: f"{flattest(n, lambda c, n: t[(c, H), n]):.2f}")),
             ("  the flattest passes at the copy bandwidth would allow", "",
              cells(lambda n: f"{flattest(n, reread):.2f}"))]
    print(table(rows, threads))


if __name__ == "__main__":
    main()
