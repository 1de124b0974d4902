"""An attribution graph drawn from its data (``k2lab.circuits.AttributionGraph``): its pruned nodes on a layer x
position grid, its kept edges as lines whose width follows the edge's weight, and on hover each feature's top
contexts and its router read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
import torch

from ..analysis.circuits import EMBEDDING, ERROR, FEATURE, TARGET, AttributionGraph
from .style import (
    DIVERGING,
    GREY,
    LIGHT_SEQUENTIAL,
    NEGATIVE,
    POSITIVE,
    RED,
    data,
    finish,
    same_length,
    show_whitespace,
    token_labels,
)

WIDTH_BINS = 6  # edge widths are drawn in this many steps (plotly gives one width per trace)
MAX_WIDTH = 7.0  # the heaviest kept edge, in pixels
_MARKERS = {EMBEDDING: ("square", "#555555"), FEATURE: ("circle", POSITIVE), ERROR: ("diamond", GREY),
            TARGET: ("star", RED)}
_KIND_NAMES = {EMBEDDING: "embedding", FEATURE: "feature", ERROR: "error", TARGET: "target"}


PER_ROW = 8  # nodes side by side in one (block, position) cell before another line of them starts


def node_positions(graph: AttributionGraph) -> tuple[np.ndarray, np.ndarray]:
    """(x [n], y [n]) of the graph's nodes: x the token position, the kept nodes of one (layer, position) cell spread
    across the cell's width in order of influence (errors last), ``PER_ROW`` to a line, the lines stacked within
    +-0.25 of the row; y the row: 0 for the embeddings, 1 + l for block l, L + 1 for the target (NaN for pruned
    nodes)."""
    n = graph.num_nodes
    x, y = np.full(n, np.nan), np.full(n, np.nan)
    kept = graph.node_mask.numpy()
    layer, position, kind = graph.layer.numpy(), graph.position.numpy(), graph.kind.numpy()
    influence = graph.influence.double().numpy()
    cells: dict[tuple[int, int], list[int]] = {}
    for node in np.flatnonzero(kept):
        cells.setdefault((int(layer[node]), int(position[node])), []).append(int(node))
    for (row, column), members in cells.items():
        members.sort(key=lambda node: (kind[node] == ERROR, -influence[node]))
        lines = [members[i:i + PER_ROW] for i in range(0, len(members), PER_ROW)]
        heights = np.linspace(-0.25, 0.25, len(lines)) if len(lines) > 1 else np.zeros(1)
        for line, height in zip(lines, heights, strict=True):
            offsets = np.linspace(-0.38, 0.38, len(line)) if len(line) > 1 else np.zeros(1)
            for node, offset in zip(line, offsets, strict=True):
                x[node] = column + offset
                y[node] = row + 1 + height  # embeddings (layer -1) on row 0, block l on l + 1, the target on L + 1
    return x, y


def edge_scores(graph: AttributionGraph) -> torch.Tensor:
    """[n, n] each edge's share of its target node's incoming |edges| times that node's influence on the target (1
    for the target itself): the score Ameisen et al. prune edges by, here to choose the edges worth drawing."""
    A = graph.adjacency.abs()
    share = A / A.sum(1, keepdim=True).clamp(min=1e-30)
    weight = graph.influence.to(A.dtype) + (graph.kind == TARGET).to(A.dtype)
    return share * weight[:, None]


def _router_text(graph: AttributionGraph, node: int, top: int = 2) -> str:
    """The experts a feature node pushes up and down most at each later MoE layer (its router read)."""
    read = graph.router_read[node]  # [L_moe, E]
    lines = []
    for j, layer in enumerate(graph.router_layers):
        row = read[j]
        if bool(row.isnan().all()):
            continue
        up, down = row.topk(top), row.topk(top, largest=False)
        parts = [f"e{int(e)} {float(v):+.2f}" for v, e in zip(up.values, up.indices, strict=True) if v > 0]
        parts += [f"e{int(e)} {float(v):+.2f}" for v, e in zip(down.values, down.indices, strict=True) if v < 0]
        lines.append(f"L{layer} router: {', '.join(parts)}")
    return "<br>".join(lines[:3]) if lines else "no later MoE router"


def _hover(graph: AttributionGraph, node: int, top_tokens: Mapping[tuple[int, int], Sequence[str]]) -> str:
    kind = int(graph.kind[node])
    head = f"<b>{graph.label(node)}</b> ({_KIND_NAMES[kind]})"
    influence = f"influence on the target {float(graph.influence[node]):.3f}"
    if kind == FEATURE:
        key = (int(graph.layer[node]), int(graph.feature[node]))
        examples = [show_whitespace(context) for context in top_tokens.get(key, [])[:3]]
        lines = [head, f"activation {float(graph.activation[node]):.2f}, {influence}",
                 *(f"  {example}" for example in examples), _router_text(graph, node)]
    elif kind == ERROR:
        lines = [head, f"|error| {float(graph.activation[node]):.2f}, {influence}"]
    elif kind == EMBEDDING:
        lines = [head, f"|embedding| {float(graph.activation[node]):.2f}"]
    else:
        lines = [head, f"value {graph.target.value:.3f} at position {graph.target.position}"]
    return "<br>".join(lines)


def circuit_figure(graph: AttributionGraph, top_tokens: Mapping[tuple[int, int], Sequence[str]] | None = None,
                   title: str = "", max_edges: int = 250) -> go.Figure:
    """The pruned graph: embeddings (squares) at the bottom, each block's features (circles, area by influence) and
    errors (grey diamonds) in its row, the target (star) on top, over the prompt's token positions. Of the kept edges,
    the ``max_edges`` of largest score (``edge_scores``) are drawn, blue where the source pushes its target up, red
    where down, their width proportional to |weight| (in ``WIDTH_BINS`` steps up to the heaviest drawn). Hovering a
    feature shows its activation, influence, top contexts (``top_tokens``: {(layer, feature): [context, ...]}, from
    ``circuits.top_activations``) and router read."""
    if not isinstance(graph, AttributionGraph):
        raise TypeError(f"graph must be a k2lab.circuits.AttributionGraph, got {type(graph).__name__}")
    if graph.node_mask is None or not bool(graph.node_mask.any()):
        raise ValueError("graph has no kept node: prune it (circuits.prune) before drawing it")
    top_tokens = top_tokens or {}
    x, y = node_positions(graph)
    if isinstance(max_edges, bool) or not isinstance(max_edges, int) or max_edges < 0:
        raise ValueError(f"max_edges must be a non-negative int, got {max_edges!r}")
    kept_edges = (graph.edge_mask & graph.node_mask[:, None] & graph.node_mask[None, :]).nonzero()  # [m, 2]
    scores = edge_scores(graph)[kept_edges[:, 0], kept_edges[:, 1]]
    edges = kept_edges[scores.argsort(descending=True)[:max_edges]].numpy()  # [drawn, 2] (target, source)
    weights = graph.adjacency[edges[:, 0], edges[:, 1]].double().numpy() if len(edges) else np.zeros(0)
    fig = go.Figure()
    heaviest = float(np.abs(weights).max()) if len(weights) else 1.0
    bins = np.minimum((np.abs(weights) / heaviest * WIDTH_BINS).astype(int), WIDTH_BINS - 1)  # [m]
    for sign, colour in ((1, POSITIVE), (-1, NEGATIVE)):
        for b in range(WIDTH_BINS):
            chosen = (np.sign(weights) == sign) & (bins == b)
            if not chosen.any():
                continue
            target, source = edges[chosen, 0], edges[chosen, 1]
            xs = np.stack([x[source], x[target], np.full(len(source), np.nan)], 1).ravel()
            ys = np.stack([y[source], y[target], np.full(len(source), np.nan)], 1).ravel()
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False,
                                     line=dict(color=colour, width=MAX_WIDTH * (b + 1) / WIDTH_BINS),
                                     opacity=0.25 + 0.5 * (b + 1) / WIDTH_BINS))
    influence = graph.influence.double().numpy()
    kept_features = graph.node_mask.numpy() & (graph.kind.numpy() == FEATURE)
    largest = float(influence[kept_features].max()) if kept_features.any() else 1.0
    for kind in (EMBEDDING, ERROR, FEATURE, TARGET):
        nodes = np.flatnonzero(graph.node_mask.numpy() & (graph.kind.numpy() == kind))
        if not len(nodes):
            continue
        symbol, colour = _MARKERS[kind]
        size = 9 + 17 * np.sqrt(np.clip(influence[nodes] / largest, 0, 1)) if kind == FEATURE else \
            np.full(len(nodes), 18 if kind == TARGET else 10)
        fig.add_trace(go.Scatter(
            x=x[nodes], y=y[nodes], mode="markers",
            name=_KIND_NAMES[kind] if kind == TARGET else f"{_KIND_NAMES[kind]}s ({len(nodes)})",
            marker=dict(symbol=symbol, color=colour, size=size, line=dict(color="white", width=1)),
            text=[_hover(graph, int(node), top_tokens) for node in nodes],
            hovertemplate="%{text}<extra></extra>"))
    L = int(graph.layer.max())
    rows = ["embeddings", *(f"block {layer}" for layer in range(L)), "target"]
    fig.update_yaxes(tickvals=list(range(L + 2)), ticktext=rows, range=[-0.5, L + 1.5], title_text="",
                     zeroline=False, showgrid=False)
    T = len(graph.tokens)
    fig.update_xaxes(tickvals=list(range(T)), ticktext=[f"{t}:{show_whitespace(piece)}" for t, piece in
                                                          enumerate(graph.tokens)],
                     tickangle=-60, range=[-0.6, T - 0.4], title_text="position", showgrid=False, zeroline=False)
    summary = graph.summary()
    title = title or (f"Attribution graph of {graph.target.label} at position {graph.target.position}<br>"
                      f"<sup>{summary['kept_features']:,} of {summary['features']:,} features kept; the "
                      f"{len(edges):,} strongest of {summary['kept_edges']:,} kept edges drawn (of "
                      f"{summary['edges']:,})</sup>")
    fig = finish(fig, title, height=200 + 90 * (L + 2), width=max(900, 160 + 70 * T), legend=True)
    fig.update_layout(margin=dict(t=110), legend=dict(y=1.02))
    return fig


def router_read_figure(read: torch.Tensor, labels: Sequence[str], experts: Sequence[int] | None = None,
                       title: str = "", x_title: str = "expert") -> go.Figure:
    """A heatmap of router reads, one row per feature (``read`` [rows, E]: its direct effect on a router's logits),
    on a diverging scale centred on 0 and fitted to the largest |read|."""
    z = data(read, "read", 2)
    same_length(z, labels, "read [rows, E]", "labels")
    columns = list(range(z.shape[1])) if experts is None else list(experts)
    same_length(z, columns, "read [rows, E]", "experts", axis=1)
    bound = float(np.nanmax(np.abs(z))) or 1.0
    fig = go.Figure(go.Heatmap(z=z, x=columns, y=list(labels), colorscale=DIVERGING, zmid=0, zmin=-bound,
                               zmax=bound, xgap=1, ygap=1, colorbar=dict(title="router<br>logit"),
                               hovertemplate="%{y}<br>expert %{x}: %{z:+.3f}<extra></extra>"))
    fig.update_xaxes(title_text=x_title, dtick=1 if len(columns) <= 40 else None, type="category")
    fig.update_yaxes(autorange="reversed", type="category")
    return finish(fig, title, height=150 + 28 * len(labels), legend=False)


def prediction_figure(predicted: Mapping[str, torch.Tensor], measured: torch.Tensor, labels: Sequence[str],
                      title: str = "", x_title: str = "predicted change of the target",
                      y_title: str = "measured change") -> go.Figure:
    """Predictions against measurements, one point per intervention (``labels``), one series per kind of prediction
    (``predicted``: {name: [N]}), with the diagonal where they would agree; both axes share one range, fitted to all
    the points."""
    if not hasattr(predicted, "items") or not predicted:
        raise ValueError("predicted must be a non-empty mapping {name: [N] predictions}")
    y = data(measured, "measured", 1)
    same_length(y, labels, "measured", "labels")
    fig = go.Figure()
    extent = float(np.abs(y).max())
    for (name, values), colour in zip(predicted.items(), (POSITIVE, "#ff7f0e", GREY), strict=False):
        x = data(values, f"predicted[{name!r}]", 1)
        same_length(x, labels, f"predicted[{name!r}]", "labels")
        extent = max(extent, float(np.abs(x).max()))
        fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name=name, text=list(labels),
                                 marker=dict(color=colour, size=9, line=dict(color="white", width=1)),
                                 hovertemplate=f"%{{text}}<br>{name}: %{{x:+.3f}}, measured %{{y:+.3f}}"
                                               "<extra></extra>"))
    bound = 1.08 * (extent or 1.0)
    fig.add_trace(go.Scatter(x=[-bound, bound], y=[-bound, bound], mode="lines", name="agreement",
                             line=dict(color="#444", dash="dash", width=1), hoverinfo="skip"))
    fig.update_xaxes(title_text=x_title, range=[-bound, bound], zeroline=True, zerolinecolor="#bbb")
    fig.update_yaxes(title_text=y_title, range=[-bound, bound], zeroline=True, zerolinecolor="#bbb")
    return finish(fig, title, height=560, width=640, legend=True)


def influence_heatmap(graph: AttributionGraph, title: str = "") -> go.Figure:
    """The kept nodes' influence on the target summed per (row, position): the embeddings and each block (its
    features and its error), on a light sequential scale from 0 to the largest cell."""
    if not isinstance(graph, AttributionGraph):
        raise TypeError(f"graph must be a k2lab.circuits.AttributionGraph, got {type(graph).__name__}")
    L, T = int(graph.layer.max()), len(graph.tokens)
    z = np.zeros((L + 1, T))  # [embeddings + blocks, T]
    kept = (graph.node_mask & (graph.kind != TARGET)).numpy()
    np.add.at(z, (graph.layer.numpy()[kept] + 1, graph.position.numpy()[kept]), graph.influence.double().numpy()[kept])
    rows = ["embeddings", *(f"block {layer}" for layer in range(L))]
    fig = go.Figure(go.Heatmap(z=z, x=token_labels(graph.tokens), y=rows, colorscale=LIGHT_SEQUENTIAL, zmin=0,
                               zmax=max(float(z.max()), 1e-9), xgap=1, ygap=1, colorbar=dict(title="influence"),
                               hovertemplate="%{y}, %{x}<br>influence %{z:.3f}<extra></extra>"))
    fig.update_xaxes(title_text="position", tickangle=-45)
    fig.update_yaxes(autorange="reversed")
    title = title or f"Influence on {graph.target.label}, kept nodes summed by block and position"
    return finish(fig, title, height=150 + 34 * (L + 1), legend=False)

