"""The attribution graph's figure (k2lab/viz/circuits.py), drawn from a graph's data and read back without a browser:
nodes in their layer's row over their position, one segment per kept edge, coloured by sign, wider for heavier edges,
and the hover holding the feature's top contexts and router read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import MICRO, random_model, token_ids

from k2lab import viz
from k2lab.analysis import circuits
from k2lab.analysis.circuits import EMBEDDING, FEATURE, TARGET
from k2lab.analysis.dictionary import Transcoder
from k2lab.viz.style import NEGATIVE, POSITIVE


@pytest.fixture(scope="module")
def graph():
    model = random_model(MICRO, seed=0)
    D, g = MICRO.hidden_size, torch.Generator().manual_seed(1)
    transcoders = []
    for _ in range(2):
        tc = Transcoder(D, D, 24, 3)
        with torch.no_grad():
            for p in tc.parameters():
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            tc.b_enc += 1.0
        transcoders.append(tc)
    with torch.no_grad():
        return circuits.attribute(model, transcoders, token_ids(MICRO, batch=1, length=6)[0], target=(3, 4))


def _segments(trace) -> np.ndarray:
    """[m, 2, 2] the (x, y) ends of a lines trace's segments (each closed by a NaN)."""
    xs, ys = np.asarray(trace.x, dtype=float), np.asarray(trace.y, dtype=float)
    return np.stack([xs, ys], -1).reshape(-1, 3, 2)[:, :2]


def test_nodes_sit_in_their_layer_row_over_their_position(graph):
    x, y = viz.circuits.node_positions(graph)
    kept = graph.node_mask.numpy()
    assert np.isnan(x[~kept]).all() and np.isnan(y[~kept]).all()
    rows = np.where(graph.kind.numpy() == EMBEDDING, 0, graph.layer.numpy() + 1)
    assert (np.abs(y[kept] - rows[kept]) <= 0.25 + 1e-9).all()  # lines of nodes stacked within their row
    assert (np.abs(x[kept] - graph.position.numpy()[kept]) <= 0.38 + 1e-9).all()
    assert len({(a, b) for a, b in zip(x[kept], y[kept], strict=True)}) == int(kept.sum())  # no two on one spot
    assert y[graph.kind.numpy() == TARGET][0] == 3  # MICRO: 2 blocks, the target above them


def test_every_kept_edge_is_one_segment_coloured_by_sign_and_wider_when_heavier(graph):
    kept = (graph.edge_mask & graph.node_mask[:, None] & graph.node_mask[None, :]).nonzero()
    fig = viz.circuit_figure(graph, title="test", max_edges=len(kept))
    lines = [t for t in fig.data if t.mode == "lines"]
    assert sum(len(_segments(t)) for t in lines) == len(kept) > 10
    x, y = viz.circuits.node_positions(graph)
    weights = {(float(x[s]), float(y[s]), float(x[t]), float(y[t])): float(graph.adjacency[t, s]) for t, s in kept}
    widths = {}
    for trace in lines:
        for (x0, y0), (x1, y1) in _segments(trace):
            w = weights[(x0, y0, x1, y1)]
            assert trace.line.color == (POSITIVE if w > 0 else NEGATIVE)
            widths.setdefault(trace.line.width, []).append(abs(w))
    ordered = sorted(widths)
    for narrow, wide in zip(ordered, ordered[1:], strict=False):
        assert max(widths[narrow]) <= min(widths[wide]) + 1e-12  # a wider line never carries a lighter edge
    heaviest = max(abs(w) for w in weights.values())
    assert heaviest in widths[ordered[-1]] and ordered[-1] == viz.circuits.MAX_WIDTH
    assert fig.layout.title.text == "test"


def test_only_the_strongest_edges_are_drawn(graph):
    kept = (graph.edge_mask & graph.node_mask[:, None] & graph.node_mask[None, :]).nonzero()
    scores = viz.circuits.edge_scores(graph)[kept[:, 0], kept[:, 1]]
    fig = viz.circuit_figure(graph, max_edges=5)
    x, y = viz.circuits.node_positions(graph)
    drawn = {tuple(end) for t in fig.data if t.mode == "lines" for end in _segments(t).reshape(-1, 4).tolist()}
    strongest = kept[scores.argsort(descending=True)[:5]].tolist()
    assert drawn == {(x[s], y[s], x[t], y[t]) for t, s in strongest}
    assert "the 5 strongest of" in fig.layout.title.text


def test_the_hover_shows_top_contexts_and_the_router_read(graph):
    feature0 = int(((graph.kind == FEATURE) & (graph.layer == 0) & graph.node_mask).nonzero()[0])
    key = (0, int(graph.feature[feature0]))
    fig = viz.circuit_figure(graph, top_tokens={key: ["def f(x): [return] (2.0)"]})
    (features,) = [t for t in fig.data if t.mode == "markers" and t.name.startswith("features")]
    text = next(t for t in features.text if t.startswith(f"<b>{graph.label(feature0)}</b>"))
    assert "def·f(x):·[return]·(2.0)" in text
    read = graph.router_read[feature0, 0]  # block 1's router
    best = int(read.argmax())
    assert f"L1 router: e{best} {float(read[best]):+.2f}" in text
    assert graph.target.label in fig.layout.title.text  # the default title names the target


def test_router_read_figure_fits_a_symmetric_range():
    fig = viz.router_read_figure(torch.tensor([[0.5, -2.0], [1.0, 0.0]]), ["a", "b"])
    assert fig.data[0].zmin == -2.0 and fig.data[0].zmax == 2.0 and fig.data[0].zmid == 0


def test_figures_refuse_what_they_cannot_draw(graph):
    with pytest.raises(TypeError, match="AttributionGraph"):
        viz.circuit_figure({"nodes": []})
    empty = circuits.AttributionGraph(**{**graph.__dict__, "node_mask": torch.zeros_like(graph.node_mask)})
    with pytest.raises(ValueError, match="no kept node"):
        viz.circuit_figure(empty)
    with pytest.raises(ValueError, match="max_edges must be a non-negative int"):
        viz.circuit_figure(graph, max_edges=-1)
    with pytest.raises(ValueError, match="labels has 1 entries"):
        viz.router_read_figure(torch.zeros(2, 3), ["a"])


def test_prediction_figure_shares_one_fitted_range_and_draws_the_diagonal():
    fig = viz.prediction_figure({"direct": torch.tensor([0.5, -1.0]), "total": torch.tensor([2.0, -3.0])},
                                torch.tensor([0.4, -0.8]), ["a", "b"], title="t")
    direct, total, diagonal = fig.data
    assert list(direct.x) == [0.5, -1.0] and list(total.y) == pytest.approx([0.4, -0.8])
    assert fig.layout.xaxis.range == fig.layout.yaxis.range and fig.layout.xaxis.range[1] >= 3.0
    assert list(diagonal.x) == list(diagonal.y)
    with pytest.raises(ValueError, match="labels has 1 entries"):
        viz.prediction_figure({"direct": torch.zeros(2)}, torch.zeros(2), ["a"])
