"""11: features against experts. A feature's purity against the routing (``check_feature_purity``) and the mutual
information of two yes/no variables in bits (``check_mutual_information``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ...analysis.features import information, purity
from .checking import Verdict, as_tensor, call, checker, compare, generator, named

# --- purity -----------------------------------------------------------------------------------------------------


def _purity_case() -> tuple[torch.Tensor, torch.Tensor]:
    """40 tokens choosing 2 of 6 experts; the feature is active on 12 of them, 9 of which chose expert 4, so every
    mistake below gives another number (the purity is 0.75)."""
    g = generator(41)
    active = torch.zeros(40, dtype=torch.bool)
    active[torch.randperm(40, generator=g)[:12]] = True
    chosen = torch.zeros(40, 6, dtype=torch.bool)
    for t in range(40):
        first = 4 if active[t] and int(active[:t].sum()) < 9 else int(torch.randint(0, 4, (1,), generator=g))
        second = 5 if first != 5 and t % 3 == 0 else (first + 1) % 4
        chosen[t, [first, second]] = True
    return active, chosen


@checker
def check_feature_purity(fn: Callable) -> Verdict:
    """``fn(active [N] bool, chosen [N, E] bool) -> float``: the share of the tokens the feature is active on that
    chose its most frequent expert, as ``k2lab.analysis.features.purity`` computes it."""
    active, chosen = _purity_case()
    expected = purity(active[:, None], chosen, num_shuffles=1).purity[0].double()
    out, error = call(fn, active.clone(), chosen.clone(), own={purity: "analysis.features.purity"})
    if error is not None:
        return error
    counts = chosen[active].double().sum(0)  # [E] the feature's tokens per expert
    n, k = active.sum().double(), chosen[0].sum().double()
    top = int(counts.argmax())
    mistakes = [
        ("you divided by every token; purity divides by the tokens the feature is active on", counts.max() / 40),
        (f"you divided by the k = {int(k)} slots of each token: a token counts once for the expert it chose, so "
         f"purity is the top expert's tokens over the feature's tokens", counts.max() / (n * k)),
        ("you counted the tokens where the feature is NOT active", chosen[~active].double().sum(0).max() / (40 - n)),
        ("you took the least frequent expert; purity asks about the most frequent one", counts.min() / n),
        ("that is the share of the expert's tokens on which the feature is active (the other direction): divide by "
         "the feature's tokens", counts.max() / chosen[:, top].double().sum()),
    ]
    verdict = compare("purity", out, expected, mistakes, atol=1e-6)
    if verdict.ok or verdict.mistake is not None:
        return verdict
    pure = chosen.clone()
    pure[active] = False
    pure[active, 2] = True  # every token the feature is active on chose expert 2 (and only it)
    again, error = call(fn, active.clone(), pure, keep=False)
    value = as_tensor(again)
    if error is None and value is not None and value.numel() == 1 and abs(float(value.reshape(())) - 1) > 1e-6:
        return named(f"when every token the feature is active on chose the same expert, the purity is 1; yours "
                     f"gives {float(value.reshape(())):.4g}", "purity")
    return verdict


# --- mutual information -------------------------------------------------------------------------------------------


def _cell_subsets(a: torch.Tensor, c: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The sum over some of the four cells only, for each proper subset of them: a learner who left cells out."""
    import itertools

    names = {(True, True): "(yes, yes)", (True, False): "(yes, no)", (False, True): "(no, yes)",
             (False, False): "(no, no)"}
    terms = {}
    for x, y in names:
        p = ((a == x) & (c == y)).double().mean()
        px, py = (a == x).double().mean(), (c == y).double().mean()
        terms[(x, y)] = p * (p / (px * py)).log2() if p > 0 else torch.tensor(0.0, dtype=torch.float64)
    subsets = []
    for size in (1, 2, 3):
        for cells in itertools.combinations(names, size):
            left_out = [names[cell] for cell in names if cell not in cells]
            subsets.append((f"you summed {size} of the four cells; the {' and '.join(left_out)} "
                            f"cell{'s' if len(left_out) > 1 else ''} count too: I(A; C) sums p(a, c) log2(p(a, c) / "
                            f"(p(a) p(c))) over all four", sum(terms[cell] for cell in cells)))
    return subsets


@checker
def check_mutual_information(fn: Callable) -> Verdict:
    """``fn(a [N] bool, c [N] bool) -> float``: I(A; C) in bits, the sum over the four cells of
    p(a, c) log2(p(a, c) / (p(a) p(c))), a cell with no tokens adding 0; against
    ``k2lab.analysis.features.information``. The second case has an empty cell."""
    g = generator(42)
    a = torch.rand(60, generator=g) < 0.3
    c = a ^ (torch.rand(60, generator=g) < 0.2)  # mostly agrees with a
    cases = [(a, c), (a, a | (torch.rand(60, generator=g) < 0.5))]  # the second: a implies c, no (a, not c) token
    for a, c in cases:
        single = information(a[:, None], c[None, :, None], torch.zeros(60, dtype=torch.long), min_active=1,
                             num_boot=1, num_shuffles=1, layers=[0])
        expected = single.bits[0, 0].double()
        out, error = call(fn, a.clone(), c.clone(), own={information: "analysis.features.information"})
        if error is not None:
            return error
        if isinstance(out, float | torch.Tensor) and torch.as_tensor(out).numel() == 1 and math.isnan(float(out)):
            return named("NaN where a cell holds no token: 0 log 0 counts as 0 (skip the empty cells)",
                         "mutual information")
        pa, pc = a.double().mean(), c.double().mean()
        p11 = (a & c).double().mean()
        entropy_a = -(pa * pa.log2() + (1 - pa) * (1 - pa).log2())
        cells = [((a == x) & (c == y)).double().mean() for x in (True, False) for y in (True, False)]
        joint = -sum(p * p.log2() for p in cells if p > 0)
        mistakes = [
            ("you used natural logarithms (nats); the figure is in bits (log2)", expected * math.log(2)),
            ("you summed the (yes, yes) cell only; the three other cells carry information too",
             p11 * (p11 / (pa * pc)).log2()),
            ("that is H(A), the entropy of the feature alone; I(A; C) = H(A) - H(A | C)", entropy_a),
            ("that is the joint entropy H(A, C); I(A; C) = H(A) + H(C) - H(A, C)", joint),
            ("you divided by H(A): that is the share the notebook plots, not the information itself",
             expected / entropy_a),
            ("you used log10; the figure is in bits (log2)", expected * math.log10(2)),
            *_cell_subsets(a, c),
        ]
        verdict = compare("mutual information", out, expected, mistakes, atol=1e-6)
        if not verdict.ok and verdict.mistake is None and as_tensor(out) is not None and as_tensor(out).numel() == 1:
            value = float(as_tensor(out).reshape(()))
            entropy_c = -(pc * pc.log2() + (1 - pc) * (1 - pc).log2())
            if value < -1e-9:
                return named(f"yours is negative ({value:.4g} bits): mutual information never is (0 when A and C are "
                             f"independent); is a ratio inside the log upside down?", "mutual information")
            if value > min(entropy_a, entropy_c) + 1e-9:
                return named(f"yours ({value:.4g} bits) is more than H(A) or H(C) ({min(entropy_a, entropy_c):.4g}): "
                             f"what A tells about C cannot exceed what either holds", "mutual information")
        if not verdict.ok:
            return verdict
    return Verdict(True, "mutual information: matches k2lab on both cases, the one with an empty cell included")
