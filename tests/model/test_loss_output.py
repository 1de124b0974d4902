"""return_type="loss" / "both" and loss_per_token against F.cross_entropy written out by hand, with and without an
attention mask, through the chunked head (no logits held) and through the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import TINY, token_ids


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return token_ids(TINY, batch=2, length=9)  # two more positions than the shared fixture's


def by_hand(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(2, -1)
    if mask is None:
        return per_token.mean()
    scored = (mask[:, 1:] * mask[:, :-1]).bool()
    return per_token[scored].mean()


def test_loss_is_the_mean_next_token_cross_entropy(model, ids):
    with torch.no_grad():
        logits = model(ids)
        loss = model(ids, return_type="loss")
        both_logits, both_loss = model(ids, return_type="both")
    expected = by_hand(logits, ids)
    assert loss.shape == () and torch.allclose(loss, expected, rtol=1e-5)
    assert torch.equal(both_logits, logits) and torch.allclose(both_loss, expected, rtol=1e-5)


def test_masked_positions_are_excluded(model, ids):
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left pads in row 0
    mask[1, -2:] = 0  # right pads in row 1
    with torch.no_grad():
        logits = model(ids, attention_mask=mask)
        loss = model(ids, attention_mask=mask, return_type="loss")
        per_token = model(ids, attention_mask=mask, return_type="loss", loss_per_token=True)
        alone = model(ids[1:, :-2], return_type="loss")  # row 1 without its pads
        row1 = model(ids, attention_mask=mask, return_type="loss", loss_per_token=True)[1, :-2].mean()
    assert torch.allclose(loss, by_hand(logits, ids, mask), rtol=1e-5)
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(2, -1)
    scored = (mask[:, 1:] * mask[:, :-1]).bool()
    assert per_token.shape == (2, 8)
    assert torch.allclose(per_token[scored], expected[scored], rtol=1e-5) and (per_token[~scored] == 0).all()
    assert torch.allclose(row1, alone, rtol=1e-5)


def test_chunked_loss_has_the_gradient_of_the_cross_entropy(model, ids):
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    params = [model.lm_head.weight, model.layers[2].mlp.gate.weight, model.embed_tokens.weight]
    chunked = torch.autograd.grad(model(ids, attention_mask=mask, return_type="loss"), params)
    reference = torch.autograd.grad(by_hand(model(ids, attention_mask=mask), ids, mask), params)
    for ours, ref in zip(chunked, reference, strict=True):
        assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-7)


def test_probed_logits_fire_even_for_the_loss(model, ids):
    seen = []
    with torch.no_grad(), model.hooks(fwd_hooks=[("hook_logits", lambda t, hook: seen.append(t.shape))]):
        model(ids, return_type="loss")
    assert seen == [torch.Size([2, 9, 512])]


def test_bad_loss_requests(model, ids):
    with pytest.raises(ValueError, match="return_type must be 'logits', 'loss' or 'both', got 'probs'"):
        model(ids, return_type="probs")
    with pytest.raises(ValueError, match="loss_per_token=True asks for a loss"):
        model(ids, loss_per_token=True)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        model(ids[:, :1], return_type="loss")
    with pytest.raises(ValueError, match="no position has both a real token"):
        model(ids, attention_mask=torch.tensor([[1] + [0] * 8, [0] * 8 + [1]]), return_type="loss")
