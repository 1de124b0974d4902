"""The real K2 by the numbers: parameters per component."""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import BLUE, LOG_AXIS, ORANGE, finish


def parameter_figure(rows: Sequence[tuple[str, int, int]], title: str = "") -> go.Figure:
    """Total against per-token active parameters by component (``ParameterCount.table()`` rows). Left: counts on a
    log axis, so the small components can be read; right: each component's share of the total and of the active
    parameters on a linear axis, which shows what the log axis hides: nearly everything is routed experts."""
    if not rows or not all(len(row) == 3 for row in rows):
        raise ValueError(f"rows must be (component, total, active) triples (ParameterCount.table()), got {rows!r}")
    names = [name.replace("_", " ") for name, _, _ in rows]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, column_widths=[0.6, 0.4], horizontal_spacing=0.04,
                        subplot_titles=["parameters (log axis)", "share of all (linear axis)"])
    largest = max(max(total, active) for _, total, active in rows)
    smallest = min(v for _, total, active in rows for v in (total, active) if v > 0)
    series = [(label, color, [row[i] for row in rows])
              for i, (label, color) in enumerate((("total", BLUE), ("active per token", ORANGE)), start=1)]
    for label, color, values in series:
        fig.add_trace(go.Bar(y=names, x=values, name=label, orientation="h", marker_color=color, legendgroup=label,
                             text=[f"{v / 1e9:,.2f} B" if v >= 1e8 else f"{v / 1e6:,.2f} M" for v in values],
                             textposition="outside", cliponaxis=False), row=1, col=1)
    for label, color, values in series:
        shares = [100 * v / sum(values) for v in values]
        fig.add_trace(go.Bar(y=names, x=shares, name=label, orientation="h", marker_color=color, legendgroup=label,
                             showlegend=False, text=[f"{s:.1f}%" for s in shares], textposition="outside",
                             cliponaxis=False), row=1, col=2)
    # Room on the right of the longest bar for its label: about one decade on the log axis.
    fig.update_xaxes(title_text="parameters", range=[math.log10(smallest) - 0.3, math.log10(largest) + 0.9],
                     **LOG_AXIS, row=1, col=1)
    fig.update_xaxes(title_text="% of total / % of active", range=[0, 125], tickvals=[0, 25, 50, 75, 100],
                     row=1, col=2)
    fig.update_yaxes(autorange="reversed")
    return finish(fig.update_layout(barmode="group"), title or "Where K2's parameters are", height=500, width=1000,
                  legend_below=True)
