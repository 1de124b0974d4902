"""k2lab.viz: figure builders checked through their figure dicts, explorers through their state (no browser)."""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
import pytest
import torch
from tiny import TINY, token_ids

from k2lab import K2Config, K2Model, routing, viz
from k2lab.model.rope import inverse_frequencies, yarn_ramp
from k2lab.tokenizer import Token

TOKENS = [f"t{i}" for i in range(7)]


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return token_ids(TINY, batch=1, length=len(TOKENS))  # one row, unlike conftest's [2, 7]


@pytest.fixture(scope="module")
def trace(model, ids) -> routing.RoutingTrace:
    with torch.no_grad():
        return routing.trace(model, ids)


def test_yarn_figure_shows_wavelengths_and_labels_lines_on_the_log_axis():
    k2 = K2Config.kimi_k2()
    fig = viz.yarn_figure(inverse_frequencies(k2.replace(rope_type=None)), inverse_frequencies(k2), yarn_ramp(k2),
                          4096, 131_072)
    rope, yarn, ramp = fig.data
    assert np.allclose(rope.y, 2 * math.pi / inverse_frequencies(k2.replace(rope_type=None)).numpy(), rtol=1e-5)
    assert np.allclose(yarn.y[20:] / rope.y[20:], 32, rtol=1e-4) and np.allclose(yarn.y[:20], rope.y[:20])
    assert list(ramp.y) == [0] * 20 + [1] * 12
    assert fig.layout.yaxis.type == "log"
    labels = {a.text: a.y for a in fig.layout.annotations}
    assert labels["original context: 4,096"] == pytest.approx(math.log10(4096))  # decades on a log axis


def test_pattern_and_score_split_figures_mask_the_future(model, ids):
    _, cache = model.run_with_cache(ids, names=".self_attn.")
    pattern = cache["layers.1.self_attn.hook_pattern"][0]  # [H, T, S]
    fig = viz.pattern_figure(pattern, TOKENS)
    assert len(fig.data) == TINY.num_attention_heads
    z = np.asarray(fig.data[0].z, dtype=float)
    assert np.isnan(z[0, 1]) and np.isclose(z[0, 0], 1.0) and fig.layout.coloraxis.cmax == 1
    content, position = torch.randn(7, 7), torch.randn(7, 7)
    split = viz.score_split_figure(content, position, TOKENS)
    total = np.asarray(split.data[2].z, dtype=float)
    assert np.isclose(total[3, 2], (content + position)[3, 2].item(), atol=1e-5) and np.isnan(total[2, 3])
    assert all(panel.zmid == 0 and panel.zmax == -panel.zmin for panel in split.data)  # each its own range


def test_router_token_figure_marks_the_choice_and_the_unbiased_choice(trace):
    j, t = 0, 3
    fig = viz.router_token_figure(trace.scores[j, 0, t], trace.choice_scores[j, 0, t] - trace.scores[j, 0, t],
                                  trace.indices[j, 0, t], trace.weights[j, 0, t],
                                  unbiased=trace.unbiased_indices[j, 0, t])
    scores, choice, unbiased, weights = fig.data
    chosen = set(trace.indices[j, 0, t].tolist())
    assert [i for i, c in enumerate(scores.marker.color) if c == viz.style.CHOSEN] == sorted(chosen)
    assert np.allclose(choice.y, trace.choice_scores[j, 0, t].numpy(), atol=1e-6)
    assert set(unbiased.x) == set(trace.unbiased_indices[j, 0, t].tolist())
    assert np.isclose(sum(weights.y), TINY.routed_scaling_factor, atol=1e-4)


def test_routing_heatmap_places_weights(trace):
    fig = viz.routing_heatmap(trace.indices[0, 0], trace.weights[0, 0], TINY.n_routed_experts, TOKENS)
    z = np.asarray(fig.data[0].z, dtype=float)  # [T, E]
    assert z.shape == (7, TINY.n_routed_experts)
    assert (~np.isnan(z)).sum(1).tolist() == [TINY.num_experts_per_tok] * 7
    e = int(trace.indices[0, 0, 2, 1])
    assert np.isclose(z[2, e], trace.weights[0, 0, 2, 1].item(), atol=1e-6)


def test_load_figure_colours_log2_of_the_relative_load(trace):
    rel = routing.relative_load(routing.expert_counts(trace))
    fig = viz.load_figure(rel, trace.layers)
    heat, bars = fig.data[0], fig.data[-1]
    busy = rel.numpy() > 0
    assert np.allclose(np.asarray(heat.z, dtype=float)[busy], np.log2(rel.numpy()[busy]), atol=1e-6)
    assert heat.zmid == 0 and "1" in heat.colorbar.ticktext
    assert np.allclose(bars.x, routing.max_violation(routing.expert_counts(trace)).numpy(), atol=1e-6)


def test_expert_summary_figures(trace):
    E, k = TINY.n_routed_experts, TINY.num_experts_per_tok
    shares = {"code": torch.rand(E), "prose": torch.rand(E)}
    fig = viz.specialization_figure(shares, uniform=k / E)
    order = [int(x) for x in fig.data[0].x]
    assert order == (shares["code"] - shares["prose"]).argsort(descending=True).tolist()
    bars = viz.layer_bars_figure({"a": torch.tensor([0.5, 0.25])}, [1, 2], "share", reference=0.1, percent=True)
    assert list(bars.data[0].y) == [50, 25] and bars.layout.shapes[0].y0 == pytest.approx(10)
    co = viz.coactivation_figure(routing.coactivation(trace)[0])
    assert co.data[0].z.shape == (E, E)
    entropy = routing.router_entropy(trace)  # [L_moe, B, T]
    ent = viz.entropy_figure({"s": entropy}, {"s": math.log(E)}, trace.layers)
    share = entropy.flatten(1) / math.log(E)
    assert np.allclose(ent.data[0].median, share.median(-1).values.numpy(), atol=1e-3)
    assert (np.asarray(ent.data[0].upperfence) <= 1 + 1e-6).all() and len(ent.data[0].x) == len(trace.layers)


def test_logit_figures():
    lens = viz.logit_lens_figure(torch.rand(2, 3), [["a", " b", "\n"], ["x", "y", "z"]], ["L0", "L1"], ["p", "q", "r"],
                                 start=5)
    assert lens.data[0].text[0] == ["a", "·b", "↵"]  # whitespace made visible
    assert list(lens.data[0].x) == ["5:p", "6:q", "7:r"]  # true positions of a slice
    attr = viz.attribution_figure(["up", "down"], torch.tensor([0.5, -0.25]))
    assert list(attr.data[0].marker.color) == [viz.style.POSITIVE, viz.style.NEGATIVE]
    effect = viz.effect_heatmap(torch.tensor([[0.0, 1.0], [-0.5, 0.2]]), ["L0", "L1"], ["a", "b"])
    assert effect.data[0].zmin == -1.0 and effect.data[0].zmax == 1.0


def test_training_figures():
    steps = list(range(30))
    loss = viz.loss_figure(steps, [3.0] * 30, [29], [1.5], unigram_bpb=2.6)
    assert np.allclose(loss.data[1].y, 3.0)  # the trailing mean starts at step 0
    max_logits = torch.full((30, 2, 3), 5.0)
    max_logits[10, 1, 2] = 40.0
    qk = viz.qk_clip_figure(steps, max_logits, tau=30.0)
    assert qk.data[0].z.shape == (6, 30) and list(qk.data[1].y).count(1) == 1
    bias = viz.expert_time_figure(steps, torch.randn(30, 4), "bias", zmid=0.0)
    assert bias.data[0].zmid == 0.0 and bias.data[0].z.shape == (4, 30)
    sv = viz.singular_values_figure({"g": torch.tensor([1.0, 0.1])})
    assert sv.layout.yaxis.type == "log"
    lines = viz.lines_figure(steps, {"MaxVio": {"layer 1": torch.zeros(30)}}, "step")
    assert lines.layout.yaxis.title.text == "MaxVio"


def test_parameter_figure():
    fig = viz.parameter_figure([("embedding", 10**9, 10**9), ("routed_experts", 10**12, 2 * 10**10)])
    assert list(fig.data[1].x) == [10**9, 2 * 10**10] and fig.layout.xaxis.type == "log"


def test_tokens_html_escapes_and_labels():
    html = viz.tokens_html([Token(7, "<b> x", 0, 4, b"<b> x"), Token(9, "\n", 4, 5, b"\n")], special_ids=[9])
    assert "&lt;b&gt;·x" in html and ">7<" in html and "9*" in html and "↵" in html
    assert "<b>" not in html


# ---- explorers ---------------------------------------------------------------------------------------------------
def test_router_explorer_follows_its_controls(trace):
    ex = viz.widgets.router_explorer(trace, TOKENS)
    assert isinstance(ex.figure, go.Figure) and ex.error is None
    assert "token 6" in ex.figure.layout.title.text and ex.output.outputs  # something is shown
    ex.controls["position"].value = 2
    ex.controls["layer"].value = trace.layers[-1]
    assert ex.state == {"layer": trace.layers[-1], "position": 2}
    assert f"layer {trace.layers[-1]}, token 2" in ex.figure.layout.title.text
    j = trace.row(trace.layers[-1])
    assert np.allclose(ex.figure.data[0].y, trace.scores[j, 0, 2].numpy(), atol=1e-6)


def test_yarn_explorer_redraws_and_reports_errors_instead_of_swallowing_them():
    ex = viz.widgets.yarn_explorer(K2Config.kimi_k2())
    assert list(ex.figure.data[2].y).count(1) == 12
    ex.controls["beta_fast"].value = 32.0  # the YaRN paper's default: a wider ramp
    ramp = np.asarray(ex.figure.data[2].y)
    assert ex.error is None and ((ramp > 0) & (ramp < 1)).any()
    good = ex.figure
    ex.render = lambda **state: 1 / 0
    ex.controls["factor"].value = 8.0
    assert ex.error == "ZeroDivisionError: division by zero" and ex.figure is good
    assert "ZeroDivisionError" in ex.output.outputs[0]["data"]["text/html"]


def test_routing_and_attention_explorers(model, ids, trace):
    ex = viz.widgets.routing_explorer(trace, TOKENS)
    ex.controls["layer"].value = trace.layers[1]
    assert ex.figure.layout.title.text == f"Routing at layer {trace.layers[1]}"
    _, cache = model.run_with_cache(ids, names="hook_pattern")
    att = viz.widgets.attention_explorer(cache.stack("hook_pattern")[:, 0], TOKENS)
    att.controls["layer"].value = 2
    assert "layer 2" in att.figure.layout.title.text and len(att.figure.data) == TINY.num_attention_heads


def test_token_explorer_counts_tokens():
    from k2lab.lab import NANO_DIR
    from k2lab.tokenizer import load_tokenizer

    tok = load_tokenizer(NANO_DIR)
    ex = viz.widgets.token_explorer(tok, "x = 1")
    assert f"{len(tok.encode('x = 1'))} tokens" in ex.figure
    ex.controls["text"].value = "hi<|im_end|>"
    assert "7938*" in ex.figure  # the special id, starred
    ex.controls["allow_special"].value = False
    assert "7938" not in ex.figure


def test_cache_logit_lens_figure_matches_the_hand_built_one():
    model = K2Model(K2Config.mini().replace(vocab_size=64, num_hidden_layers=2))
    ids = torch.arange(20)[None]
    _, cache = model.run_with_cache(ids)
    tokens = [str(i) for i in range(20)]
    fig = viz.cache_logit_lens_figure(cache, str, tokens)
    p_top, i_top = cache.logit_lens(pos=slice(-16, None))[:, 0].softmax(-1).max(-1)
    heat = fig.data[0]
    assert len(heat.y) == 2 and len(heat.x) == 16
    np.testing.assert_allclose(np.asarray(heat.z), p_top.numpy(), rtol=1e-6)
    assert [list(r) for r in heat.text][0][0].strip() == str(i_top[0, 0].item())
