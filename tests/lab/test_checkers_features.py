"""Notebook 11's checkers cannot be fooled: each wrong answer below is written the way a learner would write it and
must fail with its reason, while right answers (written here from the definitions, not from k2lab) pass."""

from __future__ import annotations

import math

import torch
from learner import fails_with, passes

from k2lab.lab import exercises as ex

# --- purity -------------------------------------------------------------------------------------------------------


def per_expert(active: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """[E] how many of the feature's tokens chose each expert."""
    return chosen[active].sum(0).float()


def test_purity_right_answers_pass():
    passes(ex.check_feature_purity(lambda active, chosen: (per_expert(active, chosen).max() / active.sum()).item()))
    passes(ex.check_feature_purity(lambda active, chosen: per_expert(active, chosen).max() / active.sum()))  # a tensor


def test_purity_wrong_answers_fail_with_their_reason():
    fails_with(ex.check_feature_purity(lambda a, c: per_expert(a, c).max() / len(a)), "divided by every token")
    fails_with(ex.check_feature_purity(lambda a, c: per_expert(a, c).max() / (a.sum() * c[0].sum())),
               "divided by the k = 2 slots")
    fails_with(ex.check_feature_purity(lambda a, c: per_expert(~a, c).max() / (~a).sum()), "NOT active")
    fails_with(ex.check_feature_purity(lambda a, c: per_expert(a, c).min() / a.sum()), "least frequent expert")
    fails_with(ex.check_feature_purity(lambda a, c: per_expert(a, c).max() / c[:, per_expert(a, c).argmax()].sum()),
               "the other direction")
    fails_with(ex.check_feature_purity(lambda a, c: None), "returned None")


def test_purity_stub_is_not_written_yet():
    def stub(active, chosen):
        raise NotImplementedError

    fails_with(ex.check_feature_purity(stub), "not written yet")


# --- mutual information -------------------------------------------------------------------------------------------


def cells(a: torch.Tensor, c: torch.Tensor):
    """(p(x, y), p(x), p(y)) for the four cells."""
    for x in (True, False):
        for y in (True, False):
            yield (((a == x) & (c == y)).double().mean().item(), (a == x).double().mean().item(),
                   (c == y).double().mean().item())


def information(a: torch.Tensor, c: torch.Tensor, log=math.log2) -> float:
    return sum(p * log(p / (px * py)) for p, px, py in cells(a, c) if p > 0)


def information_over_every_cell(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The sum written with tensors over all four cells: an empty cell gives 0 * log2(0) = NaN."""
    p = torch.tensor([list(cell) for cell in cells(a, c)], dtype=torch.float64)  # [4, (p(x, y), p(x), p(y))]
    return (p[:, 0] * (p[:, 0] / (p[:, 1] * p[:, 2])).log2()).sum()


def entropy(a: torch.Tensor) -> float:
    p = a.double().mean().item()
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def test_mutual_information_right_answers_pass():
    passes(ex.check_mutual_information(information))
    # I(A; C) = H(A) + H(C) - H(A, C), another right way
    joint = lambda a, c: -sum(p * math.log2(p) for p, _, _ in cells(a, c) if p > 0)  # noqa: E731
    passes(ex.check_mutual_information(lambda a, c: entropy(a) + entropy(c) - joint(a, c)))


def test_mutual_information_wrong_answers_fail_with_their_reason():
    fails_with(ex.check_mutual_information(lambda a, c: information(a, c, log=math.log)), "natural logarithms")
    fails_with(ex.check_mutual_information(information_over_every_cell), "0 log 0")
    one_cell = lambda a, c: next(p * math.log2(p / (px * py)) for p, px, py in cells(a, c))  # noqa: E731
    fails_with(ex.check_mutual_information(one_cell), "(yes, yes) cell only")
    fails_with(ex.check_mutual_information(lambda a, c: entropy(a)), "H(A), the entropy of the feature alone")
    joint = lambda a, c: -sum(p * math.log2(p) for p, _, _ in cells(a, c) if p > 0)  # noqa: E731
    fails_with(ex.check_mutual_information(joint), "joint entropy")
    fails_with(ex.check_mutual_information(lambda a, c: information(a, c) / entropy(a)), "divided by H(A)")
    fails_with(ex.check_mutual_information(lambda a, c: a.foo()), "raised AttributeError")
