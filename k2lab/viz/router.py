"""The router, one token at a time and one prompt at a time: scores, bias, choice, weights, flips."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .style import BIAS, CHOSEN, NOT_CHOSEN, ORANGE, SEQUENTIAL, array, data, finish, same_length, token_labels


def router_token_figure(scores: torch.Tensor, bias: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                        logits: torch.Tensor | None = None, unbiased: torch.Tensor | None = None,
                        title: str = "") -> go.Figure:
    """One token's trip through K2's router, one panel per stage, experts on the x axis:

    1. logits = x . W_gate (if given);
    2. s = sigmoid(logits) as bars, and the choice score s + b as diamonds: top-k of the CHOICE picks the experts
       (filled bars); hollow circles mark experts the token would have had without the bias (``unbiased``);
    3. the weights of the chosen experts, w = s[idx] / sum s[idx] * routed_scaling_factor: the bias is not in them.

    ``scores``, ``bias``, ``logits``: [E]; ``chosen``, ``weights``, ``unbiased``: [k]."""
    scores, bias = data(scores, "scores", 1), data(bias, "bias", 1)
    same_length(bias, scores, "bias", "scores")
    E = len(scores)
    chosen = _expert_ids(chosen, "chosen", E)
    if len(chosen) != len(data(weights, "weights", 1)):
        raise ValueError(f"chosen and weights must both hold the k chosen experts, got {len(chosen)} and "
                         f"{len(weights)}")
    experts = np.arange(E)
    is_chosen = np.zeros(E, dtype=bool)
    is_chosen[chosen] = True
    colors = np.where(is_chosen, CHOSEN, NOT_CHOSEN)
    rows = 3 if logits is not None else 2
    names = (["router logits"] if logits is not None else []) + [
        "sigmoid score s (bars) and choice score s + bias (◆)", "weights of the chosen experts"]
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, subplot_titles=names, vertical_spacing=0.09)
    row = 1
    if logits is not None:
        fig.add_trace(go.Bar(x=experts, y=array(logits), marker_color=colors, name="logit", showlegend=False,
                             hovertemplate="expert %{x}<br>logit %{y:.3f}<extra></extra>"), row=row, col=1)
        fig.update_yaxes(title_text="logit", row=row, col=1)
        row += 1
    s, b = array(scores), array(bias)
    fig.add_trace(go.Bar(x=experts, y=s, marker_color=colors, name="score s (filled: chosen)",
                         hovertemplate="expert %{x}<br>s %{y:.3f}<extra></extra>"), row=row, col=1)
    many = E > 64  # K2's 384 experts: smaller markers, so that neighbours do not cover each other
    fig.add_trace(go.Scatter(x=experts, y=s + b, mode="markers",
                             marker=dict(symbol="diamond", color=BIAS, size=4 if many else 7),
                             name="choice score s + bias", customdata=b,
                             hovertemplate="expert %{x}<br>s + b %{y:.3f}<br>bias %{customdata:.3f}<extra></extra>"),
                  row=row, col=1)
    if unbiased is not None:
        u = _expert_ids(unbiased, "unbiased", E)
        fig.add_trace(go.Scatter(x=u, y=s[u], mode="markers", name="top-k without the bias",
                                 marker=dict(symbol="circle-open", color=ORANGE, size=12, line=dict(width=2))),
                      row=row, col=1)
    if many:  # a bar one expert wide is a hairline among 384: mark the chosen experts' s as well
        fig.add_trace(go.Scatter(x=chosen, y=s[chosen], mode="markers", name="chosen",
                                 marker=dict(symbol="circle", color=CHOSEN, size=8)), row=row, col=1)
    fig.update_yaxes(title_text="score", row=row, col=1)
    fig.add_trace(go.Bar(x=chosen, y=array(weights), marker_color=CHOSEN, name="weight",
                         width=max(0.8, E / 128), showlegend=False,  # one expert wide, or visible among hundreds
                         hovertemplate="expert %{x}<br>weight %{y:.3f}<extra></extra>"),
                  row=row + 1, col=1)
    fig.update_yaxes(title_text="weight", row=row + 1, col=1)
    fig.update_xaxes(title_text="expert", row=row + 1, col=1)
    fig.update_xaxes(range=[-0.7, E - 0.3])
    return finish(fig, title or "One token through the router", height=240 + 190 * rows, legend_below=True)


def _expert_ids(ids: torch.Tensor | Sequence[int], name: str, num_experts: int) -> np.ndarray:
    """[k] expert ids as ints, each one a bar of the figure: 0 .. num_experts - 1 (the length of ``scores``)."""
    values = data(ids, name, 1)
    wrong = values[(values != values.round()) | (values < 0) | (values >= num_experts)]
    if wrong.size:
        raise ValueError(f"{name} must hold expert ids in 0..{num_experts - 1} (scores holds {num_experts} experts); "
                         f"got {wrong[0]:g} in {name}")
    return values.astype(int)


def routing_heatmap(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, tokens: Sequence[str],
                    title: str = "") -> go.Figure:
    """Tokens (rows) against experts (columns) for one layer: the weight each chosen expert got, blank elsewhere.
    ``indices``, ``weights``: [T, k]."""
    idx = data(indices, "indices", 2).astype(int)
    if data(weights, "weights", 2).shape != idx.shape:
        raise ValueError(f"weights must match indices [T, k] = {list(idx.shape)}, got {list(array(weights).shape)}")
    if (idx < 0).any() or (idx >= num_experts).any():
        raise ValueError(f"indices must be expert ids in 0..num_experts - 1 = {num_experts - 1}")
    same_length(idx, tokens, "indices [T, k]", "tokens")
    dense = np.full((idx.shape[0], num_experts), np.nan)
    np.put_along_axis(dense, idx, array(weights), axis=1)
    labels = token_labels(tokens)
    gap = 1 if num_experts <= 64 else 0  # a 1-pixel gap between 384 columns would leave no colour to see
    fig = go.Figure(go.Heatmap(z=dense, x=list(range(num_experts)), y=labels, colorscale=SEQUENTIAL, zmin=0,
                               colorbar=dict(title="weight"), xgap=gap, ygap=1,
                               hovertemplate="token %{y}<br>expert %{x}<br>weight %{z:.3f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", title_text="token", dtick=1)
    fig.update_xaxes(title_text="expert")
    return finish(fig, title or "Which experts each token chose", height=max(320, 120 + 18 * len(tokens)))


def bias_flip_figure(flip_share: torch.Tensor, layers: Sequence[int], title: str = "") -> go.Figure:
    """Per MoE layer, the share of tokens whose chosen SET the correction bias changed (at least one of their k
    experts differs from the top-k of s alone). ``flip_share``: [L_moe]."""
    flip_share = data(flip_share, "flip_share", 1)
    same_length(flip_share, layers, "flip_share", "layers")
    share = 100 * flip_share
    fig = go.Figure(go.Bar(x=[str(layer) for layer in layers], y=share, marker_color=BIAS,
                           text=[f"{v:.0f}%" for v in share], textposition="outside", cliponaxis=False,
                           hovertemplate="layer %{x}<br>%{y:.1f}% of tokens<extra></extra>"))
    fig.update_xaxes(title_text="MoE layer", type="category")
    fig.update_yaxes(title_text="tokens flipped (%)", range=[0, 112], tickvals=[0, 25, 50, 75, 100])
    return finish(fig, title or "Tokens whose experts the correction bias changed", height=380, legend=False)
