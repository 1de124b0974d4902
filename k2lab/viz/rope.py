"""RoPE and YaRN: each rotary pair's wavelength before and after scaling, and YaRN's ramp."""

from __future__ import annotations

import math

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .style import BLUE, GREY, LOG_AXIS, ORANGE, array, data, finish, reference_line, same_length


def yarn_figure(base_inv_freq: torch.Tensor, scaled_inv_freq: torch.Tensor, ramp: torch.Tensor,
                original_context: int, max_context: int | None = None, title: str = "") -> go.Figure:
    """Two panels over the rotary pairs i = 0 .. R/2 - 1:

    - wavelength_i = 2 pi / theta_i in positions (log scale), plain RoPE against YaRN, with the original context
      (4,096 for K2) and the extended one marked: a pair whose wavelength exceeds the original context never
      completed a turn in pretraining;
    - YaRN's ramp gamma_i: 0 keeps theta_i, 1 divides it by the factor s:
      theta'_i = theta_i ((1 - gamma_i) + gamma_i / s).

    ``base_inv_freq``, ``scaled_inv_freq``, ``ramp``: [R/2] (from ``k2lab.model.rope``: inverse_frequencies, yarn_ramp).
    """
    base_inv_freq = data(base_inv_freq, "base_inv_freq", 1)
    for name, values in (("scaled_inv_freq", scaled_inv_freq), ("ramp", ramp)):
        same_length(data(values, name, 1), base_inv_freq, name, "base_inv_freq")
    if (base_inv_freq <= 0).any() or (array(scaled_inv_freq) <= 0).any():
        raise ValueError("base_inv_freq and scaled_inv_freq must be positive frequencies")
    pairs = list(range(len(base_inv_freq)))
    base, scaled = 2 * math.pi / array(base_inv_freq), 2 * math.pi / array(scaled_inv_freq)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.68, 0.32], vertical_spacing=0.08)
    fig.add_trace(go.Scatter(x=pairs, y=base, name="RoPE wavelength", mode="lines+markers",
                             line=dict(color=GREY, dash="dot")), row=1, col=1)
    fig.add_trace(go.Scatter(x=pairs, y=scaled, name="YaRN wavelength", mode="lines+markers",
                             line=dict(color=BLUE)), row=1, col=1)
    for context, label in ((original_context, "original context"), (max_context, "extended context")):
        if context:
            reference_line(fig, context, f"{label}: {context:,}", row=1, col=1, log=True)
    fig.add_trace(go.Bar(x=pairs, y=array(ramp), name="ramp γ (1 = divided by the factor)", marker_color=ORANGE),
                  row=2, col=1)
    fig.update_yaxes(title_text="wavelength (positions)", **LOG_AXIS, row=1, col=1)
    fig.update_yaxes(title_text="ramp γ", range=[0, 1.05], row=2, col=1)
    fig.update_xaxes(title_text="rotary pair i (fast → slow)", dtick=4, row=2, col=1)
    return finish(fig, title or "RoPE wavelengths per rotary pair, before and after YaRN", height=560)
