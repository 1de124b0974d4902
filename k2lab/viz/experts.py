"""Expert statistics over many tokens: load against uniform, specialisation, co-activation, neighbour overlap,
router entropy. Inputs are the tensors of ``k2lab.routing``'s metrics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .style import (
    BLUE,
    DIVERGING,
    IDLE,
    ORANGE,
    RED,
    data,
    finish,
    ratio_ticks,
    reference_line,
    same_length,
    series_of,
)

_QUALITATIVE = (BLUE, ORANGE, "#2ca02c", "#9467bd", "#8c564b", "#e377c2")


def load_figure(relative_load: torch.Tensor, layers: Sequence[int], title: str = "") -> go.Figure:
    """Left: relative load c_e / mean(c) per layer and expert on a diverging scale centred on 1 (balanced), log
    coloured so 0.5 and 2 look equally far, its range fitted to the data (symmetric about 1, so the colours say how
    far the furthest expert strays). Idle experts (load 0, no finite log) are drawn apart in grey. Right: MaxVio =
    max_e(relative load) - 1 per layer. ``relative_load``: [L_moe, E]."""
    rel = data(relative_load, "relative_load", 2)
    same_length(rel, layers, "relative_load [L_moe, E]", "layers")
    ys = [f"layer {layer}" for layer in layers]
    idle = rel <= 0
    with np.errstate(divide="ignore"):
        z = np.where(idle, np.nan, np.log2(np.where(idle, 1.0, rel)))
    bound = max(float(np.nanmax(np.abs(z))) if (~idle).any() else 0.0, 0.25)  # at least 0.84x .. 1.19x
    experts = list(range(rel.shape[1]))
    fig = make_subplots(rows=1, cols=2, column_widths=[0.8, 0.2], shared_yaxes=True, horizontal_spacing=0.03,
                        subplot_titles=["relative load (1 = uniform; grey = idle, 0 tokens)", "MaxVio"])
    fig.add_trace(go.Heatmap(z=z, x=experts, y=ys, customdata=rel, colorscale=DIVERGING, zmid=0, zmin=-bound,
                             zmax=bound, xgap=1, ygap=1,
                             colorbar=dict(title="load /<br>uniform", x=1.02, **ratio_ticks(bound)),
                             hovertemplate="%{y}, expert %{x}<br>%{customdata:.2f} × uniform<extra></extra>"),
                  row=1, col=1)
    if idle.any():
        fig.add_trace(go.Heatmap(z=np.where(idle, 1.0, np.nan), x=experts, y=ys, colorscale=[[0, IDLE], [1, IDLE]],
                                 showscale=False, xgap=1, ygap=1, name="idle",
                                 hovertemplate="%{y}, expert %{x}<br>idle: no tokens<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(x=rel.max(-1) - 1, y=ys, orientation="h", marker_color=RED,
                         hovertemplate="%{y}<br>MaxVio %{x:.2f}<extra></extra>"), row=1, col=2)
    fig.update_xaxes(title_text="expert", row=1, col=1)
    fig.update_xaxes(title_text="max / mean - 1", rangemode="tozero", row=1, col=2)
    fig.update_yaxes(autorange="reversed")
    return finish(fig, title or "Expert load per layer", height=160 + 45 * len(layers), legend=False)


def specialization_figure(shares: Mapping[str, torch.Tensor], uniform: float, title: str = "") -> go.Figure:
    """The share of each domain's tokens routed to each expert (``routing.domain_specialization`` for one layer),
    experts ordered by how much more the first domain uses them than the second; the dashed line is uniform
    routing (top / E). ``shares``: {domain: [E]}."""
    series_of(shares, "shares")
    values = {name: data(v, f"shares[{name!r}]", 1) for name, v in shares.items()}
    vals = list(values.values())
    order = np.argsort(-(vals[0] - vals[1]) if len(vals) > 1 else np.zeros(len(vals[0])), kind="stable")
    fig = go.Figure()
    for (name, v), color in zip(values.items(), _QUALITATIVE, strict=False):
        fig.add_trace(go.Bar(x=[str(e) for e in order], y=100 * v[order], name=name, marker_color=color,
                             hovertemplate=f"{name}<br>expert %{{x}}<br>%{{y:.1f}}% of tokens<extra></extra>"))
    reference_line(fig, 100 * uniform, f"uniform: {uniform:.1%}")
    fig.update_xaxes(title_text="expert (ordered by the difference)", type="category")
    fig.update_yaxes(title_text="tokens routed to the expert (%)")
    return finish(fig.update_layout(barmode="group"), title or "Domain specialisation", height=420)


def layer_bars_figure(series: Mapping[str, torch.Tensor], layers: Sequence[int | str], y_title: str,
                      reference: float | None = None, reference_label: str = "", percent: bool = False,
                      title: str = "", x_title: str = "layer") -> go.Figure:
    """Grouped bars of per-layer summaries ({name: [L_moe]}), with an optional dashed reference line: the
    consecutive-token rate against its random baseline, vocabulary specialisation of input against output ids."""
    series_of(series, "series")
    scale = 100 if percent else 1
    fig = go.Figure()
    for (name, v), color in zip(series.items(), _QUALITATIVE, strict=False):
        v = data(v, f"series[{name!r}]", 1)
        same_length(v, layers, f"series[{name!r}]", "layers")
        fig.add_trace(go.Bar(x=[str(layer) for layer in layers], y=scale * v, name=name, marker_color=color))
    if reference is not None:
        reference_line(fig, scale * reference, reference_label)
    fig.update_xaxes(title_text=x_title, type="category")
    fig.update_yaxes(title_text=y_title, rangemode="tozero")
    return finish(fig.update_layout(barmode="group"), title, height=400, legend=len(series) > 1)


def coactivation_figure(coactivation: torch.Tensor, title: str = "") -> go.Figure:
    """C(i -> j) for one layer ([E, E], ``routing.coactivation``): row i, column j, the share of the tokens that
    chose expert i which also chose j."""
    c = 100 * data(coactivation, "coactivation", 2)
    E = c.shape[0]
    fig = go.Figure(go.Heatmap(z=c, x=list(range(E)), y=list(range(E)), colorscale="Reds", zmin=0,
                               colorbar=dict(title="% of i's<br>tokens"),
                               hovertemplate="given expert %{y}<br>also expert %{x}: %{z:.1f}%<extra></extra>"))
    fig.update_xaxes(title_text="also chosen: expert j", constrain="domain")
    fig.update_yaxes(title_text="given expert i", autorange="reversed", scaleanchor="x")
    return finish(fig, title or "Expert co-activation", height=560, width=640, legend=False)


def entropy_figure(entropies: Mapping[str, torch.Tensor], maxima: Mapping[str, float], layers: Sequence[int],
                   title: str = "") -> go.Figure:
    """Box plots per layer of per-token entropies as a share of their maximum: ``entropies[name]`` [L_moe, ...]
    in nats (``routing.router_entropy``), divided by ``maxima[name]`` (ln E for the scores, ln k for the weights).
    1 means no preference at all. Boxes span the quartiles, whiskers the 1st and 99th percentiles (the statistics
    are computed here, so the figure stays small however many tokens there are)."""
    series_of(entropies, "entropies")
    fig = go.Figure()
    x = [str(layer) for layer in layers]
    lowest = 1.0
    for (name, h), color in zip(entropies.items(), _QUALITATIVE, strict=False):
        h = data(h, f"entropies[{name!r}]")
        same_length(h, layers, f"entropies[{name!r}]", "layers")
        if name not in maxima or not maxima[name] > 0:
            raise ValueError(f"maxima[{name!r}] must be the entropy's maximum (> 0), got {maxima.get(name)!r}")
        share = h.reshape(len(layers), -1) / maxima[name]
        low, q1, median, q3, high = np.percentile(share, [1, 25, 50, 75, 99], axis=1)
        fig.add_trace(go.Box(x=x, q1=q1, median=median, q3=q3, lowerfence=low, upperfence=high, name=name,
                             marker_color=color))
        lowest = min(lowest, float(low.min()))
    # The label sits above the line, in a margin of its own: below it, it would cross the whiskers that reach 1.
    reference_line(fig, 1.0, "no preference", position="top left")
    span = 1.0 - lowest
    fig.update_xaxes(title_text="layer", type="category")
    fig.update_yaxes(title_text="entropy / its maximum", range=[lowest - 0.05 * span, 1.0 + 0.1 * span])
    return finish(fig.update_layout(boxmode="group"), title or "Router entropy per token", height=400)
