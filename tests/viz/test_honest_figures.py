"""The figures fixed for honesty: colour ranges fitted to the data with idle experts apart, every clipped step
counted, labels with room, and bars that say how much of the whole a part is."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from k2lab import viz


def test_load_figure_fits_the_colour_range_to_the_data_and_marks_idle_experts_apart():
    rel = torch.tensor([[0.0, 0.5, 1.0, 2.5], [1.0, 1.0, 0.8, 1.2]])
    fig = viz.load_figure(rel, [1, 2])
    heat, idle, bars = fig.data
    z = np.asarray(heat.z, dtype=float)
    assert np.isnan(z[0, 0])  # idle: not clipped to the bottom colour ...
    assert np.asarray(idle.z, dtype=float)[0, 0] == 1 and np.isnan(np.asarray(idle.z, dtype=float)[0, 1])  # ... grey
    assert heat.zmax == pytest.approx(math.log2(2.5)) and heat.zmin == pytest.approx(-math.log2(2.5))
    assert heat.colorbar.ticktext[-1] == "2.5" and heat.colorbar.ticktext[0] == "0.4"
    assert list(bars.x) == pytest.approx([1.5, 0.2])


def test_load_figure_without_idle_experts_has_no_grey_layer():
    fig = viz.load_figure(torch.tensor([[0.9, 1.1]]), [1])
    assert len(fig.data) == 2 and fig.data[0].zmax == pytest.approx(0.25)  # the floor keeps a visible range


def test_qk_clip_figure_counts_clipped_heads_at_every_step_while_thinning_the_heatmap():
    steps = list(range(1000))
    max_logits = torch.full((1000, 2, 2), 5.0)
    max_logits[[3, 501, 998], 0, 1] = 40.0  # steps that a heatmap of every 5th step would skip
    fig = viz.qk_clip_figure(steps, max_logits, tau=30.0, max_columns=200)
    heat, line = fig.data
    assert len(heat.x) == 200 and list(line.x) == steps
    assert int(np.asarray(line.y).sum()) == 3


def test_bias_flip_figure_labels_each_bar_and_keeps_its_axis_title_short():
    fig = viz.bias_flip_figure(torch.tensor([1.0, 0.875, 0.75]), [1, 2, 3])
    assert list(fig.data[0].text) == ["100%", "88%", "75%"]
    assert len(fig.layout.yaxis.title.text) <= 20 and fig.layout.yaxis.range[1] > 100


def test_parameter_figure_gives_shares_on_a_linear_axis_and_room_for_the_largest_label():
    rows = [("embedding", 10**9, 10**9), ("routed_experts", 99 * 10**9, 2 * 10**9)]
    fig = viz.parameter_figure(rows)
    log_total, log_active, share_total, share_active = fig.data
    assert list(share_total.x) == pytest.approx([1.0, 99.0])
    assert list(share_active.x) == pytest.approx([100 / 3, 200 / 3])
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis.range[1] > math.log10(99 * 10**9) + 0.5
    assert fig.layout.xaxis2.type != "log"


def test_score_split_figure_names_the_rotary_part_and_gives_each_panel_its_range():
    content, rotary = 0.01 * torch.randn(5, 5), torch.randn(5, 5)
    fig = viz.score_split_figure(content, rotary, list("abcde"))
    titles = [a.text for a in fig.layout.annotations]
    assert any(t.startswith("rotary part") for t in titles) and not any("position" in t for t in titles)
    assert fig.data[0].zmax < 0.1 < fig.data[1].zmax  # the small content term keeps visible colours


def test_effect_heatmap_names_non_position_columns():
    fig = viz.effect_heatmap(torch.tensor([[0.1, -0.7]]), ["layer 4"], ["head 0", "head 1"], x_title="head zeroed")
    assert list(fig.data[0].x) == ["head 0", "head 1"] and fig.layout.xaxis.title.text == "head zeroed"
    by_position = viz.effect_heatmap(torch.tensor([[0.1, -0.7]]), ["layer 4"], ["a", "b"])
    assert list(by_position.data[0].x) == ["0:a", "1:b"] and by_position.layout.xaxis.title.text == "position"


def test_router_token_figure_draws_each_weight_one_expert_wide():
    scores, bias = torch.rand(16), torch.zeros(16)
    fig = viz.router_token_figure(scores, bias, torch.tensor([1, 9]), torch.tensor([1.5, 1.3]))
    assert fig.data[-1].width == 0.8  # sparse bars would otherwise widen to fill the gaps between experts
