"""The router, expert and training figures of the course's second half, as fixed for issue #39: colour scales that
show what they claim (QK-Clip's logits above tau, the relative load's fitted range with idle experts apart) and a
router figure still readable at K2's 384 experts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from k2lab import viz


def test_qk_clip_heatmap_reaches_the_largest_logit_and_marks_tau():
    max_logits = torch.full((50, 2, 2), 10.0)
    max_logits[7, 1, 0] = 41.0  # one head above tau
    heat = viz.qk_clip_figure(list(range(50)), max_logits, tau=30.0).data[0]
    assert heat.zmax == pytest.approx(41.0) and heat.zmin == 0
    assert "τ=30" in heat.colorbar.ticktext and 30.0 in heat.colorbar.tickvals
    below = viz.qk_clip_figure(list(range(50)), torch.full((50, 2, 2), 10.0), tau=30.0).data[0]
    assert below.zmax == pytest.approx(30.0)  # never below tau: a head at 10 stays visibly far from it


def test_expert_time_figure_fits_the_ratio_scale_and_draws_idle_experts_apart():
    load = torch.ones(20, 4)
    load[:, 0], load[:, 1], load[3, 2] = 2.0, 0.5, 0.0
    fig = viz.expert_time_figure(list(range(20)), load, "load", log2=True)
    heat, idle = fig.data
    assert heat.zmax == pytest.approx(1.0) and heat.zmin == pytest.approx(-1.0)  # 0.5 .. 2, not 1/16 .. 16
    z = np.asarray(heat.z, dtype=float)
    assert math.isnan(z[2, 3]) and np.asarray(idle.z, dtype=float)[2, 3] == 1
    assert "2" in heat.colorbar.ticktext and "0.5" in heat.colorbar.ticktext


def test_expert_time_figure_centres_a_diverging_scale_on_the_data():
    spread = torch.tensor([[0.1, -0.1], [0.3, -0.2]])
    heat = viz.expert_time_figure([0, 1], spread, "bias − mean", zmid=0.0).data[0]
    assert heat.zmid == 0.0 and heat.zmax == pytest.approx(0.3) and heat.zmin == pytest.approx(-0.3)


def test_router_figure_at_384_experts_marks_the_chosen_and_keeps_the_weights_visible():
    E = 384
    chosen = torch.tensor([3, 50, 100, 200, 250, 300, 350, 383])
    fig = viz.router_token_figure(torch.rand(E), torch.zeros(E), chosen, torch.rand(8))
    names = [trace.name for trace in fig.data]
    assert "chosen" in names
    assert fig.data[-1].width > 1  # the weights' bars: wider than one expert among 384
    small = viz.router_token_figure(torch.rand(16), torch.zeros(16), torch.tensor([1, 9]), torch.rand(2))
    assert "chosen" not in [trace.name for trace in small.data]


def test_routing_heatmap_drops_the_column_gap_for_hundreds_of_experts():
    idx, w = torch.randint(0, 384, (5, 8)), torch.rand(5, 8)
    assert viz.routing_heatmap(idx, w, 384, list("abcde")).data[0].xgap == 0
    assert viz.routing_heatmap(idx % 32, w, 32, list("abcde")).data[0].xgap == 1


def test_lines_figure_keeps_one_colour_per_series_across_panels():
    fig = viz.lines_figure([0, 1, 2], {"loss": {"a": [3, 2, 1], "b": [3, 2, 1.5]},
                                       "logit": {"a": [0, 1, 2], "b": [0, 2, 4]}}, "step")
    colour = {}
    for trace in fig.data:
        assert colour.setdefault(trace.name, trace.line.color) == trace.line.color
    assert colour["a"] != colour["b"]
