"""The benchmarks' measuring helpers measure what they claim: the timing alternates its contenders fairly and keeps
every round, and benchmarks.vs_hf times the same computation on both sides, each decode step at the same context."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from tiny import TINY, token_ids

from benchmarks.timing import alternate_threads
from benchmarks.vs_hf import (
    COMPILED,
    DECODE_STEPS,
    GROUPED_OFF,
    SPLIT_OFF,
    build_pair,
    decode_steps,
    prefill_calls,
    round_ratios,
)


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6])
def test_alternate_threads_lets_every_run_follow_every_other_equally_often(count):
    """The contenders' order changes from round to round so that none always inherits the same neighbour's freed
    memory and caches: over one cycle of the design (count rounds, twice that for an odd count) each run follows
    each other run equally often, every run is called once per round, and every timed round is kept."""
    names = [f"run{i}" for i in range(count)]
    calls = []
    cycle = count if count % 2 == 0 else 2 * count
    times = alternate_threads({name: lambda name=name: calls.append(name) for name in names}, [1],
                              rounds=cycle - 1, warmup=1)
    assert set(times) == {(name, 1) for name in names} and len(calls) == count * cycle
    assert all(len(t) == cycle - 1 for t in times.values())  # the warmup round is not kept
    rounds = [calls[i : i + count] for i in range(0, len(calls), count)]
    assert all(sorted(order) == names for order in rounds)
    follows = Counter(pair for order in rounds for pair in itertools.pairwise(order))
    assert len(follows) == count * (count - 1) and len(set(follows.values())) == 1


def test_round_ratios_pair_the_runs_of_each_round():
    times = {("hf", 2): [4.0, 9.0, 6.0], ("k2lab", 2): [2.0, 3.0, 6.0]}
    assert round_ratios(times, "k2lab", 2) == [2.0, 3.0, 1.0]


@pytest.fixture(scope="module")
def pair():
    return build_pair(TINY)


@torch.no_grad()
def test_vs_hf_prefills_compute_the_same_logits_on_both_sides(pair):
    ref, ours = pair
    logits = {name: call() for name, call in prefill_calls(ref, ours, token_ids(TINY, batch=1, length=12)).items()}
    scale = logits["hf"].abs().max()
    for name, got in logits.items():
        assert (got - logits["hf"]).abs().max() < 1e-4 * scale, name


@torch.no_grad()
def test_vs_hf_decode_steps_compute_the_same_step_and_leave_each_cache_at_the_context(pair):
    """Every contender but the compiled one (whose first call compiles: vs_hf checks its logits before timing it),
    called twice: the same logits both times, so each cache was back at the context, and HF's logits and k2lab's
    agree, also with a speed room switched off; and the room is back on afterwards."""
    from k2lab.model.layers import Linear
    from k2lab.model.moe import MoE

    ref, ours = pair
    steps = decode_steps(ref, ours, 9, torch.Generator().manual_seed(0))
    assert set(steps) == {"hf", *DECODE_STEPS, GROUPED_OFF, SPLIT_OFF}
    logits = {}
    for name in ("hf", *(n for n in DECODE_STEPS if n != COMPILED), GROUPED_OFF, SPLIT_OFF):
        first, again = steps[name](), steps[name]()
        assert first.shape == (1, 1, TINY.vocab_size) and torch.equal(first, again), name
        logits[name] = first
    assert all(m.speed for m in ours.modules() if isinstance(m, Linear))
    assert all(m.experts_impl == "auto" for m in ours.modules() if isinstance(m, MoE))
    scale = logits["hf"].abs().max()
    for name, got in logits.items():
        assert (got - logits["hf"]).abs().max() < 1e-4 * scale, name
