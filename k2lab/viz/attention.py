"""Multi-head latent attention: attention patterns, and scores split into their content and position terms."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .style import DIVERGING, SEQUENTIAL, data, finish, same_length, token_labels


def pattern_figure(pattern: torch.Tensor, tokens: Sequence[str], head_labels: Sequence[str] | None = None,
                   title: str = "") -> go.Figure:
    """Attention patterns [H, T, S] (one batch row), one heatmap per head on a shared 0..1 scale: row t is where
    query t looks; keys on the x axis. Masked (future) positions are blank."""
    pattern = data(pattern, "pattern", 3)
    same_length(pattern, tokens, "pattern [H, T, S]", "tokens", axis=2)
    H = pattern.shape[0]
    labels = token_labels(tokens)
    heads = list(head_labels) if head_labels is not None else [f"head {h}" for h in range(H)]
    cols = min(H, 4)
    rows = -(-H // cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=heads, horizontal_spacing=0.04, vertical_spacing=0.08)
    upper = np.triu(np.ones(pattern.shape[1:], dtype=bool), k=1 + pattern.shape[2] - pattern.shape[1])
    for h in range(H):
        z = np.where(upper, np.nan, pattern[h])
        fig.add_trace(go.Heatmap(z=z, x=labels, y=labels[-pattern.shape[1]:], coloraxis="coloraxis",
                                 hovertemplate="query %{y}<br>key %{x}<br>%{z:.3f}<extra></extra>"),
                      row=h // cols + 1, col=h % cols + 1)
    fig.update_yaxes(autorange="reversed", showticklabels=False, dtick=1)
    fig.update_xaxes(showticklabels=False)
    fig.update_yaxes(showticklabels=True, col=1)
    fig.update_layout(coloraxis=dict(colorscale=SEQUENTIAL, cmin=0, cmax=1, colorbar=dict(title="weight")))
    side = 260 if len(tokens) <= 24 else 300
    return finish(fig, title or "Attention patterns", height=90 + rows * side, legend=False)


def score_split_figure(content: torch.Tensor, position: torch.Tensor, tokens: Sequence[str],
                       title: str = "") -> go.Figure:
    """One head's pre-softmax scores [T, S] as their two MLA terms and their sum, on one diverging scale:
    content = scale * q_nope . k_nope (what the tokens are), position = scale * q_pe . k_pe (the rotary part: where
    they are). Future positions are blank."""
    content, position = data(content, "content", 2), data(position, "position", 2)
    if content.shape != position.shape:
        raise ValueError(f"content and position must share a shape, got {list(content.shape)} and "
                         f"{list(position.shape)}")
    same_length(content, tokens, "the scores [T, S]", "tokens", axis=1)
    total = content + position
    T, S = total.shape
    masked = np.triu(np.ones((T, S), dtype=bool), k=1 + S - T)
    panels = {"content: q_nope · k_nope": content, "position: q_pe · k_pe": position, "total score": total}
    bound = float(np.nanmax(np.abs(np.where(masked, np.nan, np.stack(list(panels.values())))))) or 1.0
    labels = token_labels(tokens)
    fig = make_subplots(rows=1, cols=3, subplot_titles=list(panels), horizontal_spacing=0.04)
    for col, z in enumerate(panels.values(), start=1):
        fig.add_trace(go.Heatmap(z=np.where(masked, np.nan, z), x=labels, y=labels[-T:], coloraxis="coloraxis",
                                 hovertemplate="query %{y}<br>key %{x}<br>%{z:.2f}<extra></extra>"), row=1, col=col)
    fig.update_yaxes(autorange="reversed", showticklabels=False, dtick=1)
    fig.update_yaxes(showticklabels=True, col=1)
    fig.update_xaxes(tickangle=-60, dtick=1)
    fig.update_layout(coloraxis=dict(colorscale=DIVERGING, cmid=0, cmin=-bound, cmax=bound,
                                     colorbar=dict(title="scaled<br>score")))
    return finish(fig, title or "Attention scores split into content and position", height=460, legend=False)
