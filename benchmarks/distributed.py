"""The pipeline on CPU ranks: tokens/s and bytes sent between ranks per token, for 1, 2 and 3 ranks (gloo, one
thread each) on a random K2Config.mini() saved as an FP8 checkpoint.

    python -m benchmarks.distributed [--ranks 1 2 3]

Scoring: ``pm(ids)`` on [4, 128] tokens, logits broadcast to every rank. Decoding: greedy ``pm.generate`` of one
row, 16-token prompt; the decode rate and bytes are the difference between 33 and 1 new tokens, per token. Bytes
are summed over all ranks (what leaves each process). The ranks run one stage at a time (no microbatches), so
more ranks only add transfers: the figures show the cost of the pipeline, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SCORE_SHAPE = (4, 128)
PROMPT, NEW_TOKENS = 16, 32


def write_mini(folder: Path) -> Path:
    from k2lab import K2Config, K2Model
    from k2lab.weights.writer import save_checkpoint

    model = K2Model(K2Config.mini())
    model.init_weights(seed=0)
    return save_checkpoint(model, folder)


def worker(folder: str) -> None:
    import torch.distributed as dist

    from k2lab.distributed import PipelinedK2

    torch.set_num_threads(1)
    pm = PipelinedK2(folder, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, pm.config.vocab_size, SCORE_SHAPE, generator=gen)
    prompt = torch.randint(0, pm.config.vocab_size, (1, PROMPT), generator=gen)

    def measure(fn) -> tuple[float, int]:
        """Median seconds of 3 runs after a warm-up, and the bytes all ranks sent in one run."""
        fn()
        times, sent = [], []
        for _ in range(3):
            before = pm.bytes_sent
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            times.append(time.perf_counter() - start)
            sent.append(pm.bytes_sent - before)
        total = torch.tensor(sent[-1])
        dist.all_reduce(total)
        return statistics.median(times), int(total)

    score_s, score_bytes = measure(lambda: pm(ids))
    long_s, long_bytes = measure(lambda: pm.generate(prompt, NEW_TOKENS + 1))
    short_s, short_bytes = measure(lambda: pm.generate(prompt, 1))
    if pm.rank == 0:
        tokens = SCORE_SHAPE[0] * SCORE_SHAPE[1]
        print(json.dumps({"ranks": pm.world_size, "score_tok_s": tokens / score_s,
                          "score_bytes_per_tok": score_bytes / tokens,
                          "decode_tok_s": NEW_TOKENS / (long_s - short_s),
                          "decode_bytes_per_tok": (long_bytes - short_bytes) / NEW_TOKENS}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_mini(Path(tmp))
        print(f"K2Config.mini() FP8 checkpoint, float32 compute; scoring {SCORE_SHAPE[0]} x {SCORE_SHAPE[1]} tokens, "
              f"decoding {NEW_TOKENS} tokens after a {PROMPT}-token prompt; one thread per rank")
        print(f"{'ranks':>5}  {'score tok/s':>12}  {'bytes/tok':>10}  {'decode tok/s':>12}  {'bytes/tok':>10}")
        for n in args.ranks:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                   __file__, "--worker", str(folder)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if done.returncode:
                raise SystemExit(f"{n} ranks failed:\n{done.stderr[-3000:]}")
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{n:>5}  {r['score_tok_s']:>12,.0f}  {r['score_bytes_per_tok']:>10,.0f}  "
                  f"{r['decode_tok_s']:>12,.1f}  {r['decode_bytes_per_tok']:>10,.0f}")


if __name__ == "__main__":
    main()
