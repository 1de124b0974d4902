"""scripts/site/diagrams.py: every Mermaid diagram of the notebooks has its committed SVG, drawn from its current
source, which the site shows in its place; a diagram edited since its SVG was drawn is found stale."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "site"))
import diagrams  # noqa: E402


def test_every_notebook_diagram_has_its_svg_drawn_from_its_current_source():
    found = diagrams.all_diagrams()
    assert {"00_tour-1.svg", "04b_block-1.svg", "04b_block-2.svg"} <= {d.name for d in found}
    stale = [f"{d.name}: {d.state()}" for d in found if d.state() != "ok"]
    assert not stale, f"redraw with python scripts/site/diagrams.py: {stale}"
    for d in found:
        svg = d.path.read_text()
        assert "<foreignObject" not in svg and "@font-face" not in svg  # plain SVG text, no font to fetch or embed
        assert 'width="100%"' not in svg.split(">", 2)[1]  # a size of its own: an <img> shows it at that size


def test_an_edited_or_missing_diagram_is_found(tmp_path, monkeypatch):
    nb = {"cells": [{"cell_type": "markdown", "source": ["# A\n", "```mermaid\n", "flowchart LR\n", "  a --> b\n",
                                                         "```\n", "text\n", "~~~ Mermaid\n", "flowchart TB\n",
                                                         "  c --> d\n", "~~~\n"]},
                    {"cell_type": "code", "source": "# ```mermaid\n", "outputs": []}]}
    first, second = diagrams.notebook_diagrams("99_toy", nb)
    assert (first.name, first.source, second.name, second.source) == (
        "99_toy-1.svg", "flowchart LR\n  a --> b\n", "99_toy-2.svg", "flowchart TB\n  c --> d\n")
    monkeypatch.setattr(diagrams, "OUT", tmp_path)
    assert first.state() == "missing"
    first.path.write_text(f"<!-- k2lab diagram: source sha256 {first.digest}; ... -->\n<svg></svg>\n")
    assert first.state() == "ok"
    edited = diagrams.Diagram("99_toy", 1, "flowchart LR\n  a --> c\n")
    assert edited.state() == "stale"


def test_sized_gives_the_svg_its_own_width_and_height():
    svg = ('<svg id="my-svg" width="100%" xmlns="http://www.w3.org/2000/svg" class="flowchart" '
           'style="max-width: 346px; background-color: white;" viewBox="0 0 346 1807.6875" role="graphics-document">')
    assert diagrams.sized(svg).startswith('<svg id="my-svg" width="346.0" height="1807.7" xmlns=')
    assert "max-width" not in diagrams.sized(svg) and "100%" not in diagrams.sized(svg)
