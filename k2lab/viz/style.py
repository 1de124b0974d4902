"""Shared look of the lab's figures: one template, readable fonts, colours that keep their meaning across notebooks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
import torch

TEMPLATE = "plotly_white"
FONT = dict(family="Inter, Helvetica, Arial, sans-serif", size=13)

# One colour per idea, the same in every notebook.
BLUE, ORANGE, GREEN, RED, GREY, PURPLE = "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#7f7f7f", "#9467bd"
NAIVE, ABSORBED = ORANGE, BLUE  # MLA paths
CONTENT, POSITION = BLUE, ORANGE  # nope . nope and pe . pe score terms
CHOSEN, NOT_CHOSEN, BIAS = BLUE, "#c7d3e0", RED  # router panels
POSITIVE, NEGATIVE = BLUE, RED  # attributions
SEQUENTIAL = "Viridis"
LIGHT_SEQUENTIAL = [[0.0, "#f7fbff"], [0.5, "#9ecae1"], [1.0, "#3182bd"]]  # black text stays readable on it
DIVERGING = "RdBu_r"  # blue below the midpoint, red above
IDLE = "#b0b0b0"  # experts that got no tokens: apart from the load scale, whose log has no value for them


# Ratios (load against uniform) are coloured on a log2 scale, so that 1/2 and 2 look equally far from 1.
RATIO_TICKS = dict(tickvals=[-4, -2, -1, 0, 1, 2, 4], ticktext=["1/16", "1/4", "1/2", "1", "2", "4", "16"])
_RATIOS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 2 / 3, 1, 1.5, 2, 4, 8, 16)


def ratio_ticks(bound: float) -> dict:
    """Colour-bar ticks for log2 ratios on a scale running from -bound to bound: the round ratios inside it, and its
    two ends, labelled as ratios (0.25, 0.5, 1, 2, ...), not as logs."""
    values = sorted({math.log2(r) for r in _RATIOS if abs(math.log2(r)) < bound * 0.9} | {-bound, bound})
    return dict(tickvals=values, ticktext=[f"{2 ** v:.2g}" for v in values])


LOG_AXIS = dict(type="log", dtick=1, exponentformat="power")  # decades only, no minor labels


def array(x: torch.Tensor | np.ndarray | Sequence) -> np.ndarray:
    """A float32 numpy copy of a tensor or sequence (plotly stores numpy arrays compactly, as base64)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    return np.asarray(x, dtype=np.float32)


def data(x: torch.Tensor | np.ndarray | Sequence, name: str, ndim: int | None = None) -> np.ndarray:
    """``array(x)`` for a figure's input ``name``, refusing what cannot be drawn: no values, another number of
    dimensions than ``ndim``, or something that is not numbers."""
    try:
        values = array(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be numbers (a tensor, array or list), got {type(x).__name__}") from None
    if ndim is not None and values.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension{'s' if ndim > 1 else ''}, got shape {list(values.shape)}")
    if values.size == 0:
        raise ValueError(f"{name} is empty (shape {list(values.shape)}): nothing to draw")
    return values


def series_of(series: object, name: str) -> None:
    """A figure's mapping of named series must hold at least one."""
    if not hasattr(series, "items"):
        raise TypeError(f"{name} must be a mapping {{name: values}}, got {type(series).__name__}")
    if not series:
        raise ValueError(f"{name} is empty: nothing to draw")


def same_length(values: np.ndarray | Sequence, labels: Sequence, values_name: str, labels_name: str,
                axis: int = 0) -> None:
    """Labels (tokens, layers) must name every row or column they label."""
    n = values.shape[axis] if isinstance(values, np.ndarray) else len(values)
    if len(labels) != n:
        raise ValueError(f"{labels_name} has {len(labels)} entries but {values_name} has {n} along that axis")


def log2_ratio(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """log2 of ratios, clipped to 1/16 .. 16, for colouring with RATIO_TICKS."""
    return np.log2(np.clip(array(x), 1 / 16, 16))


def finish(fig: go.Figure, title: str, *, height: int = 420, width: int | None = None,
           legend: bool | None = None, legend_below: bool = False) -> go.Figure:
    """Apply the lab's template, title and size; returns ``fig``. The legend runs along the top right, or below the
    plot (``legend_below``) where subplot titles would collide with it."""
    fig.update_layout(template=TEMPLATE, font=FONT, title=dict(text=title, x=0.01, xanchor="left"),
                      height=height, width=width, margin=dict(l=70, r=30, t=70, b=110 if legend_below else 60))
    if legend is not None:
        fig.update_layout(showlegend=legend)
    if legend_below:
        fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.2, xanchor="center", x=0.5))
    else:
        fig.update_layout(legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0))
    return fig


def reference_line(fig: go.Figure, y: float, text: str, *, row: int | None = None, col: int | None = None,
                   log: bool = False, position: str = "top left") -> None:
    """A dashed horizontal line with a label. On a log axis the label's y must be given in decades, which
    ``add_hline`` does not do by itself."""
    fig.add_hline(y=y, line=dict(color=GREY, dash="dash"), row=row, col=col, annotation_position=position,
                  annotation=dict(text=text, y=math.log10(y) if log else y, showarrow=False,
                                  font=dict(size=11, color="#444")))


def token_labels(tokens: Sequence[str], start: int = 0) -> list[str]:
    """Axis labels for tokens at positions start, start + 1, ...: visible whitespace, prefixed by the position so
    repeated tokens stay distinct."""
    return [f"{i}:{show_whitespace(t)}" for i, t in enumerate(tokens, start=start)]


def show_whitespace(text: str) -> str:
    """Spaces as '·', newlines as '↵', tabs as '→', so a token's boundaries can be seen."""
    return text.replace(" ", "·").replace("\n", "↵").replace("\t", "→")

