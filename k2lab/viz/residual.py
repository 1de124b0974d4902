"""The residual stream's size through the blocks: pre-norm blocks only add to it, so it grows."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import plotly.graph_objects as go
import torch

from .style import BLUE, GREEN, ORANGE, PURPLE, data, finish, series_of

_ADDED_COLOURS = (ORANGE, GREEN, PURPLE)


def residual_norm_figure(stream_rms: torch.Tensor, added: Mapping[str, torch.Tensor], title: str = "",
                         log_y: bool = True) -> go.Figure:
    """The residual stream's rms at every block boundary, against what each sublayer adds to it.

    ``stream_rms`` [L + 1, T]: each position's rms entering block 0 (the embeddings), ..., entering block L - 1, and
    after the last block. ``added`` {name: [L, T]}: the rms of each sublayer's output (attention, feed-forward) per
    block and position. Lines are the median over positions, bands span the positions' 10th to 90th percentile; the
    sublayers' outputs are drawn at the block that adds them, between its two boundaries."""
    stream = data(stream_rms, "stream_rms", 2)
    series_of(added, "added")
    L = stream.shape[0] - 1
    fig = go.Figure()

    def band(x: np.ndarray, values: np.ndarray, name: str, colour: str, dash: str | None = None) -> None:
        low, mid, high = np.percentile(values, [10, 50, 90], axis=1)
        fig.add_trace(go.Scatter(x=np.concatenate([x, x[::-1]]), y=np.concatenate([high, low[::-1]]), fill="toself",
                                 mode="lines", fillcolor=colour, opacity=0.18, line=dict(width=0), hoverinfo="skip",
                                 showlegend=False, legendgroup=name))
        fig.add_trace(go.Scatter(x=x, y=mid, name=name, mode="lines+markers", legendgroup=name,
                                 line=dict(color=colour, dash=dash)))

    band(np.arange(L + 1, dtype=float), stream, "residual stream", BLUE)
    for (name, values), colour in zip(added.items(), _ADDED_COLOURS, strict=False):
        values = data(values, f"added[{name!r}]", 2)
        if values.shape[0] != L:
            raise ValueError(f"added[{name!r}] has {values.shape[0]} blocks, stream_rms has {L} (L + 1 boundaries)")
        band(np.arange(L, dtype=float) + 0.5, values, f"{name} adds", colour, dash="dot")
    positive = np.concatenate([stream.ravel(), *[data(v, k, 2).ravel() for k, v in added.items()]])
    low, high = np.percentile(positive, 1) * 0.8, positive.max() * 1.25
    fig.update_xaxes(title_text=f"the stream entering block i (0: the embeddings; {L}: after the last block)",
                     tickvals=list(range(L + 1)), range=[-0.3, L + 0.3])
    if log_y:
        low = max(low, 1e-6)
        ticks = [m * 10.0**e for e in range(int(np.floor(np.log10(low))), int(np.ceil(np.log10(high))) + 1)
                 for m in (1, 2, 5) if low <= m * 10.0**e <= high]
        fig.update_yaxes(title_text="rms (log axis)", type="log", range=[np.log10(low), np.log10(high)],
                         tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])
    else:
        fig.update_yaxes(title_text="rms", range=[0, high])
    return finish(fig, title, height=420, legend=True)
