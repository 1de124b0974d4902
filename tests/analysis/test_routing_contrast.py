"""Pooling routing traces (RoutingTrace.concat, padded batches) and contrasting two domains with bootstrap
intervals, against counts made by hand."""

from __future__ import annotations

import pytest
import torch
from tiny import TINY, token_ids

from k2lab import routing as R

# The shared TINY (E = 16, k = 4, MoE layers 1 and 2) and its seeded model fixture (conftest.py).


def ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return token_ids(TINY, batch, length, seed)


def test_concat_of_batches_equals_the_padded_batch(model):
    a, b = ids(2, 9, 0), ids(3, 5, 1)
    pooled = R.RoutingTrace.concat([R.trace(model, a), R.trace(model, b)])
    assert pooled.indices.shape[1:3] == (5, 9) and pooled.token_mask[2:, 5:].sum() == 0
    assert torch.equal(R.expert_counts(pooled), R.expert_counts(R.trace(model, a)) + R.expert_counts(R.trace(model, b)))
    batch = torch.zeros(5, 9, dtype=torch.long)
    mask = torch.zeros(5, 9, dtype=torch.long)
    batch[:2], mask[:2] = a, 1
    batch[2:, :5], mask[2:, :5] = b, 1
    padded = R.trace(model, batch, attention_mask=mask)
    assert torch.equal(padded.token_mask, pooled.token_mask)
    assert torch.equal(R.expert_counts(padded), R.expert_counts(pooled))
    assert torch.equal(R.domain_specialization(padded), R.domain_specialization(pooled))
    assert torch.allclose(R.consecutive_same_expert_rate(padded), R.consecutive_same_expert_rate(pooled))
    assert torch.allclose(R.coactivation(padded), R.coactivation(pooled))
    assert R.router_entropy(padded)[:, 2:, 5:].isnan().all()


def by_hand(tr: R.RoutingTrace, layer_row: int, expert: int) -> tuple[float, float]:
    """(share of tokens that chose the expert, share of routing weight it got) by looping over tokens."""
    chose = total = mass = weight = 0.0
    B, T = tr.indices.shape[1:3]
    for b in range(B):
        for t in range(T):
            if tr.token_mask is not None and not tr.token_mask[b, t]:
                continue
            slots = tr.indices[layer_row, b, t].tolist()
            total += 1
            chose += expert in slots
            weight += tr.weights[layer_row, b, t].sum().item()
            mass += sum(w for e, w in zip(slots, tr.weights[layer_row, b, t].tolist(), strict=True) if e == expert)
    return chose / total, mass / weight


def test_contrast_shares_and_ratios_match_hand_counts(model):
    code = R.RoutingTrace.concat([R.trace(model, ids(4, 8, 2)), R.trace(model, ids(3, 6, 3))])
    prose = R.trace(model, ids(6, 7, 4))
    c = R.contrast(code, prose, num_boot=200)
    assert c.share_a.shape == (2, 16) and c.ratio_ci.shape == (2, 2, 16)
    assert c.num_sequences == (7, 6) and c.num_tokens == (4 * 8 + 3 * 6, 42)
    for row in range(2):
        for expert in (0, 5, 11):
            share_a, wshare_a = by_hand(code, row, expert)
            share_b, wshare_b = by_hand(prose, row, expert)
            assert c.share_a[row, expert].item() == pytest.approx(share_a, rel=1e-6)
            assert c.weight_share_b[row, expert].item() == pytest.approx(wshare_b, rel=1e-5)
            if share_b > 0:
                assert c.ratio[row, expert].item() == pytest.approx(share_a / share_b, rel=1e-5)
    assert torch.allclose(c.share_a.sum(-1), torch.full((2,), 4.0))  # k per token
    assert torch.allclose(c.weight_share_a.sum(-1), torch.ones(2))
    low, high = c.share_a_ci
    assert ((low <= c.share_a + 1e-6) & (c.share_a <= high + 1e-6)).all()


def test_contrast_finds_a_planted_specialist_and_not_a_null_difference(model):
    code, prose = R.trace(model, ids(12, 6, 5)), R.trace(model, ids(12, 6, 6))
    same = R.contrast(code, code, num_boot=300)
    assert torch.allclose(same.ratio[~same.ratio.isnan()], torch.tensor(1.0))
    assert not any(same.specialised(layer) for layer in same.layers)
    planted = R.RoutingTrace(**{**code.__dict__, "indices": code.indices.clone()})
    planted.indices[0, ..., 0] = 7  # layer 1: every code token's first slot goes to expert 7
    prose.indices[0][prose.indices[0] == 7] = 8
    c = R.contrast(planted, prose, num_boot=300)
    assert c.specialised(1)[0][0] == 7 and c.ratio[0, 7].isinf()
    with pytest.raises(ValueError, match="confidence must lie in"):
        R.contrast(code, prose, confidence=95)
