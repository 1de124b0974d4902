"""Multi-head latent attention: attention patterns, and scores split into their content part and rotary part."""

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
    # every token's label while they fit (about 22 in a panel's height); beyond that every k-th, so none overlap
    fig.update_yaxes(autorange="reversed", showticklabels=False, dtick=max(1, -(-pattern.shape[1] // 22)))
    fig.update_xaxes(showticklabels=False)
    fig.update_yaxes(showticklabels=True, col=1)
    fig.update_layout(coloraxis=dict(colorscale=SEQUENTIAL, cmin=0, cmax=1, colorbar=dict(title="weight")))
    side = 260 if len(tokens) <= 24 else 300
    return finish(fig, title or "Attention patterns", height=90 + rows * side, legend=False)


def score_split_figure(content: torch.Tensor, rotary: torch.Tensor, tokens: Sequence[str],
                       title: str = "") -> go.Figure:
    """One head's pre-softmax scores [T, S] as their two MLA terms and their sum, each panel on its own diverging
    scale (one shared scale would blank the smaller term): content = scale * q_nope . k_nope, rotary part = scale *
    q_pe . k_pe. Both terms are computed from the tokens; only the rotary part is also rotated by position. Future
    positions are blank."""
    content, rotary = data(content, "content", 2), data(rotary, "rotary", 2)
    if content.shape != rotary.shape:
        raise ValueError(f"content and rotary must share a shape, got {list(content.shape)} and {list(rotary.shape)}")
    same_length(content, tokens, "the scores [T, S]", "tokens", axis=1)
    total = content + rotary
    T, S = total.shape
    masked = np.triu(np.ones((T, S), dtype=bool), k=1 + S - T)
    panels = {"content: q_nope · k_nope": content, "rotary part: q_pe · k_pe": rotary, "total score": total}
    labels = token_labels(tokens)
    fig = make_subplots(rows=1, cols=3, subplot_titles=list(panels), horizontal_spacing=0.1)
    for col, z in enumerate(panels.values(), start=1):
        shown = np.where(masked, np.nan, z)
        bound = float(np.nanmax(np.abs(shown))) or 1.0
        right = fig.layout[f"xaxis{col if col > 1 else ''}"].domain[1]  # the colour bar sits just right of its panel
        fig.add_trace(go.Heatmap(z=shown, x=labels, y=labels[-T:], colorscale=DIVERGING, zmid=0, zmin=-bound,
                                 zmax=bound, colorbar=dict(x=right + 0.005, xanchor="left", len=0.8, thickness=10),
                                 hovertemplate="query %{y}<br>key %{x}<br>%{z:.2f}<extra></extra>"), row=1, col=col)
    step = max(1, -(-S // 16))  # at most 16 token labels per axis, so long prompts stay readable
    fig.update_yaxes(autorange="reversed", showticklabels=False, dtick=step)
    fig.update_yaxes(showticklabels=True, automargin=True, col=1)
    fig.update_xaxes(tickangle=-60, dtick=step, automargin=True)
    return finish(fig, title or "Attention scores split into content and rotary part (each its own colour range)",
                  height=460, legend=False)
