"""docs/research.md's worked example (what decides `]` against `)`) runs as written, and the figures the guide quotes
below it are the ones it prints. The numbers come from running K2-nano; the guide's text is checked against them, so
an edit of either that lets them drift apart fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "research.md"


@pytest.fixture(scope="module")
def example() -> tuple[dict, str]:
    """The namespace the example leaves, and the prose that follows it."""
    text = GUIDE.read_text()
    marker = text.index("<!-- worked-example -->")
    block = re.search(r"```python\n(.*?)\n```", text[marker:], re.S)
    assert block is not None, "the worked example's fenced block follows its marker"
    namespace: dict = {}
    exec(compile(block.group(1), f"{GUIDE}:worked-example", "exec"), namespace)  # noqa: S102 - the guide's own code
    return namespace, text[marker + block.end():]


def quoted(prose: str, before: str) -> float:
    """The first number that follows ``before`` in the guide's prose."""
    found = re.search(re.escape(before) + r"[^\d-]*(-?\d+(?:\.\d+)?)", prose)
    assert found is not None, f"the guide quotes a figure after {before!r}"
    return float(found.group(1))


def test_the_logit_differences_quoted_are_the_ones_computed(example):
    ns, prose = example
    assert ns["d_clean"] == pytest.approx(quoted(prose, "The logit difference is"), abs=0.006)
    assert ns["d_corrupt"] == pytest.approx(quoted(prose, "clean and"), abs=0.006)
    assert ns["d_clean"] > 0 > ns["d_corrupt"], "clean closes with ], corrupt with )"


def test_the_information_sits_at_the_bracket_and_moves_between_layers_2_and_3(example):
    ns, prose = example
    resid = ns["resid"]  # [L, T] normalised: 1 = the clean answer restored
    assert resid[0].argmax() == 2 and resid[0, 2] == pytest.approx(1.0, abs=1e-4)
    assert resid[0].abs().sort().values[-2] < 0.01, "at layer 0 no other position carries anything"
    assert resid[:3, 2].min() > 0.98, "the bracket's position keeps the effect through layer 2"
    assert resid[3, 2] == pytest.approx(quoted(prose, "it falls to"), abs=0.006)
    assert resid[3, -1] > 0.3 > resid[2, -1], "the last position takes it up at layer 3"


def test_the_heads_named_are_the_strongest(example):
    ns, prose = example
    heads = ns["heads"]  # [L, H]
    assert heads[2, 2] == pytest.approx(quoted(prose, "layer 2 head 2 ("), abs=0.006)
    assert heads[5, 1] == pytest.approx(quoted(prose, "layer 5 head 1 ("), abs=0.006)
    others = heads.clone()
    others[2, 2] = others[5, 1] = 0
    assert others.abs().max() < 0.12


def test_the_experts_and_their_choice(example):
    ns, prose = example
    assert ns["routed"][1, 2] == pytest.approx(quoted(prose, "routed experts at the bracket restore"), abs=0.006)
    assert ns["choice"][1, 2] == pytest.approx(quoted(prose, "copying only their choice restores"), abs=0.006)
    assert torch.isnan(ns["routed"][0]).all(), "layer 0 is dense: its row is NaN"


def test_attribution_agrees_with_patching_and_the_expert_it_ranks_first_matters(example):
    ns, prose = example
    assert ns["agreement"] == pytest.approx(quoted(prose, "real patches of step 1 at"), abs=0.006)
    assert ns["expert"] == int(quoted(prose, "at the bracket ranks"))
    assert ns["d_ablated"] == pytest.approx(quoted(prose, "lowers the clean logit difference from 3.17 to"), abs=0.006)
    assert ns["d_ablated"] < ns["d_clean"] - 1.0, "mean-ablating the top-ranked expert costs over a logit"
