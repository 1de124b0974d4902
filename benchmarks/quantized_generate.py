"""Generation of a quantized-resident K2 (FP8 e4m3 in 128x128 blocks, INT4 experts), eager against compiled
(``generate(compile=True)``: one graph per decode step, the quantized experts read by index), on the CPU.

    python -m benchmarks.quantized_generate            # K2Config.mini() in float32, 32 tokens after 16

Random seeded weights, saved in each format and loaded held quantized. The two ways alternate round by round
(benchmarks/timing.py); the figures are the compiled step's speed-up over eager (medians and ranges of the rounds'
ratios) at one thread and at all cores, with eager's tokens per second, and whether greedy tokens agree.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

import k2lab
from k2lab import K2Config
from k2lab.weights.quant.fp8 import FP8Format
from k2lab.weights.writer import save_checkpoint

from .timing import alternate_threads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny import random_model, token_ids  # noqa: E402  (the tests' seeded weights)

NEW_TOKENS, PROMPT, ROUNDS = 32, 16, 5


def main() -> None:
    cfg = K2Config.mini()
    model, ids = random_model(cfg, seed=0), token_ids(cfg, batch=1, length=PROMPT, seed=1)
    threads = sorted({1, torch.get_num_threads()})
    print(f"K2Config.mini() float32, {NEW_TOKENS} tokens after {PROMPT}; {ROUNDS} rounds; threads {threads}")
    for name, fmt in (("FP8", FP8Format((128, 128))), ("INT4", "int4")):
        with tempfile.TemporaryDirectory() as folder:
            save_checkpoint(model, folder, format=fmt)
            held = k2lab.load(folder, dtype=torch.float32, quantized_resident=True)
        runs = {way: partial(k2lab.generate, held, ids, NEW_TOKENS, stop_at_eos=False, compile=way == "compiled")
                for way in ("eager", "compiled")}
        same = torch.equal(runs["eager"](), runs["compiled"]())  # also compiles the step before timing
        times = alternate_threads(runs, threads, ROUNDS)
        for n in threads:
            ratios = [e / c for e, c in zip(times["eager", n], times["compiled", n], strict=True)]
            eager = NEW_TOKENS / statistics.median(times["eager", n])
            print(f"{name} resident, {n} thread(s): compiled {statistics.median(ratios):.2f}x eager "
                  f"(range {min(ratios):.2f}-{max(ratios):.2f}); eager {eager:.0f} tokens/s; "
                  f"greedy tokens equal: {same}")


if __name__ == "__main__":
    main()
