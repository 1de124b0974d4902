"""An attribution graph drawn from its data (``k2lab.circuits.AttributionGraph``): its pruned nodes on a layer x
position grid, its kept edges as lines whose width follows the edge's weight, and on hover each feature's top
contexts and its router read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
import torch

from ..analysis.circuits import EMBEDDING, ERROR, FEATURE, TARGET, AttributionGraph
from .style import DIVERGING, GREY, NEGATIVE, POSITIVE, RED, data, finish, same_length, show_whitespace

WIDTH_BINS = 6  # edge widths are drawn in this many steps (plotly gives one width per trace)
MAX_WIDTH = 7.0  # the heaviest kept edge, in pixels
_MARKERS = {EMBEDDING: ("square", "#555555"), FEATURE: ("circle", POSITIVE), ERROR: ("diamond", GREY),
            TARGET: ("star", RED)}
_KIND_NAMES = {EMBEDDING: "embedding", FEATURE: "feature", ERROR: "error", TARGET: "target"}


def node_positions(graph: AttributionGraph) -> tuple[np.ndarray, np.ndarray]:
    """(x [n], y [n]) of the graph's nodes: x the token position, the kept nodes of one (layer, position) cell spread
    across the cell's width in order of influence (errors last); y the row: 0 for the embeddings, 1 + l for block l,
    L + 2 for the target (NaN for pruned nodes)."""
    n = graph.num_nodes
    x, y = np.full(n, np.nan), np.full(n, np.nan)
    kept = graph.node_mask.numpy()
    layer, position, kind = graph.layer.numpy(), graph.position.numpy(), graph.kind.numpy()
    influence = graph.influence.double().numpy()
    cells: dict[tuple[int, int], list[int]] = {}
    for node in np.flatnonzero(kept):
        cells.setdefault((int(layer[node]), int(position[node])), []).append(int(node))
    top_row = int(layer.max()) + 1  # the target's layer is L: its row is L + 1, above block L - 1's
    for (row, column), members in cells.items():
        members.sort(key=lambda node: (kind[node] == ERROR, -influence[node]))
        offsets = np.linspace(-0.35, 0.35, len(members)) if len(members) > 1 else np.zeros(1)
        for node, offset in zip(members, offsets, strict=True):
            x[node] = column + offset
            y[node] = top_row if kind[node] == TARGET else row + 1
    return x, y


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
                   title: str = "") -> go.Figure:
    """The pruned graph: embeddings (squares) at the bottom, each block's features (circles, area by influence) and
    errors (grey diamonds) in its row, the target (star) on top, over the prompt's token positions. Kept edges are
    lines, blue where the source pushes its target up, red where down, their width proportional to |weight| (in
    ``WIDTH_BINS`` steps up to the heaviest kept edge). Hovering a feature shows its activation, influence, top
    contexts (``top_tokens``: {(layer, feature): [context, ...]}, from ``circuits.top_activations``) and router
    read."""
    if not isinstance(graph, AttributionGraph):
        raise TypeError(f"graph must be a k2lab.circuits.AttributionGraph, got {type(graph).__name__}")
    if graph.node_mask is None or not bool(graph.node_mask.any()):
        raise ValueError("graph has no kept node: prune it (circuits.prune) before drawing it")
    top_tokens = top_tokens or {}
    x, y = node_positions(graph)
    edges = (graph.edge_mask & graph.node_mask[:, None] & graph.node_mask[None, :]).nonzero().numpy()  # [m, 2]
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
            x=x[nodes], y=y[nodes], mode="markers", name=f"{_KIND_NAMES[kind]}s ({len(nodes)})",
            marker=dict(symbol=symbol, color=colour, size=size, line=dict(color="white", width=1)),
            text=[_hover(graph, int(node), top_tokens) for node in nodes],
            hovertemplate="%{text}<extra></extra>"))
    L = int(graph.layer.max())
    rows = ["embeddings", *(f"block {layer}" for layer in range(L)), graph.target.label]
    fig.update_yaxes(tickvals=list(range(L + 2)), ticktext=rows, range=[-0.6, L + 1.6], title_text="layer",
                     zeroline=False, showgrid=False)
    T = len(graph.tokens)
    fig.update_xaxes(tickvals=list(range(T)), ticktext=[f"{t}:{show_whitespace(piece)}" for t, piece in
                                                          enumerate(graph.tokens)],
                     tickangle=-60, range=[-0.6, T - 0.4], title_text="position", showgrid=False, zeroline=False)
    summary = graph.summary()
    title = title or (f"Attribution graph of {graph.target.label} at position {graph.target.position}: "
                      f"{summary['kept_features']} of {summary['features']} features, {summary['kept_edges']:,} "
                      f"of {summary['edges']:,} edges kept")
    return finish(fig, title, height=170 + 80 * (L + 2), width=max(800, 60 + 42 * T), legend=True)


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
