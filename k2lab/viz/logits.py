"""From the residual stream to the next token: the logit lens and direct logit attribution; also the heatmap of an
intervention's effect over layers and positions."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import plotly.graph_objects as go
import torch

from .style import (
    DIVERGING,
    LIGHT_SEQUENTIAL,
    NEGATIVE,
    POSITIVE,
    data,
    finish,
    same_length,
    show_whitespace,
    token_labels,
)


def logit_lens_figure(probs: torch.Tensor, top_tokens: Sequence[Sequence[str]], row_labels: Sequence[str],
                      tokens: Sequence[str], start: int = 0, title: str = "") -> go.Figure:
    """The logit lens as a grid: rows are layers (read through the final norm and head), columns positions (the
    first at ``start``); each cell names the layer's top next-token guess, shaded by its probability.
    ``probs``: [L, T]; ``top_tokens``: L lists of T strings."""
    p = data(probs, "probs", 2)
    same_length(p, row_labels, "probs [L, T]", "row_labels")
    same_length(p, tokens, "probs [L, T]", "tokens", axis=1)
    same_length(top_tokens, row_labels, "top_tokens", "row_labels")
    text = [[show_whitespace(t) for t in row] for row in top_tokens]
    fig = go.Figure(go.Heatmap(z=p, x=token_labels(tokens, start), y=list(row_labels), text=text,
                               texttemplate="%{text}", textfont=dict(size=11 if p.shape[1] <= 16 else 9, color="black"),
                               colorscale=LIGHT_SEQUENTIAL, zmin=0, zmax=1, xgap=1, ygap=1,
                               colorbar=dict(title="p(top)"),
                               hovertemplate="%{y}, after %{x}<br>top: %{text} (p=%{z:.2f})<extra></extra>"))
    fig.update_xaxes(title_text="position (the token read so far)", tickangle=-45, dtick=1)
    fig.update_yaxes(autorange="reversed")
    return finish(fig, title or "Logit lens: each layer's guess for the next token",
                  height=150 + 42 * len(row_labels), legend=False)


def cache_logit_lens_figure(cache, piece: Callable[[int], str], tokens: Sequence[str],
                            shown: slice = slice(-16, None), title: str = "") -> go.Figure:
    """``logit_lens_figure`` straight from an ActivationCache of one prompt: every layer's top next-token guess
    at the ``shown`` positions (the last 16 by default, to fit the page). ``piece(id)`` names a token id."""
    probs = cache.logit_lens(pos=shown)[:, 0].softmax(-1)  # [L, T_shown, V]
    p_top, i_top = probs.max(-1)  # [L, T_shown]
    rows = [f"layer {layer}" for layer in range(p_top.shape[0])]
    return logit_lens_figure(p_top, [[piece(i) for i in row] for row in i_top.tolist()], rows, tokens[shown],
                             start=range(len(tokens))[shown].start, title=title)


def attribution_figure(labels: Sequence[str], values: torch.Tensor, x_title: str = "contribution to the logit",
                       title: str = "") -> go.Figure:
    """Horizontal bars, one per component (a layer's attention or MLP, shared or routed part, an expert...),
    blue when it pushes the target up, red when down, in the given order top to bottom."""
    v = data(values, "values", 1)
    same_length(v, labels, "values", "labels")
    fig = go.Figure(go.Bar(x=v, y=list(labels), orientation="h", marker_color=np.where(v >= 0, POSITIVE, NEGATIVE),
                           hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(title_text=x_title, zeroline=True, zerolinewidth=1, zerolinecolor="#444")
    return finish(fig, title, height=max(300, 110 + 22 * len(labels)), legend=False)


def effect_heatmap(effect: torch.Tensor, row_labels: Sequence[str], tokens: Sequence[str],
                   colorbar_title: str = "effect", title: str = "", x_title: str | None = None) -> go.Figure:
    """An effect per (row, column) on a diverging scale centred on 0: e.g. activation patching, the share of a
    logit difference restored by patching one layer's residual at one position. ``effect``: [rows, T]. Columns
    are token positions (``tokens``, labelled with their positions) unless ``x_title`` names what they are, in which
    case ``tokens`` are plain column labels (heads, experts, ...)."""
    z = data(effect, "effect", 2)
    same_length(z, row_labels, "effect [rows, T]", "row_labels")
    same_length(z, tokens, "effect [rows, T]", "tokens", axis=1)
    bound = float(np.nanmax(np.abs(z))) or 1.0
    columns = token_labels(tokens) if x_title is None else list(tokens)
    fig = go.Figure(go.Heatmap(z=z, x=columns, y=list(row_labels), colorscale=DIVERGING, zmid=0,
                               zmin=-bound, zmax=bound, xgap=1, ygap=1, colorbar=dict(title=colorbar_title),
                               hovertemplate="%{y}, %{x}<br>%{z:.3f}<extra></extra>"))
    fig.update_xaxes(title_text=x_title or "position", tickangle=-45 if x_title is None else 0, dtick=1)
    fig.update_yaxes(autorange="reversed")
    return finish(fig, title, height=150 + 34 * len(row_labels), legend=False)
