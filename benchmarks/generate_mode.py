"""``k2lab.generate`` in inference mode (nothing observes the model) against the same call under ``torch.no_grad``
(one probe attached, a hook that returns nothing), at one thread and all cores.

    python -m benchmarks.generate_mode [--new 32] [--context 512] [--rounds 9] [--compile]

- K2-nano (the bundled checkpoint) and the benchmark config of ``benchmarks.vs_hf`` (random weights): a whole
  ``generate`` call, an 8-token prompt and ``--new`` new tokens, greedy;
- the benchmark config: one decode step at ``--context`` cached tokens as generate runs it, the model called in
  each mode through its latent cache (cropped back after each step).
Both calls give the same tokens (checked before timing). Inference mode skips autograd's per-op bookkeeping
(version counters, view records) that no_grad still does; what that is worth is the per-op share of a step.
``--compile`` adds ``generate(compile=True)`` to the whole calls (compiled in the untimed first round at each thread
count; the same tokens checked first).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

import k2lab

from .timing import alternate_threads, decode_step
from .vs_hf import BENCH, table


def bench_model() -> k2lab.K2Model:
    """The benchmark config with seeded random weights."""
    torch.manual_seed(0)
    return k2lab.K2Model(BENCH).eval()


def generate_calls(model: k2lab.K2Model, new: int, compile: bool = False) -> dict[str, Callable[[], torch.Tensor]]:
    """One generate call each way (and compiled, with ``compile``), from the same 8-token prompt, checked to give the
    same tokens."""
    prompt = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))

    def inference():
        return k2lab.generate(model, prompt, new, eos_token_id=-1)

    def no_grad():
        with model.hooks(fwd_hooks=[("hook_logits", lambda t, hook: None)]):  # observed: no_grad
            return k2lab.generate(model, prompt, new, eos_token_id=-1)

    def compiled():
        return k2lab.generate(model, prompt, new, eos_token_id=-1, compile=True)

    calls = {"inference mode": inference, "no_grad": no_grad} | ({"compiled": compiled} if compile else {})
    tokens = {name: call() for name, call in calls.items()}
    for name, result in tokens.items():
        if not torch.equal(result, tokens["inference mode"]):
            raise AssertionError(f"generate gives different tokens {name} and in inference mode")
    return calls


def decode_steps(model: k2lab.K2Model, context: int) -> dict[str, Callable[[], torch.Tensor]]:
    """One decode step at ``context`` cached tokens in each mode (the model's call, as generate's loop makes it)."""
    return {"inference mode": decode_step(model, context, mode=torch.inference_mode),
            "no_grad": decode_step(model, context, mode=torch.no_grad)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=32, help="new tokens per generate call")
    parser.add_argument("--context", type=int, default=512, help="cached tokens for the single decode step")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    parser.add_argument("--compile", action="store_true", help="also time generate(compile=True)")
    args = parser.parse_args()
    threads = args.threads
    nano, _ = k2lab.load_nano()
    bench = bench_model()
    cases = {f"K2-nano, generate {args.new} tokens": generate_calls(nano, args.new, args.compile),
             f"benchmark config, generate {args.new} tokens": generate_calls(bench, args.new, args.compile),
             f"benchmark config, one decode step at {args.context}": decode_steps(bench, args.context)}
    rows = []
    for name, runs in cases.items():
        t = alternate_threads(runs, threads, args.rounds)
        rows.append((f"{name}: no_grad / inference mode (ms)", "",
                     [f"{t['no_grad', n] * 1e3:.1f} / {t['inference mode', n] * 1e3:.1f}" for n in threads]))
        rows.append((f"{name}: inference mode / no_grad", "",
                     [f"{t['inference mode', n] / t['no_grad', n]:.2f}" for n in threads]))
        if ("compiled", threads[0]) in t:
            rows.append((f"{name}: compiled (ms); compiled / inference mode", "",
                         [f"{t['compiled', n] * 1e3:.1f}; {t['compiled', n] / t['inference mode', n]:.2f}"
                          for n in threads]))
    print(f"medians of {args.rounds} alternating rounds; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} "
          "cores\n" + table(rows, threads))


if __name__ == "__main__":
    main()
