"""12: circuits through the experts. A feature's direct read by a router (``check_router_read``) and a node's
influence on the target of an attribution graph (``check_influence``).

    from k2lab.lab.exercises.circuits import check_influence, check_router_read
    check_router_read(my_router_read)      # ✓ or ✗ with the reason
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...analysis.circuits import node_influence
from .checking import Verdict, call, checker, compare, generator

__all__ = ["check_influence", "check_router_read"]


# --- the router's read of a feature -------------------------------------------------------------------------------


def _router_read_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A router of 5 experts over a width of 8, a norm weight far from 1 (so leaving it out shows), and 6 decoder
    rows of different norms (so normalising them shows)."""
    g = generator(12)
    gate = torch.randn(5, 8, generator=g)  # [E, D]
    norm_weight = 0.3 + 2 * torch.rand(8, generator=g)  # [D]
    decoder = torch.randn(6, 8, generator=g) * torch.linspace(0.5, 2.0, 6)[:, None]  # [F, D]
    return gate, norm_weight, decoder


@checker
def check_router_read(fn: Callable) -> Verdict:
    """``fn(gate [E, D], norm_weight [D], decoder [F, D]) -> [F, E]``: the change of each expert's router logit per
    unit of each feature, per unit of the token's inverse rms, W_gate (g * W_dec[f]), as
    ``k2lab.analysis.features.router_read`` computes it."""
    gate, g, decoder = _router_read_case()
    expected = (decoder * g) @ gate.T  # [F, E]
    out, error = call(fn, gate.clone(), g.clone(), decoder.clone())
    if error is not None:
        return error
    unit = decoder / decoder.norm(dim=-1, keepdim=True)
    rms = decoder.pow(2).mean(-1, keepdim=True).sqrt()
    mistakes = [
        ("you returned experts x features; the read is one row per feature: [F, E]", expected.T),
        ("you left out the norm's weight g: the router reads g * x / rms(x), so a feature's direction is scaled by g "
         "before the router sees it", decoder @ gate.T),
        ("you applied the norm's weight twice", (decoder * g * g) @ gate.T),
        ("you divided by the norm's weight; the norm multiplies by it", (decoder / g) @ gate.T),
        ("you made each decoder row unit length: the read is per unit of the feature's activation, with W_dec as it is",
         (unit * g) @ gate.T),
        ("you normalised the decoder row by its own rms, as the norm would a residual: the read holds the token's rms "
         "fixed (the 1 / rms(x) of the token it is added to comes after)", (decoder / rms * g) @ gate.T),
        ("you took the sigmoid: the read is on the router's logits, before its sigmoid and its top-k",
         torch.sigmoid((decoder * g) @ gate.T)),
    ]
    return compare("router read", out, expected, mistakes, atol=1e-5)


# --- influence ----------------------------------------------------------------------------------------------------


def _influence_case() -> tuple[torch.Tensor, int]:
    """Six nodes: two embeddings (0, 1), three features (2, 3, 4) and the target (5), with positive and negative
    edges and paths of one, two and three steps, so that each mistake gives another answer."""
    A = torch.zeros(6, 6)
    A[2, 0], A[2, 1] = 1.5, -0.5  # feature 2 from both embeddings
    A[3, 0], A[3, 2] = 0.4, 2.0  # feature 3 from embedding 0 and feature 2
    A[4, 1], A[4, 3] = -1.0, 0.25  # feature 4 from embedding 1 and feature 3
    A[5, 2], A[5, 3], A[5, 4] = 0.7, -1.2, 3.0  # the target
    return A, 5


@checker
def check_influence(fn: Callable) -> Verdict:
    """``fn(adjacency [n, n], target: int) -> [n]``: each node's influence on the target, the target's row of
    A_hat + A_hat^2 + ... with A_hat the absolute edges normalised to sum 1 over each node's sources (each row),
    as ``k2lab.circuits.node_influence`` computes it."""
    A, target = _influence_case()
    expected = node_influence(A, target)
    out, error = call(fn, A.clone(), target)
    if error is not None:
        return error

    def series(M: torch.Tensor, start: torch.Tensor, include_start: bool = False) -> torch.Tensor:
        total, step = (start.clone() if include_start else torch.zeros_like(start)), start @ M
        for _ in range(len(M)):
            total, step = total + step, step @ M
        return total

    weight = torch.zeros(len(A))
    weight[target] = 1.0
    by_row = A.abs() / A.abs().sum(1, keepdim=True).clamp(min=1e-30)
    signed = A / A.abs().sum(1, keepdim=True).clamp(min=1e-30)
    by_column = A.abs() / A.abs().sum(0, keepdim=True).clamp(min=1e-30)
    mistakes = [
        ("you kept the edges' signs: influence counts |edge|, so two paths that cancel both still matter",
         series(signed, weight)),
        ("you did not normalise: each node's incoming |edges| must sum to 1 before they are multiplied along paths",
         series(A.abs(), weight)),
        ("you normalised each source's outgoing edges (a column); normalise each node's incoming edges (its row)",
         series(by_column, weight)),
        ("you counted direct edges only: influence sums every path, A_hat + A_hat^2 + ...", weight @ by_row),
        ("you counted the target itself (weight 1): influence starts from the target's edges",
         series(by_row, weight, include_start=True)),
    ]
    return compare("influence", out, expected, mistakes, atol=1e-5)
