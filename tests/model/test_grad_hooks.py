"""Gradients through probes: bwd_hooks see and replace the gradient torch.autograd.grad computes,
run_with_cache(incl_bwd=True) stores it, attribution_patch estimates patching to first order, and the routing paths
carry gradient through the weights but not through the top-k choice."""

from __future__ import annotations

import pytest
import torch
from tiny import TINY

from k2lab import K2Model
from k2lab.analysis.interventions import attribution_patch


def keeper(store: dict):
    """A hook that keeps the probe's tensor (or gradient) under its name."""

    def keep(tensor, hook):
        store[hook.name] = tensor

    return keep


def live_activation(model: K2Model, ids: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, the probe's activation in its graph), for torch.autograd.grad."""
    kept = {}
    with model.hooks(fwd_hooks=[(name, keeper(kept))]):
        loss = model(ids, return_type="loss")
    return loss, kept[name]


# hook_pattern and hook_attn_scores: made only when something watches them (the fused attention kernel makes neither);
# a gradient hook alone must make them too.
@pytest.mark.parametrize("name", ["layers.1.hook_resid_mid", "layers.2.self_attn.hook_z", "embed_tokens.hook_out",
                                  "layers.2.mlp.gate.hook_topk_weights", "layers.2.self_attn.hook_pattern",
                                  "layers.2.self_attn.hook_attn_scores"])
def test_bwd_hook_sees_the_autograd_gradient(model, ids, name):
    loss, act = live_activation(model, ids, name)
    (expected,) = torch.autograd.grad(loss, act)
    seen = {}
    with model.hooks(bwd_hooks=[(name, keeper(seen))]):
        model(ids, return_type="loss").backward()
    model.zero_grad(set_to_none=True)
    assert torch.allclose(seen[name], expected, rtol=1e-5, atol=1e-9)


def test_bwd_hook_replacement_changes_what_flows_upstream(model, ids):
    weight = model.embed_tokens.weight
    (plain,) = torch.autograd.grad(model(ids, return_type="loss"), weight)
    with model.hooks(bwd_hooks=[("norm.hook_out", lambda g, hook: 2 * g)]):
        (doubled,) = torch.autograd.grad(model(ids, return_type="loss"), weight)
    assert torch.allclose(doubled, 2 * plain, rtol=1e-5, atol=1e-9)


def test_bwd_hooks_act_only_inside_their_block(model, ids):
    calls = []
    with model.hooks(bwd_hooks=[("layers.1.hook_resid_post", lambda g, hook: calls.append(1))]):
        loss = model(ids, return_type="loss")
    loss.backward()  # after the block: the hook is gone
    model.zero_grad(set_to_none=True)
    assert calls == []


def test_run_with_cache_stores_gradients_and_leaves_parameters_alone(model, ids):
    loss, cache = model.run_with_cache(ids, names=["hook_resid_post", "layers.1.mlp.gate."], incl_bwd=True,
                                       return_type="loss")
    assert all(p.grad is None for p in model.parameters())
    ref_loss, act = live_activation(model, ids, "layers.1.hook_resid_post")
    (expected,) = torch.autograd.grad(ref_loss, act)
    assert torch.allclose(cache["layers.1.hook_resid_post_grad"], expected, rtol=1e-5, atol=1e-9)
    assert not cache["layers.1.hook_resid_post_grad"].requires_grad
    # Routing: the weights carry gradient to the scores and logits of the chosen experts only; the choice
    # (choice scores -> top-k indices, where the correction bias acts) carries none.
    gate = "layers.1.mlp.gate."
    assert gate + "hook_topk_weights_grad" in cache and gate + "hook_scores_grad" in cache
    assert gate + "hook_choice_scores_grad" not in cache and gate + "hook_topk_idx_grad" not in cache
    chosen = torch.zeros_like(cache[gate + "hook_scores"], dtype=torch.bool).scatter_(-1, cache[gate + "hook_topk_idx"],
                                                                                       True)
    assert (cache[gate + "hook_scores_grad"][~chosen] == 0).all()
    scored = chosen[:, :-1]  # the last position predicts nothing the loss scores: its gradient is 0
    assert (cache[gate + "hook_logits_grad"][:, :-1][scored] != 0).all()
    with pytest.raises(ValueError, match="incl_bwd=True differentiates a scalar output.*\\(2, 7, 512\\)"):
        model.run_with_cache(ids, names="hook_resid_post", incl_bwd=True)


def test_run_with_cache_differentiates_a_metric_of_the_output(model, ids):
    """With ``metric=``, the gradients stored are those of metric(output) (here a logit difference), as
    torch.autograd.grad gives them, and the output returned is the forward's own."""
    name = "layers.2.hook_resid_mid"

    def metric(logits):
        return (logits[:, -1, 5] - logits[:, -1, 9]).sum()

    logits, cache = model.run_with_cache(ids, names=name, incl_bwd=True, metric=metric)
    kept = {}
    with model.hooks(fwd_hooks=[(name, keeper(kept))]):
        (expected,) = torch.autograd.grad(metric(model(ids)), kept[name])
    torch.testing.assert_close(cache[name + "_grad"], expected, rtol=1e-5, atol=1e-9)
    assert logits.shape == (2, 7, TINY.vocab_size) and all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match=r"differentiates metric\(output\).*the metric returned \(2,\)$"):
        model.run_with_cache(ids, names=name, incl_bwd=True, metric=lambda logits: logits[:, -1, 5])
    with pytest.raises(ValueError, match=r"the metric returned \(\), which does not depend on the model"):
        model.run_with_cache(ids, names=name, incl_bwd=True, metric=lambda logits: torch.tensor(1.0))
    with pytest.raises(ValueError, match="without incl_bwd there is no gradient"):
        model.run_with_cache(ids, names=name, metric=metric)


def test_router_logit_gradient_matches_a_finite_difference(model, ids):
    """The gradient through the routing weights is the true derivative while the chosen set stays put."""
    name, b, t = "layers.2.mlp.gate.hook_logits", 0, 3
    _, cache = model.run_with_cache(ids, names=name, incl_bwd=True, return_type="loss")
    _, route = model.run_with_cache(ids, names="layers.2.mlp.gate.hook_topk_idx")
    expert = int(route["layers.2.mlp.gate.hook_topk_idx"][b, t, 1])  # a chosen expert
    # The loss is float32 (ulp ~1e-6 at ~9 nats): a step of 1e-3 moves it by only a few ulps, so the difference
    # quotient would be rounding noise; 1e-2 moves it by ~70 ulps and still keeps the chosen set in place.
    eps = 1e-2

    def shifted(step):
        def add(logits, hook):
            logits = logits.clone()
            logits[b, t, expert] += step
            return logits
        with torch.no_grad(), model.hooks(fwd_hooks=[(name, add)]):
            return model(ids, return_type="loss").double()

    numeric = (shifted(eps) - shifted(-eps)) / (2 * eps)
    assert torch.allclose(cache[name + "_grad"][b, t, expert].double(), numeric, rtol=2e-2)


def test_attribution_patch_is_exact_where_the_metric_is_linear(model, ids):
    clean, corrupt = ids, ids.clone()
    corrupt[:, 2] = (corrupt[:, 2] + 1) % TINY.vocab_size

    def metric(logits):
        return (logits[:, -1, 5] - logits[:, -1, 9]).sum()

    est = attribution_patch(model, clean, corrupt, metric, names=["hook_logits", "layers.1.hook_resid_pre",
                                                                   "layers.1.mlp.gate."])
    with torch.no_grad():
        change = metric(model(clean)) - metric(model(corrupt))
    assert est["hook_logits"].shape == (2, 7)
    assert torch.allclose(est["hook_logits"].sum(), change, rtol=1e-4)
    # Elsewhere: (clean - corrupt) . grad, the gradient from torch.autograd.grad of the corrupt run.
    name = "layers.1.hook_resid_pre"
    kept = {}
    with model.hooks(fwd_hooks=[(name, keeper(kept))]):
        value = metric(model(corrupt))
    (grad,) = torch.autograd.grad(value, kept[name])
    _, clean_cache = model.run_with_cache(clean, names=name)
    expected = ((clean_cache[name] - kept[name].detach()) * grad).sum(-1)
    assert torch.allclose(est[name], expected, rtol=1e-5, atol=1e-8)
    assert est[name][:, :2].abs().max() == 0  # positions before the corrupted token are unchanged
    assert "layers.1.mlp.gate.hook_topk_idx" not in est and "layers.1.mlp.gate.hook_choice_scores" not in est
    assert "layers.1.mlp.gate.hook_topk_weights" in est
