"""Features that steer the router (k2lab/analysis/features.py): the direct read W_gate (g * W_dec) against the router
logits' measured change under a small steer, and routing_effect against matched-frequency controls, on a dictionary
built so that one feature points along a router row and the others are invisible to the router."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
from tiny import TINY, random_model, token_ids

from k2lab import interventions
from k2lab.analysis import dictionary as dl
from k2lab.analysis import features

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.fixture(scope="module")
def nano():
    import k2lab

    return k2lab.load_nano()


@pytest.fixture(scope="module")
def heldout():
    from k2lab.training import corpus

    return [doc.text for doc in corpus.documents("heldout", kind="code")][:8]


def steered_router_logits(model, ids, sae, probe, layer, feature, position, epsilon, freeze=()):
    """Layer ``layer``'s router logits [T, E] with ``epsilon`` added to ``feature`` at ``position`` (the SAE spliced
    with its error kept, so only epsilon * W_dec[feature] is added), the probes ``freeze`` patched to their clean
    values."""
    _, clean = model.run_with_cache(ids, names=list(freeze) or None)

    def steer(f, hook):
        f = f.clone()
        f[0, position, feature] += epsilon
        return f

    with ExitStack() as stack:
        point = stack.enter_context(interventions.splice(model, probe, sae, keep_error=True))
        if freeze:
            stack.enter_context(interventions.patch(model, clean, list(freeze)))
        stack.enter_context(model.hooks(fwd_hooks=[(point.name, steer)]))
        _, cache = model.run_with_cache(ids, names=f"layers.{layer}.mlp.gate.hook_logits")
    return cache[f"layers.{layer}.mlp.gate.hook_logits"][0]


def _expected(model, layer, x, logits, read_row, decoder_row):
    """First-order change of layer ``layer``'s router logits [E] per unit of a feature, at a token whose residual x
    [D] the router reads directly: read / rms(x) - (x . d) / (D rms(x)^2) * logits, d the feature's decoder row."""
    norm = model.layers[layer].post_attention_layernorm
    rms = (x.pow(2).mean() + norm.eps).sqrt()
    return read_row / rms - (x @ decoder_row) / (x.numel() * rms**2) * logits


@pytest.mark.parametrize("position", [0, 5])
def test_router_read_predicts_the_logit_change_of_a_small_steer_on_a_tiny_model(position):
    """An SAE on layer 2's resid_mid, which the router of layer 2 reads through its norm only: the measured change
    (central difference) equals the read divided by the token's rms plus the norm denominator's own change."""
    model = random_model(TINY, seed=3)
    ids = token_ids(TINY, batch=1, length=8)
    probe, layer = "layers.2.hook_resid_mid", 2
    sae = dl.TopKSAE(TINY.hidden_size, 32, 4, {"hook_name": probe})
    sae.reset_parameters(torch.Generator().manual_seed(0))
    read = features.router_read(model, sae, layer)  # [F, E]
    assert read.shape == (32, TINY.n_routed_experts)
    _, cache = model.run_with_cache(ids, names=[probe, f"layers.{layer}.mlp.gate.hook_logits"])
    x, logits = cache[probe][0, position], cache[f"layers.{layer}.mlp.gate.hook_logits"][0, position]
    for feature in (0, 7, 31):
        epsilon = 1e-2
        up = steered_router_logits(model, ids, sae, probe, layer, feature, position, epsilon)
        down = steered_router_logits(model, ids, sae, probe, layer, feature, position, -epsilon)
        measured = (up - down)[position] / (2 * epsilon)  # [E]
        expected = _expected(model, layer, x, logits, read[feature], sae.W_dec[feature])
        torch.testing.assert_close(measured, expected, rtol=0, atol=2e-3 * expected.abs().max().item())
        others = torch.cat([(up - down)[:position], (up - down)[position + 1:]])
        assert others.abs().max() == 0  # no other token's router moves: nothing between the probe and the router


def test_router_read_on_nano_matches_a_steer_with_attention_frozen(nano):
    """The shipped SAE writes layer 3's resid_post; layer 4's router reads it after layer 4's attention. With that
    attention's write patched to its clean value, the direct read (plus the denominator's term) is the whole
    change."""
    model, _ = nano
    sae = dl.load_shipped("sae_nano_l3_resid_post")
    ids = model.to_tokens("def add(a, b):\n    return a + b\n")
    read = features.router_read(model, sae, 4)  # [1024, 32]
    _, cache = model.run_with_cache(ids, names=["layers.4.hook_resid_mid", "layers.4.mlp.gate.hook_logits"])
    position = 6
    x, logits = cache["layers.4.hook_resid_mid"][0, position], cache["layers.4.mlp.gate.hook_logits"][0, position]
    freeze = ["layers.4.hook_attn_out"]
    for feature in (3, 353, 900):
        epsilon = 0.05
        up = steered_router_logits(model, ids, sae, sae.probe, 4, feature, position, epsilon, freeze)
        down = steered_router_logits(model, ids, sae, sae.probe, 4, feature, position, -epsilon, freeze)
        measured = (up - down)[position] / (2 * epsilon)
        expected = _expected(model, 4, x, logits, read[feature], sae.W_dec[feature])
        torch.testing.assert_close(measured, expected, rtol=0, atol=5e-3 * expected.abs().max().item())


def test_router_read_refuses_a_router_that_does_not_read_the_dictionary(nano):
    model, _ = nano
    sae = dl.load_shipped("sae_nano_l3_resid_post")
    with pytest.raises(ValueError, match=r"the MoE layers it reaches are \[4, 5\]"):
        features.router_read(model, sae, 3)
    with pytest.raises(ValueError, match=r"layer 0 has no router: the MoE layers are \[1, 2, 3, 4, 5\]"):
        features.router_read(model, dl.load_shipped("transcoder_nano_l0_mlp"), 0)
    with pytest.raises(ValueError, match="writes the residual stream"):
        features.router_read(model, sae, 4, probe="layers.3.self_attn.hook_kv_latent")
    transcoder = dl.load_shipped("transcoder_nano_l3_moe")
    assert features.router_read(model, transcoder, 5).shape == (2048, 32)
    assert features.reachable_moe_layers(model, "layers.2.hook_resid_mid") == [2, 3, 4, 5]
    assert features.reachable_moe_layers(model, "layers.2.hook_mlp_out") == [3, 4, 5]


def _router_dictionary(model, layer: int, expert: int, strength: float = 12.0) -> dl.TopKSAE:
    """An SAE of layer ``layer``'s resid_mid with 8 features, all kept (k = 8) where their pre-activation is
    positive: feature 0 writes along what the router reads for ``expert`` (W_gate[e] * g), the others in the null
    space of W_gate diag(g), which the router does not read (but for its norm's denominator)."""
    block = model.layers[layer]
    g, gate = block.post_attention_layernorm.weight, block.mlp.gate.weight  # [D], [E, D]
    M = gate * g  # [E, D]: logits = M x / rms(x)
    null = torch.linalg.svd(M, full_matrices=True).Vh[M.shape[0]:]  # [D - E, D], orthonormal, M null @ = 0
    D = model.config.hidden_size
    sae = dl.TopKSAE(D, 8, 8, {"hook_name": f"layers.{layer}.hook_resid_mid"})
    generator = torch.Generator().manual_seed(1)
    sae.reset_parameters(generator)
    sae.b_dec.zero_()
    sae.W_dec[0] = strength * M[expert] / M[expert].norm()
    sae.W_dec[1:] = strength * null[:7]
    sae.W_enc.copy_(torch.randn(D, 8, generator=generator) / D**0.5)
    return sae


def test_routing_effect_finds_the_feature_the_router_reads_against_matched_controls(nano, heldout):
    model, _ = nano
    layer, expert = 4, 7
    sae = _router_dictionary(model, layer, expert)
    effect = features.routing_effect(model, sae, 0, heldout, num_controls=3, max_len=128, num_boot=100,
                                     progress=False)
    assert effect.layers == [4, 5] and effect.tokens > 100
    assert len(effect.controls) == 3 and all(len(c) == 1 and c[0] != 0 for c in effect.controls)
    j = 0  # layer 4
    assert effect.rate_change_ci[1, j, expert] < 0  # the expert loses the feature's tokens ...
    assert effect.weight_change_ci[1, j, expert] < 0  # ... and its weight on them
    assert effect.excess_ci[0, j] > 0 and effect.moved[j] > 3 * effect.control_moved[:, j].max()
    low, high = effect.moved_ci[:, j]
    assert low <= effect.moved[j] <= high
    steered = features.routing_effect(model, sae, [0], heldout, mode="steer", scale=0.5, num_controls=2,
                                      max_len=128, num_boot=50, progress=False)
    assert steered.rate_change_ci[0, j, expert] > 0  # more of it: the expert gains
    invisible = features.routing_effect(model, sae, 1, heldout, num_controls=2, max_len=128, num_boot=50,
                                        progress=False)
    assert invisible.moved[j] < effect.moved[j] / 3  # the router does not read feature 1's direction
    assert "layer 4" in str(effect)


def test_routing_effect_refuses_what_it_cannot_measure(nano, heldout):
    model, _ = nano
    sae = _router_dictionary(model, 4, 7)
    with pytest.raises(ValueError, match="mode must be 'ablate' or 'steer'"):
        features.routing_effect(model, sae, 0, heldout, mode="zero")
    with pytest.raises(ValueError, match="scale is for mode='steer'"):
        features.routing_effect(model, sae, 0, heldout, scale=2.0)
    with pytest.raises(ValueError, match="needs scale"):
        features.routing_effect(model, sae, 0, heldout, mode="steer")
    with pytest.raises(ValueError, match="distinct feature indices in 0..7"):
        features.routing_effect(model, sae, [0, 0], heldout[:2], progress=False)
    with pytest.raises(ValueError, match="distinct feature indices in 0..7"):
        features.routing_effect(model, sae, 8, heldout[:2], progress=False)
