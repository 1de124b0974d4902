"""Notebook 12's checkers cannot be fooled: each wrong answer below is written the way a learner would write it and
must fail with its reason, while right answers (written here from the definitions, not from k2lab) pass."""

from __future__ import annotations

import torch
from learner import fails_with, passes

from k2lab.lab.exercises.circuits import check_influence, check_router_read

# --- the router's read ----------------------------------------------------------------------------------------------


def test_router_read_right_answers_pass():
    passes(check_router_read(lambda gate, g, dec: (dec * g) @ gate.T))
    passes(check_router_read(lambda gate, g, dec: torch.einsum("ed,d,fd->fe", gate, g, dec)))
    passes(check_router_read(lambda gate, g, dec: torch.stack([gate @ (g * row) for row in dec])))  # a loop


def test_router_read_wrong_answers_fail_with_their_reason():
    fails_with(check_router_read(lambda gate, g, dec: gate @ (dec * g).T), "experts x features")
    fails_with(check_router_read(lambda gate, g, dec: dec @ gate.T), "left out the norm's weight g")
    fails_with(check_router_read(lambda gate, g, dec: (dec * g**2) @ gate.T), "twice")
    fails_with(check_router_read(lambda gate, g, dec: (dec / g) @ gate.T), "divided by the norm's weight")
    fails_with(check_router_read(lambda gate, g, dec: (torch.nn.functional.normalize(dec, dim=-1) * g) @ gate.T),
               "unit length")
    fails_with(check_router_read(lambda gate, g, dec: torch.nn.functional.rms_norm(dec, (8,), g) @ gate.T),
               "by its own rms")
    fails_with(check_router_read(lambda gate, g, dec: ((dec * g) @ gate.T).sigmoid()), "sigmoid")
    fails_with(check_router_read(lambda gate, g, dec: None), "returned None")


def test_router_read_stub_is_not_written_yet():
    def stub(gate, g, dec):
        raise NotImplementedError

    fails_with(check_router_read(stub), "not written yet")


# --- influence ------------------------------------------------------------------------------------------------------


def influence(A: torch.Tensor, target: int, normalise=lambda M: M.abs() / M.abs().sum(1, keepdim=True).clamp(min=1e-9),
              steps: int | None = None, start: bool = False) -> torch.Tensor:
    """Paths summed one step at a time, from the definition."""
    M = normalise(A)
    weight = torch.zeros(len(A))
    weight[target] = 1
    total, step = (weight.clone() if start else torch.zeros(len(A))), weight
    for _ in range(steps or len(A)):
        step = step @ M
        total = total + step
    return total


def test_influence_right_answers_pass():
    passes(check_influence(influence))

    def closed_form(A, target):  # w ((I - A_hat)^-1 - I)
        M = A.abs() / A.abs().sum(1, keepdim=True).clamp(min=1e-9)
        inverse = torch.linalg.inv(torch.eye(len(A)) - M) - torch.eye(len(A))
        return inverse[target]

    passes(check_influence(closed_form))


def test_influence_wrong_answers_fail_with_their_reason():
    signed = lambda M: M / M.abs().sum(1, keepdim=True).clamp(min=1e-9)  # noqa: E731
    fails_with(check_influence(lambda A, t: influence(A, t, signed)), "signs")
    fails_with(check_influence(lambda A, t: influence(A, t, lambda M: M.abs())), "did not normalise")
    fails_with(check_influence(lambda A, t: influence(A, t, lambda M: M.abs() / M.abs().sum(0, keepdim=True)
                                                      .clamp(min=1e-9))), "outgoing edges")
    fails_with(check_influence(lambda A, t: influence(A, t, steps=1)), "direct edges only")
    fails_with(check_influence(lambda A, t: influence(A, t, start=True)), "counted the target itself")
    fails_with(check_influence(lambda A, t: influence(A, t).tolist()[:-1]), "wrong shape")


def test_influence_stub_is_not_written_yet():
    def stub(A, target):
        raise NotImplementedError

    fails_with(check_influence(stub), "not written yet")
