"""Features against experts: how pure features are against their baselines, where a feature's tokens are routed, and
how much feature activity and expert choice share per layer. Inputs are the tensors of ``k2lab.analysis.features``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
import torch

from .style import BLUE, GREY, LIGHT_SEQUENTIAL, ORANGE, PURPLE, data, finish, same_length, series_of

_BASELINE_COLOURS = (GREY, ORANGE, PURPLE)


def purity_figure(series: Mapping[str, torch.Tensor], title: str = "", x_title: str = "purity") -> go.Figure:
    """The distribution over features of each series ({name: [F]}: the purity, its baselines): the share of features
    per bin of width 0.025 on 0..1, drawn as step outlines so that overlapping distributions stay visible; NaN
    entries (features never active) left out. The first series is drawn in blue, the baselines after it in greys and
    oranges."""
    series_of(series, "series")
    edges = np.linspace(0, 1, 41)  # 40 bins of 0.025
    fig = go.Figure()
    for i, ((name, values), colour) in enumerate(zip(series.items(), (BLUE, *_BASELINE_COLOURS), strict=False)):
        v = data(values, f"series[{name!r}]", 1)
        v = v[~np.isnan(v)]
        if not v.size:
            raise ValueError(f"series[{name!r}] holds only NaN (no feature was ever active): nothing to draw")
        share = np.histogram(np.clip(v, 0, 1), bins=edges)[0] / v.size  # [40]
        fig.add_trace(go.Scatter(x=(edges[:-1] + edges[1:]) / 2, y=share, name=f"{name} (mean {v.mean():.2f})",
                                 mode="lines", line=dict(color=colour, width=3 if i == 0 else 2, shape="hvh"),
                                 hovertemplate=f"{name}<br>%{{x:.3f}}: %{{y:.1%}} of features<extra></extra>"))
    fig.update_xaxes(title_text=x_title, range=[0, 1.01])
    fig.update_yaxes(title_text="share of features", tickformat=".0%", rangemode="tozero")
    return finish(fig, title, height=400, legend=True)


def expert_share_heatmap(shares: torch.Tensor, row_labels: Sequence[str], title: str = "",
                         colorbar_title: str = "share of<br>its tokens", x_title: str = "expert") -> go.Figure:
    """Per row (a feature, or one feature before and after an intervention) the share of its tokens that chose each
    expert ([rows, E], ``FeaturePurity.distribution``), on a light sequential scale from 0 to the largest share (a
    row sums to k, so no cell exceeds 1)."""
    z = data(shares, "shares", 2)
    same_length(z, row_labels, "shares [rows, E]", "row_labels")
    experts = list(range(z.shape[1]))
    fig = go.Figure(go.Heatmap(z=z, x=experts, y=list(row_labels), colorscale=LIGHT_SEQUENTIAL, zmin=0,
                               zmax=max(float(np.nanmax(z)), 1e-9), xgap=1, ygap=1,
                               colorbar=dict(title=colorbar_title, tickformat=".0%"),
                               hovertemplate="%{y}<br>expert %{x}: %{z:.1%}<extra></extra>"))
    fig.update_xaxes(title_text=x_title, dtick=1 if len(experts) <= 40 else None)
    fig.update_yaxes(autorange="reversed", type="category")
    return finish(fig, title, height=150 + 30 * len(row_labels), legend=False)


def information_figure(layers: Sequence[int], share: torch.Tensor, interval: torch.Tensor,
                       baselines: Mapping[str, torch.Tensor], title: str = "",
                       y_title: str = "I(feature; best expert) / H(feature)") -> go.Figure:
    """Per MoE layer, the mean share of a feature's entropy that its best expert's choice explains (bars, [L_moe],
    with the bootstrap interval [2, L_moe] as error bars) beside its baselines ({name: [L_moe]}, markers joined by
    dashed lines)."""
    s = data(share, "share", 1)
    ci = data(interval, "interval", 2)
    same_length(s, layers, "share", "layers")
    same_length(ci, layers, "interval [2, L_moe]", "layers", axis=1)
    x = [str(layer) for layer in layers]
    fig = go.Figure(go.Bar(x=x, y=s, name="features and experts", marker_color=BLUE,
                           error_y=dict(type="data", symmetric=False, array=ci[1] - s, arrayminus=s - ci[0],
                                        color="#333"),
                           hovertemplate="layer %{x}: %{y:.3f}<extra></extra>"))
    for (name, values), colour in zip(baselines.items(), _BASELINE_COLOURS, strict=False):
        v = data(values, f"baselines[{name!r}]", 1)
        same_length(v, layers, f"baselines[{name!r}]", "layers")
        fig.add_trace(go.Scatter(x=x, y=v, name=name, mode="lines+markers", marker=dict(color=colour, size=10),
                                 line=dict(color=colour, dash="dash"),
                                 hovertemplate=f"{name}<br>layer %{{x}}: %{{y:.3f}}<extra></extra>"))
    fig.update_xaxes(title_text="MoE layer", type="category")
    fig.update_yaxes(title_text=y_title, rangemode="tozero")
    return finish(fig, title, height=420, legend=True)
