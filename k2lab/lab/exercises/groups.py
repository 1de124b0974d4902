"""04a: group-limited routing (``check_group_router``), DeepSeek-V3's ``n_group`` / ``topk_group`` rule, against
``k2lab.routing.select_experts``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...analysis.routing import allowed_experts, select_experts
from .checking import Verdict, call, checker, compare, generator


def _chosen(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[N, E] 0/1: which experts each row chose, whatever the order of its k slots."""
    return torch.zeros(idx.shape[0], num_experts, dtype=torch.float64).scatter_(1, idx.long(), 1.0)


def _variant(choice: torch.Tensor, top_k: int, n_group: int, topk_group: int, *, group_score: str = "top2",
             strided: bool = False) -> torch.Tensor:
    """The group-limited top-k with a switch for each usual mistake (the defaults are right)."""
    N, E = choice.shape
    size = E // n_group
    order = torch.arange(E).view(size, n_group).T.flatten() if strided else torch.arange(E)  # group g's experts
    grouped = choice[:, order].view(N, n_group, size)  # [N, G, E/G]
    score = {"top2": grouped.topk(2, dim=-1).values.sum(-1), "max": grouped.amax(-1),
             "sum": grouped.sum(-1)}[group_score]  # [N, G]
    keep = torch.zeros(N, n_group, dtype=torch.bool).scatter_(1, score.topk(topk_group, dim=-1).indices, True)
    allowed = torch.zeros(N, E, dtype=torch.bool)
    allowed[:, order] = keep[:, :, None].expand(N, n_group, size).reshape(N, E)
    return choice.masked_fill(~allowed, -torch.inf).topk(top_k, dim=-1).indices


def _case(seed: int, tokens: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Affinities s in (0, 1) whose groups' best expert, best two and total rank the groups differently, and a
    correction bias large enough to change which groups win (s + bias stays positive)."""
    g = generator(seed)
    s = torch.rand(tokens, experts, generator=g).pow(3) * 0.8 + 0.1
    bias = (torch.rand(experts, generator=g) - 0.5) * 0.16
    return s, bias


@checker
def check_group_router(fn: Callable) -> Verdict:
    """``fn(s [N, E], bias [E], top_k, n_group, topk_group) -> idx [N, k]``: DeepSeek-V3's group-limited choice.
    The E experts form ``n_group`` groups of E / n_group consecutive experts; a group's score is the sum of its two
    best choice scores s + bias; each token keeps its ``topk_group`` best groups and chooses its top-k experts among
    theirs only. Any order of the k slots. Checked with DeepSeek-V3's own setting (n_group = 8, topk_group = 4, top-8
    of 64 here) and a smaller one, against ``k2lab.routing.select_experts``."""
    for what, (N, E, k, G, keep) in (("n_group=8, topk_group=4, top-8 of 64", (24, 64, 8, 8, 4)),
                                     ("n_group=4, topk_group=2, top-3 of 16", (24, 16, 3, 4, 2))):
        s, bias = _case(61 + E, N, E)
        choice = s + bias
        expected = select_experts(choice, k, G, keep)
        out, error = call(fn, s.clone(), bias.clone(), k, G, keep)
        if error is not None:
            return error
        label = f"group-limited routing ({what})"
        if not isinstance(out, torch.Tensor) or out.shape != expected.shape:
            shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            return Verdict(False, f"{label}: return the chosen experts idx [N, k] = {list(expected.shape)}, "
                                  f"got {shape}")
        if out.dtype.is_floating_point:
            return Verdict(False, f"{label}: return expert indices (integers), not scores")
        mistakes = [
            ("a group's score is the sum of its TWO best choice scores, not its best one",
             _variant(choice, k, G, keep, group_score="max")),
            ("a group's score is the sum of its two best choice scores, not of all its experts",
             _variant(choice, k, G, keep, group_score="sum")),
            ("the groups are scored with the bias too: a group's score sums two of its choice scores s + bias",
             choice.masked_fill(~_allowed(s, G, keep), -torch.inf).topk(k, dim=-1).indices),
            ("you left out the correction bias: both the groups and the experts are chosen by s + bias",
             _variant(s, k, G, keep)),
            ("a group is E / n_group CONSECUTIVE experts (view(N, n_group, -1)), not every n_group-th one",
             _variant(choice, k, G, keep, strided=True)),
            ("you ignored the groups: the top-k is taken among the experts of the topk_group best groups only",
             choice.topk(k, dim=-1).indices),
            ("you chose the experts by s alone: within the kept groups the top-k is of s + bias, as in K2's router",
             select_experts(s.masked_fill(~_allowed(choice, G, keep), -torch.inf), k)),
        ]
        verdict = compare(label, _chosen(out, E), _chosen(expected, E),
                          [(m, _chosen(c, E)) for m, c in mistakes], atol=0, rtol=0)
        if not verdict.ok:
            if not verdict.mistake:
                rows = (_chosen(out, E) != _chosen(expected, E)).any(-1).nonzero()[:, 0].tolist()
                return Verdict(False, f"{label}: your experts differ from k2lab's for {len(rows)} of {N} tokens "
                                      f"(token {rows[0]} first), and match no common mistake we know")
            return verdict
    return Verdict(True, "group-limited routing: the same experts as k2lab for DeepSeek-V3's 8 groups (4 kept) and "
                         "for 4 groups (2 kept)")


def _allowed(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """[N, E] the experts of each token's ``topk_group`` best groups."""
    return allowed_experts(choice, n_group, topk_group)
