"""k2lab.routing metrics: load, MaxVio, specialisation, co-activation, consecutive-token rate, entropy."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import TINY, token_ids

from k2lab import routing as R
from k2lab.analysis.interventions import edit_bias


def _trace(indices: list, num_experts: int, scores: torch.Tensor | None = None) -> R.RoutingTrace:
    """A hand-made trace: ``indices`` [L, B, T, k] of expert ids, every other field consistent with it."""
    idx = torch.tensor(indices)
    shape = (*idx.shape[:-1], num_experts)
    scores = torch.full(shape, 0.5) if scores is None else scores
    weights = torch.full(idx.shape, 1.0 / idx.shape[-1])
    return R.RoutingTrace(list(range(1, idx.shape[0] + 1)), idx, weights, scores, scores, idx,
                          torch.zeros(idx.shape[:-1], dtype=torch.bool))


# four tokens, E = 4, k = 2: {0,1} {1,2} {3,0} {3,0}
SMALL = _trace([[[[0, 1], [1, 2], [3, 0], [3, 0]]]], num_experts=4)


def test_counts_load_and_max_violation():
    counts = R.expert_counts(SMALL)
    assert counts.tolist() == [[3, 2, 1, 2]] and counts.sum() == 4 * 2  # N k
    assert R.expert_counts(SMALL, top=1).tolist() == [[1, 1, 0, 2]]
    assert torch.allclose(R.load_fraction(counts), torch.tensor([[3, 2, 1, 2]]) / 8)
    assert torch.allclose(R.relative_load(counts), torch.tensor([[1.5, 1.0, 0.5, 1.0]]))
    assert torch.allclose(R.max_violation(counts), torch.tensor([0.5]))
    # training logs give counts per step: [steps, L_moe, E] works the same
    assert R.max_violation(torch.tensor([[[5, 5, 5, 5]], [[8, 0, 0, 0]]])).tolist() == [[0.0], [3.0]]


def test_domain_specialization_is_the_share_of_tokens():
    assert torch.allclose(R.domain_specialization(SMALL), torch.tensor([[3, 2, 1, 2]]) / 4)
    assert torch.allclose(R.domain_specialization(SMALL, top=1), torch.tensor([[1, 1, 0, 2]]) / 4)


def test_vocabulary_specialization():
    vs = R.vocabulary_specialization(SMALL, torch.tensor([[5, 7, 5, 5]]), top=1)
    assert vs.token_ids.tolist() == [5, 7] and vs.occurrences.tolist() == [3, 1]
    # token 5 went first to experts 0, 3, 3; token 7 to expert 1
    assert torch.allclose(vs.ratio[0, 0], torch.tensor([1 / 3, 0, 0, 2 / 3]))
    assert torch.allclose(vs.ratio[0, 1], torch.tensor([0.0, 1, 0, 0]))
    assert torch.allclose(vs.mean_max(min_count=1), torch.tensor([(2 / 3 + 1) / 2]))
    assert torch.allclose(vs.mean_max(min_count=2), torch.tensor([2 / 3]))
    assert vs.top_tokens(layer=1, expert=3, min_count=1) == [(5, pytest.approx(2 / 3), 3), (7, 0.0, 1)]
    top2 = R.vocabulary_specialization(SMALL, torch.tensor([[5, 7, 5, 5]]), top=2)
    assert torch.allclose(top2.ratio.sum(-1), torch.tensor(2.0))  # each id's row sums to top


def test_coactivation_is_conditional_and_asymmetric():
    c = R.coactivation(SMALL)[0]
    assert c[0].tolist() == pytest.approx([0, 1 / 3, 0, 2 / 3])  # N(0) = 3: once with 1, twice with 3
    assert c[3, 0] == 1.0 and c[1, 0] == 0.5 and c[1, 2] == 0.5
    assert torch.all(c.diagonal() == 0)


def test_consecutive_rate_and_its_baseline():
    assert R.consecutive_same_expert_rate(SMALL).tolist() == pytest.approx([2 / 3])  # pairs 0-1 and 2-3 share
    assert R.consecutive_baseline(4, 2) == pytest.approx(1 - 1 / 6)
    assert R.consecutive_baseline(384, 8) == pytest.approx(0.1563, abs=1e-4)  # K2
    assert R.consecutive_baseline(32, 4) == pytest.approx(1 - math.comb(28, 4) / math.comb(32, 4))


def test_random_routing_meets_the_baselines():
    E, k, T = 16, 4, 4000
    gen = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])[None, None]  # [1, 1, T, k]
    tr = _trace(idx.tolist(), E)
    assert R.consecutive_same_expert_rate(tr).item() == pytest.approx(R.consecutive_baseline(E, k), abs=0.03)
    c = R.coactivation(tr)[0]
    off = c[~torch.eye(E, dtype=torch.bool)]
    assert off.mean().item() == pytest.approx((k - 1) / (E - 1), abs=0.01)
    assert R.max_violation(R.expert_counts(tr)).item() < 0.15


def test_router_entropy():
    E = 8
    flat = _trace([[[[0, 1]]]], E)  # scores all 0.5, weights equal
    assert R.router_entropy(flat).item() == pytest.approx(math.log(E))
    assert R.router_entropy(flat, over="weights").item() == pytest.approx(math.log(2))
    peaked = torch.full((1, 1, 1, E), 1e-9)
    peaked[..., 3] = 1.0
    assert R.router_entropy(_trace([[[[3, 0]]]], E, peaked)).item() == pytest.approx(0, abs=1e-6)
    with pytest.raises(ValueError, match="over must be"):
        R.router_entropy(flat, over="logits")


@torch.no_grad()
def test_metrics_follow_the_router_choice_not_the_logits(model):  # TINY, random non-zero correction bias
    ids = token_ids(TINY, 2, 9, seed=1)
    tr = R.trace(model, ids)
    _, cache = model.run_with_cache(ids, names="hook_topk_idx")
    for j, layer in enumerate(tr.layers):
        chosen = cache[f"layers.{layer}.mlp.gate.hook_topk_idx"]
        assert R.expert_counts(tr)[j].tolist() == torch.bincount(chosen.flatten(), minlength=16).tolist()
    # a huge bias on expert 5 makes every token choose it, whatever the logits say
    with edit_bias(model, {2: lambda b: b.index_fill(0, torch.tensor([5]), 100.0)}):
        biased = R.trace(model, ids)
    assert R.expert_counts(biased)[1, 5] == ids.numel()
    others = R.expert_counts(biased)[1] > 0
    others[5] = False
    assert torch.all(R.coactivation(biased)[1, others, 5] == 1.0)  # whoever is chosen is chosen with expert 5
    assert R.consecutive_same_expert_rate(biased)[1] == 1.0
