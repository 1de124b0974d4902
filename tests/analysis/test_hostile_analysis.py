"""Hostile inputs to interventions, routing metrics and accounting: each refused with an error naming the argument;
a refused intervention leaves the model's weights, hooks and logits as they were."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import MICRO, assert_refused_unchanged, micro_model

from k2lab import K2Config, K2Model
from k2lab.analysis import routing
from k2lab.analysis.accounting import block_parameters, count_parameters, kv_cache_bytes, weight_bytes
from k2lab.analysis.interventions import ablate_experts, edit_bias, force_route, patch

IDS = torch.tensor([[1, 2, 3, 4]])


@pytest.fixture(scope="module")
def model():
    return micro_model()


def run(model, intervention):
    with intervention, torch.no_grad():
        return model(IDS)


@pytest.mark.parametrize("make, error, named", [
    (lambda m: ablate_experts(m, {1: "12"}), TypeError, r"layer 1: experts must be an int or a list of ints, got '12'"),
    (lambda m: ablate_experts(m, {1: [3.7]}), TypeError, r"layer 1: expert ids must be integers, got \[3.7\]"),
    (lambda m: ablate_experts(m, {1: torch.tensor([1.0])}), TypeError, "layer 1: expert ids must be integers"),
    (lambda m: ablate_experts(m, {"1": [0]}), TypeError, "layer keys must be integers, got '1'"),
    (lambda m: ablate_experts(m, {1.0: [0]}), TypeError, "layer keys must be integers, got 1.0"),
    (lambda m: ablate_experts(m, {1: [4]}), ValueError, r"layer 1: expert ids \[4\] out of range 0..3"),
    (lambda m: ablate_experts(m, {5: [0]}), IndexError, "layer 5 out of range for 2 layers"),
    (lambda m: ablate_experts(m, {0: [0]}), ValueError, r"layer 0 has a dense MLP.*MoE layers: \[1\]"),
    (lambda m: ablate_experts(m, [1, 2]), TypeError, r"experts must be a mapping \{layer: \[expert, ...\]\}, got list"),
    (lambda m: ablate_experts(m, {1: [0]}, mode="drop"), ValueError, "mode must be one of"),
    (lambda m: force_route(m, {1: [0, 1, 2]}), ValueError, r"layer 1: force at most k=2 distinct experts"),
    (lambda m: force_route(m, {1: torch.zeros(1, 4, 3, dtype=torch.long)}), ValueError,
     r"layer 1: a route tensor gives k=2 experts per token in its last dim, got shape \(1, 4, 3\)"),
    (lambda m: force_route(m, {1: lambda idx, choice: None}), TypeError,
     "layers.1.mlp.gate.hook_topk_idx: the route function must return expert ids"),
    (lambda m: force_route(m, {1: [0]}, positions=[10]), IndexError, r"positions \[10\] out of range for 4 positions"),
    (lambda m: force_route(m, {1: [0]}, positions=-5), IndexError, r"positions \[-5\] out of range"),
    (lambda m: force_route(m, {1: [0]}, positions=slice(8, None)), ValueError, "select none of the 4 positions"),
    (lambda m: force_route(m, {1: [0]}, positions=[1.5]), TypeError, r"positions must be None, an int.*\[1.5\]"),
    (lambda m: force_route(m, {1: [0]}, positions="0"), TypeError, "positions must be None, an int"),
    (lambda m: edit_bias(m, {1: lambda b: None}), TypeError,
     "layer 1: the bias function returned None; a bias is a number or a tensor of shape"),
    (lambda m: edit_bias(m, {1: "zero"}), TypeError, "layer 1: the bias is 'zero'"),
    (lambda m: edit_bias(m, {1: float("nan")}), ValueError, "layer 1: bias must be finite"),
    (lambda m: edit_bias(m, {1: torch.zeros(3)}), ValueError, r"layer 1: bias must be a scalar or of shape \(4,\)"),
    (lambda m: edit_bias(m, {"1": 0.0}), TypeError, "layer keys must be integers"),
    (lambda m: patch(m, [1, 2], "layers.1.hook_resid_post"), TypeError, "source must be a mapping"),
    (lambda m: patch(m, m.run_with_cache(IDS)[1], "layers.1.hook_resid_post", positions=[9]), IndexError,
     r"positions \[9\] out of range for 4 positions"),
])
def test_a_bad_intervention_is_named_and_changes_nothing(model, make, error, named):
    assert_refused_unchanged(model, IDS, lambda m: run(m, make(m)), error, named)


@pytest.fixture(scope="module")
def trace(model):
    return routing.trace(model, IDS)


def no_layers(tr):
    return dataclasses.replace(tr, layers=[], **{f: getattr(tr, f)[:0] for f in (
        "indices", "weights", "scores", "choice_scores", "unbiased_indices", "bias_flips")})


def no_tokens(tr):
    return dataclasses.replace(tr, **{f: getattr(tr, f)[:, :, :0] for f in (
        "indices", "weights", "scores", "choice_scores", "unbiased_indices", "bias_flips")})


METRICS = [routing.expert_counts, routing.domain_specialization, routing.coactivation,
           routing.consecutive_same_expert_rate, routing.router_entropy,
           lambda tr: routing.vocabulary_specialization(tr, IDS)]


@pytest.mark.parametrize("metric", METRICS, ids=range(len(METRICS)))
@pytest.mark.parametrize("emptied, named", [(no_layers, "the routing trace has no MoE layer"),
                                            (no_tokens, r"the routing trace holds no tokens")])
def test_metrics_refuse_an_empty_trace(trace, metric, emptied, named):
    with pytest.raises(ValueError, match=named):
        metric(emptied(trace))


@pytest.mark.parametrize("call, error, named", [
    (lambda tr: routing.max_violation(torch.zeros(2, 4, dtype=torch.long)), ValueError,
     "counts hold a row with no routed tokens"),
    (lambda tr: routing.relative_load(torch.zeros(0, 4)), ValueError, "counts hold a row with no routed tokens"),
    (lambda tr: routing.load_fraction(torch.tensor([3, -1])), ValueError, "negative count"),
    (lambda tr: routing.max_violation(torch.tensor(5)), ValueError, r"counts must be expert counts \[..., E\]"),
    (lambda tr: routing.expert_counts(tr, top=3), ValueError, "top must be None or an integer in 1..k=2, got 3"),
    (lambda tr: routing.expert_counts(tr, top=0), ValueError, "top must be None or an integer in 1..k=2"),
    (lambda tr: routing.expert_counts("trace"), TypeError, "tr must be a RoutingTrace"),
    (lambda tr: routing.vocabulary_specialization(tr, torch.tensor([[1, 2]])), ValueError,
     r"token_ids must be integer ids aligned with the trace's \[B, T\] = \[1, 4\]"),
    (lambda tr: routing.vocabulary_specialization(tr, IDS).top_tokens(0, 1), ValueError,
     r"layer 0 is not a MoE layer of this trace; its layers: \[1\]"),
    (lambda tr: routing.consecutive_same_expert_rate(dataclasses.replace(tr, indices=tr.indices[:, :, :1])),
     ValueError, "needs sequences of 2 or more tokens"),
    (lambda tr: routing.consecutive_baseline(4, 5), ValueError, "1 <= top_k <= num_experts.*top_k=5"),
    (lambda tr: routing.router_entropy(tr, over="logits"), ValueError, "over must be 'scores' or 'weights'"),
])
def test_routing_metrics_name_a_bad_argument(trace, call, error, named):
    with pytest.raises(error, match=named):
        call(trace)


def test_a_dense_only_model_has_no_routing():
    dense = K2Model(MICRO.replace(first_k_dense_replace=2))
    with pytest.raises(ValueError, match="this model has no MoE layer"):
        routing.trace(dense, IDS)
    with pytest.raises(ValueError, match="this model has no MoE layer"):
        ablate_experts(dense, {0: [0]}).__enter__()


@pytest.mark.parametrize("kwargs, error, named", [
    ({"n_tokens": -5}, ValueError, "n_tokens must be an integer >= 0, got -5"),
    ({"n_tokens": 2.5}, ValueError, "n_tokens must be an integer >= 0, got 2.5"),
    ({"n_tokens": 8, "batch_size": -1}, ValueError, "batch_size must be an integer >= 0, got -1"),
    ({"n_tokens": 8, "dtype": "bf16"}, TypeError, "dtype must be a torch.dtype"),
    ({"n_tokens": 8, "layout": "dense"}, ValueError, "layout must be 'latent' or 'expanded'"),
])
def test_kv_cache_bytes_names_a_bad_argument(kwargs, error, named):
    with pytest.raises(error, match=named):
        kv_cache_bytes(K2Config.kimi_k2(), **kwargs)


@pytest.mark.parametrize("call, error, named", [
    (lambda: count_parameters({"hidden_size": 7168}), TypeError, "cfg must be a K2Config .*got dict"),
    (lambda: weight_bytes(K2Config.kimi_k2(), dtype="bf16"), TypeError, "dtype must be a torch.dtype"),
    (lambda: block_parameters(K2Config.kimi_k2(), 61), ValueError, r"layer must be an integer in 0..60, got 61"),
    (lambda: kv_cache_bytes("kimi", 8), TypeError, "cfg must be a K2Config"),
])
def test_accounting_names_a_bad_argument(call, error, named):
    with pytest.raises(error, match=named):
        call()
