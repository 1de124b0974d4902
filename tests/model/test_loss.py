"""k2lab.loss.head_cross_entropy against PyTorch's own: the full logits through F.cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k2lab.model.speed.loss import head_cross_entropy


def _inputs(rows: int = 37, width: int = 16, vocab: int = 300, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, width, generator=gen) * 0.5).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    return hidden, weight, targets


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [1, 8, 37, 256])  # a last chunk shorter than the rest, one chunk, one row
def test_loss_and_gradients_match_full_logits(reduction, chunk_rows):
    hidden, weight, targets = _inputs()
    want = F.cross_entropy(hidden @ weight.T, targets, reduction=reduction)
    want_grads = torch.autograd.grad(want * 3.0, (hidden, weight))  # a non-unit incoming gradient
    got = head_cross_entropy(hidden, weight, targets, reduction, chunk_rows=chunk_rows)
    got_grads = torch.autograd.grad(got * 3.0, (hidden, weight))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_large_logits_do_not_overflow():
    hidden, weight, targets = _inputs()
    with torch.no_grad():
        weight *= 200  # logits in the thousands: exp without the row maximum subtracted is inf
    want = F.cross_entropy(hidden @ weight.T, targets)
    got = head_cross_entropy(hidden, weight, targets)
    assert got.isfinite() and torch.allclose(got, want, rtol=1e-5)


def test_without_autograd_only_the_loss_is_computed():
    hidden, weight, targets = _inputs()
    with torch.no_grad():
        got = head_cross_entropy(hidden, weight, targets, "sum")
        want = F.cross_entropy(hidden @ weight.T, targets, reduction="sum")
    assert not got.requires_grad
    torch.testing.assert_close(got, want)


def test_a_frozen_head_still_gives_the_hidden_gradient():
    hidden, weight, targets = _inputs()
    weight = weight.detach()
    (got,) = torch.autograd.grad(head_cross_entropy(hidden, weight, targets), hidden)
    (want,) = torch.autograd.grad(F.cross_entropy(hidden @ weight.T, targets), hidden)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change, named", [
    (dict(reduction="none"), "reduction must be 'mean' or 'sum'"),
    (dict(hidden=torch.zeros(37, 15)), "must share D"),
    (dict(targets=torch.zeros(36, dtype=torch.long)), r"targets must be \[N\] = \[37\]"),
])
def test_bad_input_is_named(change, named):
    hidden, weight, targets = _inputs()
    args = dict(hidden=hidden, weight=weight, targets=targets) | change
    with pytest.raises(ValueError, match=named):
        head_cross_entropy(**args)
