"""Prefill and decode speed: k2lab against HF transformers' DeepseekV3, at one thread and at all cores.

Both models hold the same random weights, in float32, on the CPU.

    python -m benchmarks.vs_hf [--prefill 512] [--contexts 512 4096] [--rounds 11] [--decode-rounds 101]
                               [--threads 1 2]

- prefill: one forward over ``--prefill`` tokens without a cache: k2lab's default call ``model(ids)`` (attn_impl
  "auto", which takes the naive path there), and each path forced, against HF's forward.
- decode: one new token after ``--contexts`` cached tokens through each side's cache (k2lab's latent cache, HF's
  ``past_key_values``), cropped back after every step so that each timed step sees the same context. HF's step runs
  under no_grad, as HF's generate runs it. k2lab's step two ways, under no_grad as ``k2lab.generate`` runs it: the
  plain call ``model(token, cache=cache)``, and the same call through ``torch.compile(model, dynamic=True)``, as
  ``generate(compile=True)`` runs it (compiled at each thread count in an untimed round, its logits checked against
  the plain call's first).

- rooms: what each speed room gains, the same call timed with the room switched off, as a ratio to the call with
  it: the fused attention kernel at prefill (off: a no-op hook on ``hook_pattern``, which makes the naive path write
  its softmax out), and at decode the grouped experts (off: ``MoE.experts_impl = "loop"``, the reference loop) and
  the few-row thread split (off: ``Linear.speed = False`` on every product). And the grouped experts switched on at
  prefill (``MoE.experts_impl = "grouped"``), which a prefill's default leaves off.

Every contender is timed at each thread count within one process (``torch.set_num_threads``), the contenders and
thread counts alternating round by round (``benchmarks.timing``) so that slow spells of a shared machine fall on all
of them alike. Each ratio (HF's time over k2lab's, above 1 when k2lab is faster) is taken within a round and given
as the median and range (min-max) over the rounds of this one run; the load average is printed with them.

Targets, by median at one thread and at all cores: prefill of 512 tokens >= 1.15x HF; the eager decode step >= 1.9x HF
at 512 context and >= 5x at 4,096.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import warnings
from collections.abc import Callable

import torch

import k2lab
from k2lab import K2Config
from k2lab.model.layers import Linear
from k2lab.model.moe import MoE

from .timing import alternate_threads

BENCH = K2Config.mini().replace(
    vocab_size=8192,
    hidden_size=768,
    intermediate_size=2048,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=64,
    num_experts_per_tok=8,
    max_position_embeddings=8192,
)
PREFILL_TARGETS = {512: 1.15}  # prompt length -> HF / k2lab by median
DECODE_TARGETS = {512: 1.9, 4096: 5.0}  # cached context -> HF / k2lab by median
COMPILED_ATOL = 1e-4  # compiled against eager logits: float32 rounding of another order of the same sums
# k2lab's decode contenders, in the order they are printed.
PLAIN, COMPILED = "plain call", "compiled step"
DECODE_STEPS = (PLAIN, COMPILED)
# Each speed room switched off, timed beside the call it speeds up (the same call with the room): room -> call.
FUSED_OFF, GROUPED_OFF, SPLIT_OFF = "fused attention off", "grouped experts off", "thread split off"
GROUPED_ON = "grouped experts on"
ROOMS = {FUSED_OFF: "default call", GROUPED_OFF: PLAIN, SPLIT_OFF: PLAIN}


@contextlib.contextmanager
def experts_grouped(model: k2lab.K2Model, grouped: bool):
    """Every MoE layer runs its experts grouped (model/speed/grouped_experts.py) or through the reference loop."""
    before = {moe: moe.experts_impl for moe in model.modules() if isinstance(moe, MoE)}
    for moe in before:
        moe.experts_impl = "grouped" if grouped else "loop"
    try:
        yield
    finally:
        for moe, setting in before.items():
            moe.experts_impl = setting


@contextlib.contextmanager
def no_thread_split(model: k2lab.K2Model):
    """Every product of the model through F.linear (model/speed/linear.py switched off on each Linear)."""
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    for linear in linears:
        linear.speed = False
    try:
        yield
    finally:
        for linear in linears:
            linear.speed = True


def build_pair(cfg: K2Config):
    """An HF model with random weights and k2lab's model loaded from its save_pretrained folder."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()  # the deprecation notice for past_key_values, once per step
    torch.manual_seed(0)
    ref = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg.to_hf(), attn_implementation="eager")).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():  # spread router logits so routing is not uniform noise
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 3 / cfg.hidden_size**0.5)
    with tempfile.TemporaryDirectory() as folder:
        ref.save_pretrained(folder)
        ours = k2lab.load(folder).eval()
    return ref, ours


def prefill_calls(ref, ours, ids: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """One forward over ``ids`` [1, T] without a cache, each returning its logits: HF's, k2lab's default call, and
    k2lab with each attention path forced."""
    def unfused() -> torch.Tensor:
        with ours.hooks(fwd_hooks=[("hook_pattern", lambda pattern, hook: None)]):
            return ours(ids)

    def grouped() -> torch.Tensor:
        with experts_grouped(ours, True):
            return ours(ids)

    return {"hf": lambda: ref(ids, use_cache=False).logits, "default call": lambda: ours(ids),
            "naive forced": lambda: ours(ids, attn_impl="naive"),
            "absorbed forced": lambda: ours(ids, attn_impl="absorbed"), FUSED_OFF: unfused, GROUPED_ON: grouped}


def decode_steps(ref, ours, context: int, generator: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    """One decode step after ``context`` random cached tokens, each returning its logits [1, 1, V] and leaving its
    cache as it found it: HF's, and k2lab's two ways (``DECODE_STEPS``), each with a cache of its own. The compiled
    model compiles on its first call at each thread count."""
    vocab = ours.config.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=generator)
    token = torch.randint(0, vocab, (1, 1), generator=generator)
    hf_cache = ref(prompt, use_cache=True).past_key_values

    def hf_step() -> torch.Tensor:
        logits = ref(token, past_key_values=hf_cache, use_cache=True).logits
        hf_cache.crop(-1)  # transformers 5: a negative count of tokens to remove
        return logits

    def our_step(forward, mode, room_off=contextlib.nullcontext) -> Callable[[], torch.Tensor]:
        cache = ours.new_cache(1, capacity=context + 1)  # room for the step: no step grows it
        ours(prompt, cache=cache)  # the prompt eagerly, as generate prefills

        def step() -> torch.Tensor:
            with mode(), room_off():
                logits = forward(token, cache=cache)
            cache.crop(context)
            return logits
        return step

    return {"hf": hf_step, PLAIN: our_step(ours, torch.no_grad),
            COMPILED: our_step(torch.compile(ours, dynamic=True), torch.no_grad),
            GROUPED_OFF: our_step(ours, torch.no_grad, lambda: experts_grouped(ours, False)),
            SPLIT_OFF: our_step(ours, torch.no_grad, lambda: no_thread_split(ours))}


def check_compiled(steps: dict[str, Callable[[], torch.Tensor]], threads: list[int]) -> None:
    """Compile the compiled step at each thread count (a change of threads compiles again), and refuse to time it
    unless its logits match the plain call's."""
    for n in threads:
        torch.set_num_threads(n)
        expected, got = steps[PLAIN](), steps[COMPILED]()
        error = (got - expected).abs().max().item()
        if error > COMPILED_ATOL:
            raise AssertionError(f"at {n} threads the compiled step's logits differ from the plain call's by "
                                 f"{error:.2e}: it no longer computes the same step")


def round_ratios(times: dict[tuple[str, int], list[float]], name: str, n: int, over: str = "hf") -> list[float]:
    """``over``'s time (HF's by default) over ``name``'s at ``n`` threads, round by round (both timed in the same
    round)."""
    return [a / b for a, b in zip(times[over, n], times[name, n], strict=True)]


def spread(values: list[float]) -> str:
    """Median (min-max), to two places."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(rows: list[tuple[str, ...]]) -> str:
    """Rows of cells as aligned text, the first row the header; the first column left-aligned, the rest right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True))) for row in rows)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the timed prefill")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096],
                        help="cached tokens before each decode step")
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds of the prefills")
    parser.add_argument("--decode-rounds", type=int, default=101,
                        help="timed rounds of the decode steps: a round of steps takes far less than a round of "
                             "prefills, and more rounds narrow the decode ratios' range for little time")
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}),
                        help="thread counts to compare (default: 1 and all cores)")
    args = parser.parse_args()
    if min(args.rounds, args.decode_rounds, args.prefill, *args.contexts, *args.threads) < 1:
        parser.error("--prefill, --contexts, --rounds, --decode-rounds and --threads must be at least 1")
    warnings.filterwarnings("ignore")
    threads = args.threads
    load_before = os.getloadavg()

    ref, ours = build_pair(BENCH)
    gen = torch.Generator().manual_seed(0)
    print(f"config: {BENCH.num_hidden_layers} layers, {BENCH.hidden_size} wide, {BENCH.n_routed_experts} experts "
          f"top-{BENCH.num_experts_per_tok}, float32; threads {threads}; {args.rounds} rounds of prefill, "
          f"{args.decode_rounds} of decode steps")

    ids = torch.randint(0, BENCH.vocab_size, (1, args.prefill), generator=gen)
    calls = prefill_calls(ref, ours, ids)
    prefill = alternate_threads(calls, threads, args.rounds)
    decode = {}
    for context in args.contexts:
        steps = decode_steps(ref, ours, context, gen)
        check_compiled(steps, threads)
        decode[context] = alternate_threads(steps, threads, args.decode_rounds)
    load_after = os.getloadavg()

    def milliseconds(t: dict[tuple[str, int], list[float]], name: str, digits: int) -> list[str]:
        return [f"{statistics.median(t[name, n]) * 1e3:.{digits}f}" for n in threads]

    header = ("", *(f"{n} thread{'s' * (n > 1)}" for n in threads))
    times = [header] + [(f"prefill {args.prefill}: {name}", *milliseconds(prefill, name, 0)) for name in calls]
    times += [(f"decode at {context}: {name}", *milliseconds(t, name, 1))
              for context, t in decode.items() for name in ("hf", *DECODE_STEPS, GROUPED_OFF, SPLIT_OFF)]
    print("\ntimes (ms), median over the rounds\n" + table(times))

    ratios = [("", "target", *header[1:])]
    for name in [name for name in calls if name not in ("hf", FUSED_OFF)]:  # every k2lab call with its rooms
        target = PREFILL_TARGETS.get(args.prefill) if name == "default call" else None
        ratios.append((f"prefill {args.prefill}, {name}", f">= {target}x" if target else "",
                       *(spread(round_ratios(prefill, name, n)) for n in threads)))
    for context, t in decode.items():  # the targets are the eager steps'; the compiled step has none of its own
        target = DECODE_TARGETS.get(context)
        ratios += [(f"decode at {context}, {name}", f">= {target}x" if target and name != COMPILED else "",
                    *(spread(round_ratios(t, name, n)) for n in threads)) for name in DECODE_STEPS]
    print("\nHF's time / k2lab's, median (min-max) over the rounds of this run\n" + table(ratios))

    gains = [("", "call", *header[1:])]
    gains.append((FUSED_OFF, f"prefill {args.prefill}", *(spread(round_ratios(prefill, ROOMS[FUSED_OFF], n, FUSED_OFF))
                                                         for n in threads)))
    gains.append((GROUPED_ON, f"prefill {args.prefill}",
                  *(spread(round_ratios(prefill, GROUPED_ON, n, "default call")) for n in threads)))
    for room in (GROUPED_OFF, SPLIT_OFF):
        gains += [(room, f"decode at {context}", *(spread(round_ratios(t, ROOMS[room], n, room)) for n in threads))
                  for context, t in decode.items()]
    print("\nWhat each speed room gains: the call's time without the room / with it, median (min-max)\n"
          + table(gains))
    print(f"\nload average (1, 5, 15 min) before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
