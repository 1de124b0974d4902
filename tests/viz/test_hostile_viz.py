"""Hostile inputs to the figures and explorers: empty or mismatched inputs raise an error naming the argument
instead of drawing an empty or misleading figure."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import MICRO

from k2lab import K2Model, viz
from k2lab.analysis import routing

E0 = torch.zeros(0)
TOKENS = ["a", "b", "c"]


@pytest.mark.parametrize("draw, error, named", [
    (lambda: viz.pattern_figure(torch.zeros(0, 3, 3), TOKENS), ValueError, r"pattern is empty \(shape \[0, 3, 3\]\)"),
    (lambda: viz.pattern_figure(torch.zeros(3, 3), TOKENS), ValueError, "pattern must have 3 dimensions"),
    (lambda: viz.pattern_figure(torch.zeros(2, 3, 3), ["a"]), ValueError, "tokens has 1 entries but pattern"),
    (lambda: viz.score_split_figure(torch.zeros(0, 0), torch.zeros(0, 0), []), ValueError, "content is empty"),
    (lambda: viz.score_split_figure(torch.zeros(3, 3), torch.zeros(2, 3), TOKENS), ValueError,
     "content and rotary must share a shape"),
    (lambda: viz.load_figure(torch.zeros(0, 4), []), ValueError, "relative_load is empty"),
    (lambda: viz.load_figure(torch.ones(2, 4), [1]), ValueError, "layers has 1 entries but relative_load"),
    (lambda: viz.specialization_figure({}, 0.1), ValueError, "shares is empty"),
    (lambda: viz.specialization_figure({"code": E0}, 0.1), ValueError, r"shares\['code'\] is empty"),
    (lambda: viz.layer_bars_figure({}, [], "rate"), ValueError, "series is empty"),
    (lambda: viz.layer_bars_figure({"x": torch.ones(2)}, [1, 2, 3], "rate"), ValueError, "layers has 3 entries"),
    (lambda: viz.coactivation_figure(torch.zeros(0, 0)), ValueError, "coactivation is empty"),
    (lambda: viz.entropy_figure({}, {}, []), ValueError, "entropies is empty"),
    (lambda: viz.entropy_figure({"scores": torch.ones(2, 5)}, {}, [1, 2]), ValueError,
     r"maxima\['scores'\] must be the entropy's maximum"),
    (lambda: viz.lines_figure([], {}, "x"), ValueError, "panels is empty"),
    (lambda: viz.lines_figure([1, 2], {"p": {"a": [1.0]}}, "x"), ValueError,
     r"x has 2 entries but panels\['p'\]\['a'\] has 1"),
    (lambda: viz.lines_figure([1], {"p": {"a": ["one"]}}, "x"), TypeError, r"panels\['p'\]\['a'\] must be numbers"),
    (lambda: viz.logit_lens_figure(torch.zeros(0, 3), [], [], TOKENS), ValueError, "probs is empty"),
    (lambda: viz.attribution_figure([], E0), ValueError, "values is empty"),
    (lambda: viz.attribution_figure(["a", "b"], torch.ones(3)), ValueError, "labels has 2 entries but values"),
    (lambda: viz.effect_heatmap(torch.zeros(0, 3), [], TOKENS), ValueError, "effect is empty"),
    (lambda: viz.router_token_figure(E0, E0, E0, E0), ValueError, "scores is empty"),
    (lambda: viz.router_token_figure(torch.ones(4), torch.ones(3), torch.tensor([0]), torch.ones(1)), ValueError,
     "scores has 4 entries but bias has 3"),
    (lambda: viz.routing_heatmap(torch.zeros(0, 2), torch.zeros(0, 2), 4, []), ValueError, "indices is empty"),
    (lambda: viz.routing_heatmap(torch.tensor([[5, 1]]), torch.ones(1, 2), 4, ["a"]), ValueError,
     r"indices must be expert ids in 0..num_experts - 1 = 3"),
    (lambda: viz.bias_flip_figure(E0, []), ValueError, "flip_share is empty"),
    (lambda: viz.loss_figure([], [], [], []), ValueError, "loss is empty"),
    (lambda: viz.loss_figure([0, 1], [1.0, 2.0], [1], []), ValueError, "eval_steps has 1 entries but eval_bpb has 0"),
    (lambda: viz.qk_clip_figure([], torch.zeros(0, 2, 2), 30.0), ValueError, "max_logits is empty"),
    (lambda: viz.expert_time_figure([], torch.zeros(0, 4), "bias"), ValueError, "values is empty"),
    (lambda: viz.singular_values_figure({}), ValueError, "series is empty"),
    (lambda: viz.yarn_figure(E0, E0, E0, 4096), ValueError, "base_inv_freq is empty"),
    (lambda: viz.yarn_figure(torch.ones(4), torch.ones(3), torch.ones(4), 4096), ValueError,
     "base_inv_freq has 4 entries but scaled_inv_freq has 3"),
    (lambda: viz.parameter_figure([]), ValueError, "rows must be .component, total, active. triples"),
    (lambda: viz.widgets.attention_explorer(torch.zeros(0, 2, 3, 3), TOKENS), ValueError,
     r"patterns must be \[L, H, T, S\] with something in it"),
])
def test_a_figure_names_an_empty_or_mismatched_input(draw, error, named):
    with pytest.raises(error, match=named):
        draw()


@pytest.fixture(scope="module")
def trace():
    return routing.trace(K2Model(MICRO), torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("explore, named", [
    (lambda tr: viz.widgets.router_explorer(tr, ["a"]), "tokens has 1 entries but the trace has 3 positions"),
    (lambda tr: viz.widgets.routing_explorer(tr, TOKENS, row=1), r"row must be a batch row of the trace, 0..0, got 1"),
    (lambda tr: viz.widgets.routing_explorer(dataclasses.replace(tr, layers=[], indices=tr.indices[:0]), TOKENS),
     "the routing trace is empty"),
])
def test_an_explorer_names_a_bad_trace_or_tokens(trace, explore, named):
    with pytest.raises(ValueError, match=named):
        explore(trace)


def test_empty_text_draws_no_token_spans():
    """No tokens is a valid answer for an empty text: the HTML is an empty row, not an error."""
    assert viz.spans_html([]) == '<div style="line-height:1.9"></div>'
