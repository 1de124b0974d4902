"""Inference mode against ``torch.no_grad``: k2lab's forwards where nothing observes the model against the same
calls with one probe attached (a hook that returns nothing), which keeps them in no_grad, at one thread and all cores.

    python -m benchmarks.generate_mode [--new 32] [--context 512] [--prefill 512] [--rounds 9] [--compile]

- K2-nano (the bundled checkpoint) and the benchmark config of ``benchmarks.vs_hf`` (random weights): a whole
  ``generate`` call, an 8-token prompt and ``--new`` new tokens, greedy;
- both: one decode step at ``--context`` cached tokens, the model called through its latent cache
  (cropped back after each step) in inference mode as generate runs it, and as a plain call under no_grad, which
  switches to inference mode itself once ``model.is_observed()`` has walked the modules;
- the benchmark config: one plain call over a ``--prefill``-token prompt.
Each way gives the same tokens or logits (checked before timing). Inference mode skips autograd's per-op bookkeeping
(version counters, view records) that no_grad still does; what that is worth is the per-op share of a call.
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


def observed(model: k2lab.K2Model, call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``call`` with one probe attached that returns nothing: the model's forwards stay in no_grad."""
    def run():
        with model.hooks(fwd_hooks=[("hook_logits", lambda t, hook: None)]):
            return call()

    return run


def generate_calls(model: k2lab.K2Model, new: int, compile: bool = False) -> dict[str, Callable[[], torch.Tensor]]:
    """One generate call each way (and compiled, with ``compile``), from the same 8-token prompt."""
    prompt = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))

    def inference():
        return k2lab.generate(model, prompt, new, eos_token_id=-1)

    def compiled():
        return k2lab.generate(model, prompt, new, eos_token_id=-1, compile=True)

    calls = {"inference mode": inference, "no_grad": observed(model, inference)}
    return calls | ({"compiled": compiled} if compile else {})


def decode_steps(model: k2lab.K2Model, context: int) -> dict[str, Callable[[], torch.Tensor]]:
    """One decode step at ``context`` cached tokens each way (the model's call, as generate's loop makes it)."""
    return {"inference mode": decode_step(model, context, mode=torch.inference_mode),
            "plain call": decode_step(model, context, mode=torch.no_grad),
            "no_grad": observed(model, decode_step(model, context, mode=torch.no_grad))}


def prefills(model: k2lab.K2Model, tokens: int) -> dict[str, Callable[[], torch.Tensor]]:
    """One plain call under no_grad over a prompt of ``tokens`` random tokens, unobserved and observed."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def plain():
        return model(ids)

    return {"plain call": plain, "no_grad": observed(model, plain)}


def checked(runs: dict[str, Callable[[], torch.Tensor]]) -> dict[str, Callable[[], torch.Tensor]]:
    """``runs``, once each has been seen to give the same tokens or logits as the no_grad one."""
    results = {name: run() for name, run in runs.items()}
    for name, result in results.items():
        if not torch.equal(result, results["no_grad"]):
            raise AssertionError(f"{name} gives other results than the same call under no_grad")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=32, help="new tokens per generate call")
    parser.add_argument("--context", type=int, default=512, help="cached tokens for the single decode step")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens for the single plain call")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    parser.add_argument("--compile", action="store_true", help="also time generate(compile=True)")
    args = parser.parse_args()
    threads = args.threads
    nano, _ = k2lab.load_nano()
    bench = bench_model()
    cases = {f"K2-nano, generate {args.new} tokens": checked(generate_calls(nano, args.new, args.compile)),
             f"benchmark config, generate {args.new} tokens": checked(generate_calls(bench, args.new, args.compile)),
             f"K2-nano, one decode step at {args.context}": checked(decode_steps(nano, args.context)),
             f"benchmark config, one decode step at {args.context}": checked(decode_steps(bench, args.context)),
             f"benchmark config, one prefill of {args.prefill}": checked(prefills(bench, args.prefill))}
    rows = []
    for name, runs in cases.items():
        t = alternate_threads(runs, threads, args.rounds)
        rows.append((f"{name}: {' / '.join(runs)} (ms)", "",
                     [" / ".join(f"{t[run, n] * 1e3:.1f}" for run in runs) for n in threads]))
        for run in runs:
            if run == "no_grad":
                continue
            base = "inference mode" if run == "compiled" else "no_grad"
            rows.append((f"{name}: {run} / {base}", "", [f"{t[run, n] / t[base, n]:.2f}" for n in threads]))
    print(f"medians of {args.rounds} alternating rounds; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} "
          "cores\n" + table(rows, threads))


if __name__ == "__main__":
    main()
