"""The nano training run from its log: loss, QK-Clip activity, router balance over time, and Muon's update on one
matrix."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .style import (
    BLUE,
    DIVERGING,
    GREY,
    IDLE,
    LOG_AXIS,
    ORANGE,
    RED,
    SEQUENTIAL,
    array,
    data,
    finish,
    log2_ratio,
    ratio_ticks,
    reference_line,
    same_length,
    series_of,
)


def loss_figure(steps: Sequence[int], loss: Sequence[float], eval_steps: Sequence[int], eval_bpb: Sequence[float],
                unigram_bpb: float | None = None, title: str = "") -> go.Figure:
    """Left: the training loss per step (nats per token) with a trailing 25-step mean. Right: held-out bits per
    byte at each evaluation, against the token-unigram baseline (dashed)."""
    raw, window = data(loss, "loss", 1).astype(np.float64), 25
    same_length(raw, steps, "loss", "steps")
    if len(eval_steps) != len(eval_bpb):
        raise ValueError(f"eval_steps has {len(eval_steps)} entries but eval_bpb has {len(eval_bpb)}")
    fig = make_subplots(rows=1, cols=2, subplot_titles=["training loss", "held-out code"], horizontal_spacing=0.1)
    total = np.concatenate([[0.0], np.cumsum(raw)])
    start = np.maximum(np.arange(1, len(raw) + 1) - window, 0)
    smooth = (total[1:] - total[start]) / (np.arange(1, len(raw) + 1) - start)  # trailing mean of up to 25 steps
    fig.add_trace(go.Scatter(x=list(steps), y=raw, name="loss per step", line=dict(color="#aec7e8", width=1)),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=list(steps), y=smooth, name=f"{window}-step mean", line=dict(color=BLUE)),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=list(eval_steps), y=array(eval_bpb), name="held-out bits/byte", mode="lines+markers",
                             line=dict(color=ORANGE)), row=1, col=2)
    if unigram_bpb is not None:
        reference_line(fig, unigram_bpb, f"token unigram: {unigram_bpb:.2f}", row=1, col=2, position="bottom left")
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="cross-entropy (nats/token)", row=1, col=1)
    fig.update_yaxes(title_text="bits per byte", rangemode="tozero", row=1, col=2)
    return finish(fig, title or "Training K2-nano", height=440, legend_below=True)


def qk_clip_figure(steps: Sequence[int], max_logits: torch.Tensor, tau: float, title: str = "",
                   max_columns: int = 200) -> go.Figure:
    """Top: each head's largest pre-softmax logit per step (rows layer.head, ``max_logits`` [S, L, H]), on a colour
    scale from 0 to the largest logit shown (at least tau), with tau marked on the colour bar, so a head above tau
    is told apart from one at it; at most ``max_columns`` evenly spaced steps, which keeps a stored notebook small.
    Bottom: how many heads QK-Clip rescaled (max logit > tau) at EVERY step, so no clipped step is skipped."""
    m = data(max_logits, "max_logits", 3)
    same_length(m, steps, "max_logits [S, L, H]", "steps")
    S, L, H = m.shape
    every = max(1, -(-S // max_columns))  # ceil(S / max_columns)
    shown = list(steps)[::every]
    rows = [f"L{layer}.h{h}" for layer in range(L) for h in range(H)]
    heat = m[::every].reshape(len(shown), L * H).T
    top = max(float(tau), float(np.nanmax(heat)))
    ticks = [t for t in _round_ticks(top) if abs(t - tau) > 0.08 * top] + [float(tau)]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.75, 0.25], vertical_spacing=0.05)
    fig.add_trace(go.Heatmap(z=heat, x=shown, y=rows, colorscale=SEQUENTIAL, zmin=0, zmax=top,
                             colorbar=dict(title="max logit", len=0.7, y=0.62, tickvals=sorted(ticks),
                                           ticktext=[f"τ={t:g}" if t == tau else f"{t:g}" for t in sorted(ticks)]),
                             hovertemplate="step %{x}, %{y}<br>max logit %{z:.1f}<extra></extra>"), row=1, col=1)
    clipped = (m > tau).reshape(S, -1).sum(-1)
    fig.add_trace(go.Scatter(x=list(steps), y=clipped, mode="lines", line=dict(color=RED, width=1),
                             name="clipped heads"), row=2, col=1)
    fig.update_yaxes(autorange="reversed", dtick=1 if L * H <= 48 else None, row=1, col=1)
    fig.update_yaxes(title_text=f"heads > τ={tau:g}", rangemode="tozero", dtick=max(1, -(-int(clipped.max()) // 4)),
                     row=2, col=1)  # whole heads only
    fig.update_xaxes(title_text="step", row=2, col=1)
    heat = "" if every == 1 else f" (heatmap: every {every}th step; clipped heads: every step)"
    return finish(fig, title or f"QK-Clip: the largest attention logit of every head{heat}", height=560,
                  legend=False)


def _round_ticks(top: float) -> list[float]:
    """About five round colour-bar ticks from 0 to ``top``."""
    step = 10 ** np.floor(np.log10(top / 4)) if top > 0 else 1.0
    for factor in (1, 2, 2.5, 5, 10):
        if top / (step * factor) <= 5:
            step *= factor
            break
    return [float(t) for t in np.arange(0.0, top + 1e-9, step)]


def expert_time_figure(steps: Sequence[int], values: torch.Tensor, colorbar_title: str, zmid: float | None = None,
                       log2: bool = False, title: str = "") -> go.Figure:
    """One MoE layer over training: experts (rows) against steps, e.g. the correction bias or the relative load.
    ``values``: [S, E]. ``zmid`` centres a diverging scale, symmetric about it and fitted to the data. ``log2``
    colours ratios so 0.5 and 2 look alike, on a range fitted to the data (at most 1/16 .. 16); zeros (an idle
    expert: no finite log) are drawn apart in grey."""
    v = data(values, "values", 2)
    same_length(v, steps, "values [S, E]", "steps")
    v = v.T
    idle = None
    if log2:
        idle = v <= 0
        z = np.where(idle, np.nan, log2_ratio(np.where(idle, 1.0, v)))
        bound = max(float(np.nanmax(np.abs(z))) if (~idle).any() else 0.0, 0.25)
        kwargs = dict(colorscale=DIVERGING, zmid=0, zmin=-bound, zmax=bound,
                      colorbar=dict(title=colorbar_title, **ratio_ticks(bound)))
    elif zmid is not None:
        bound = float(np.abs(v - zmid).max()) or 1.0
        z, kwargs = v, dict(colorscale=DIVERGING, zmid=zmid, zmin=zmid - bound, zmax=zmid + bound,
                            colorbar=dict(title=colorbar_title))
    else:
        z, kwargs = v, dict(colorscale=SEQUENTIAL, colorbar=dict(title=colorbar_title))
    if log2:  # the colour is log2 of the value: hover shows the value itself
        kwargs.update(customdata=v, hovertemplate="step %{x}, expert %{y}<br>%{customdata:.3f}<extra></extra>")
    else:
        kwargs.update(hovertemplate="step %{x}, expert %{y}<br>%{z:.3f}<extra></extra>")
    fig = go.Figure(go.Heatmap(z=z, x=list(steps), y=list(range(v.shape[0])), **kwargs))
    if idle is not None and idle.any():
        fig.add_trace(go.Heatmap(z=np.where(idle, 1.0, np.nan), x=list(steps), y=list(range(v.shape[0])),
                                 colorscale=[[0, IDLE], [1, IDLE]], showscale=False, name="idle",
                                 hovertemplate="step %{x}, expert %{y}<br>idle: no tokens<extra></extra>"))
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="expert", autorange="reversed")
    return finish(fig, title, height=420, legend=False)


def singular_values_figure(series: Mapping[str, torch.Tensor], title: str = "") -> go.Figure:
    """Singular values, largest first, of matrices that share a shape: a gradient, Muon's Newton-Schulz update,
    the exact U V^T. Muon keeps the directions and sets the magnitudes near one."""
    series_of(series, "series")
    fig = go.Figure()
    for (name, sv), color in zip(series.items(), (GREY, BLUE, ORANGE, RED), strict=False):
        fig.add_trace(go.Scatter(y=data(sv, f"series[{name!r}]", 1), name=name, mode="lines+markers",
                                 line=dict(color=color)))
    fig.update_xaxes(title_text="index (largest first)")
    fig.update_yaxes(title_text="singular value", **LOG_AXIS)
    return finish(fig, title or "Singular values of one update", height=400)
