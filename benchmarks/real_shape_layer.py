"""One true-size K2 MoE layer on a CPU with a small expert budget: peak memory, bytes read, tokens/s.

    python -m benchmarks.real_shape_layer [--budget-gib 2] [--prompt 32] [--decode 8] [--folder ...]

The layer (7168 wide, MLA at true size, 384 experts of 2048 in FP8, the true vocabulary) is written once by
benchmarks/write_real_shape_layer.py (done here first if the folder is missing: ~22 GB on disk, a few minutes).
``k2lab.load(folder, expert_budget_bytes=B)`` keeps the embedding, attention, router, shared expert, norm and head
resident in bfloat16 and streams the routed experts from the file through an LRU cache of B bytes, dequantizing
each on its miss. Then a prompt is prefilled and a few tokens decoded greedily through the latent cache.

Target: peak RSS <= what the process held before loading + 1.1 * the resident weights + B.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import k2lab
from k2lab.weights.reader import INDEX_FILE

from .write_real_shape_layer import DEFAULT_FOLDER, write

GIB = 2**30


def memory_status() -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of this process, in bytes (Linux)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", type=Path, default=DEFAULT_FOLDER)
    parser.add_argument("--budget-gib", type=float, default=2.0)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens to prefill")
    parser.add_argument("--decode", type=int, default=8, help="tokens to decode after the prompt")
    args = parser.parse_args()
    if not (args.folder / INDEX_FILE).is_file():
        write(args.folder)
    budget = int(args.budget_gib * GIB)

    before = memory_status()["VmRSS"]
    start = time.perf_counter()
    model = k2lab.load(args.folder, expert_budget_bytes=budget)
    load_seconds = time.perf_counter() - start
    resident = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    print(f"loaded in {load_seconds:.1f} s: {resident / GIB:.2f} GiB resident ({model.dtype}); routed experts "
          f"streamed through a {budget / GIB:.2f} GiB cache; RSS {memory_status()['VmRSS'] / GIB:.2f} GiB")

    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    cache, stats = model.new_cache(1), model.expert_cache.stats
    start = time.perf_counter()
    logits = model(ids, cache=cache)
    prefill_seconds = time.perf_counter() - start
    prefill_read, prefill_misses = stats.bytes_read, stats.misses
    print(f"prefill {args.prompt} tokens: {prefill_seconds:.1f} s = {args.prompt / prefill_seconds:.2f} tokens/s; "
          f"{prefill_misses} experts read ({prefill_read / GIB:.2f} GiB), {stats.hits} hits")

    start = time.perf_counter()
    for _ in range(args.decode):
        token = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        logits = model(token, cache=cache)
    decode_seconds = time.perf_counter() - start
    print(f"decode {args.decode} tokens: {decode_seconds:.1f} s = {args.decode / decode_seconds:.2f} tokens/s; "
          f"{stats.misses - prefill_misses} experts read ({(stats.bytes_read - prefill_read) / GIB:.2f} GiB)")
    print(f"expert cache: {stats}")

    peak = memory_status()["VmHWM"]
    target = before + 1.1 * resident + budget
    print(f"peak RSS {peak / GIB:.2f} GiB = {before / GIB:.2f} before loading + {(peak - before) / GIB:.2f}; target "
          f"<= {target / GIB:.2f} GiB (before + 1.1 x {resident / GIB:.2f} resident + {budget / GIB:.2f} budget): "
          f"{'met' if peak <= target else 'MISSED'}")


if __name__ == "__main__":
    main()
