"""The real K2 by the numbers: parameters per component."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from .style import BLUE, LOG_AXIS, ORANGE, finish


def parameter_figure(rows: Sequence[tuple[str, int, int]], title: str = "") -> go.Figure:
    """Total against per-token active parameters by component, log scale (``ParameterCount.table()`` rows)."""
    if not rows or not all(len(row) == 3 for row in rows):
        raise ValueError(f"rows must be (component, total, active) triples (ParameterCount.table()), got {rows!r}")
    names = [name.replace("_", " ") for name, _, _ in rows]
    fig = go.Figure()
    for i, (label, color) in enumerate((("total", BLUE), ("active per token", ORANGE)), start=1):
        values = [row[i] for row in rows]
        fig.add_trace(go.Bar(y=names, x=values, name=label, orientation="h", marker_color=color,
                             text=[f"{v / 1e9:,.2f} B" if v >= 1e8 else f"{v / 1e6:,.2f} M" for v in values],
                             textposition="outside", cliponaxis=False))
    fig.update_xaxes(title_text="parameters", **LOG_AXIS)
    fig.update_yaxes(autorange="reversed")
    return finish(fig.update_layout(barmode="group"), title or "Where K2's parameters are", height=470)
