"""Line charts against a shared x: costs against context length, training curves."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
import plotly.colors
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .style import LOG_AXIS, array, data, finish, same_length, series_of


def lines_figure(x: Sequence[float], panels: Mapping[str, Mapping[str, torch.Tensor | Sequence[float]]],
                 x_title: str, *, log_x: bool = False, log_y: bool = False, colors: Mapping[str, str] | None = None,
                 title: str = "", height: int = 420, smooth: int | None = None) -> go.Figure:
    """Lines against a shared x, one panel per quantity: ``panels = {"KV cache (GiB)": {"latent": [...], ...}}``
    (with one panel its name titles the y axis). A series keeps its colour (``colors[name]``) and one legend entry
    across panels. ``smooth``: draw each series as its trailing mean over that many points, with the raw values
    faint behind it (noisy per-step curves)."""
    if smooth is not None and (isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1):
        raise ValueError(f"smooth must be a whole number of points >= 1 or None, got {smooth!r}")
    series_of(panels, "panels")
    for panel, series in panels.items():
        series_of(series, f"panels[{panel!r}]")
        for name, values in series.items():
            same_length(data(values, f"panels[{panel!r}][{name!r}]", 1), x, f"panels[{panel!r}][{name!r}]", "x")
    if colors is None:  # one colour per series name, the same in every panel (plotly would cycle per trace)
        names = list(dict.fromkeys(name for series in panels.values() for name in series))
        colors = dict(zip(names, itertools.cycle(plotly.colors.qualitative.Plotly), strict=False))
    many = len(panels) > 1
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=list(panels) if many else None,
                        horizontal_spacing=0.09)
    seen: set[str] = set()
    for col, series in enumerate(panels.values(), start=1):
        for name, values in series.items():
            y = array(values)
            if smooth is not None and smooth > 1:
                fig.add_trace(go.Scatter(x=list(x), y=y, mode="lines", line=dict(color=colors.get(name), width=1),
                                         opacity=0.25, legendgroup=name, showlegend=False, hoverinfo="skip"),
                              row=1, col=col)
                y = _trailing_mean(y, smooth)
            fig.add_trace(go.Scatter(x=list(x), y=y, name=name, mode="lines" if len(x) > 40 else
                                     "lines+markers", line=dict(color=colors.get(name)), legendgroup=name,
                                     showlegend=name not in seen), row=1, col=col)
            seen.add(name)
        fig.update_xaxes(title_text=x_title, **(LOG_AXIS if log_x else {}), row=1, col=col)
        fig.update_yaxes(**(LOG_AXIS if log_y else {}), row=1, col=col)
    if not many:
        fig.update_yaxes(title_text=next(iter(panels)))
    return finish(fig, title, height=height, legend=len(seen) > 1, legend_below=many)


def _trailing_mean(y: np.ndarray, window: int) -> np.ndarray:
    """Each point's mean over itself and the window - 1 points before it (fewer at the start)."""
    sums = np.cumsum(np.concatenate([[0.0], y.astype(np.float64)]))
    counts = np.minimum(np.arange(1, len(y) + 1), window)
    return ((sums[1:] - sums[np.arange(len(y)) + 1 - counts]) / counts).astype(np.float32)
