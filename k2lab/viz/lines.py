"""Line charts against a shared x: costs against context length, training curves."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import plotly.colors
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .style import LOG_AXIS, array, data, finish, same_length, series_of


def lines_figure(x: Sequence[float], panels: Mapping[str, Mapping[str, torch.Tensor | Sequence[float]]],
                 x_title: str, *, log_x: bool = False, log_y: bool = False, colors: Mapping[str, str] | None = None,
                 title: str = "", height: int = 420) -> go.Figure:
    """Lines against a shared x, one panel per quantity: ``panels = {"KV cache (GiB)": {"latent": [...], ...}}``
    (with one panel its name titles the y axis). A series keeps its colour (``colors[name]``) and one legend entry
    across panels."""
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
            fig.add_trace(go.Scatter(x=list(x), y=array(values), name=name, mode="lines" if len(x) > 40 else
                                     "lines+markers", line=dict(color=colors.get(name)), legendgroup=name,
                                     showlegend=name not in seen), row=1, col=col)
            seen.add(name)
        fig.update_xaxes(title_text=x_title, **(LOG_AXIS if log_x else {}), row=1, col=col)
        fig.update_yaxes(**(LOG_AXIS if log_y else {}), row=1, col=col)
    if not many:
        fig.update_yaxes(title_text=next(iter(panels)))
    return finish(fig, title, height=height, legend=len(seen) > 1, legend_below=many)
