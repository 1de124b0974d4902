"""Splicing a dictionary into a probe (k2lab/analysis/splicing.py): the forward is unchanged with the error term kept,
the probe carries the reconstruction without it, and the features are a probe that caches, hooks, patching and nnsight
read and edit by name. Checked on TINY against reconstructions computed by hand from a clean run's activations."""

from __future__ import annotations

import pytest
import torch
from tiny import TINY, random_model, token_ids
from torch import nn

import k2lab
from k2lab import K2Model
from k2lab.analysis.dictionary import TopKSAE, Transcoder
from k2lab.analysis.interventions import patch
from k2lab.analysis.splicing import splice

D = TINY.hidden_size
RESID = "layers.1.hook_resid_post"
FEATURES = RESID + ".hook_features"
READ, WRITE = "layers.1.post_attention_layernorm.hook_out", "layers.1.hook_mlp_out"  # the MoE of block 1
# Probes of every kind that carries [B, T, D]: the residual stream, attention's and the MoE's writes, both norms'
# outputs inside a block, the embedding and the final norm.
PROBES = ["embed_tokens.hook_out", "layers.0.hook_resid_pre", "layers.1.input_layernorm.hook_out",
          "layers.1.hook_attn_out", "layers.1.hook_resid_mid", READ, WRITE, RESID, "layers.2.hook_mlp_out",
          "norm.hook_out"]
# What no dictionary can take, and why (test_splice_refuses_probes_without_activations_to_encode).
REFUSED = {"mlp.gate.hook_topk_idx": "holds expert indices", "self_attn.hook_max_logit": "is read-only",
           "self_attn.hook_attn_scores": "holds non-finite values"}
# Every other probe of TINY, whatever its shape: [B, T, H, d] heads, [B, T, E] router scores, [B, T, k, D] expert
# slots, [B, H, T, T] patterns, [B, T, V] logits. A dictionary works over the last axis.
ANY_PROBE = [name for name in K2Model(TINY).hook_names() if not name.endswith(tuple(REFUSED))]


class Identity(nn.Module):
    """A perfect dictionary of 2D features: the positive and negative parts of x, decoded exactly (x = x+ - x-)."""

    d_in = d_out = D

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.relu(), (-x).relu()], dim=-1)  # [..., 2D]

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        return features[..., :D] - features[..., D:]


def random_sae(d_in: int = D, d_sae: int = 512, k: int = 8, seed: int = 0) -> TopKSAE:
    """A TopK SAE with random weights and non-zero biases (an untrained one would hide the bias terms)."""
    sae = TopKSAE(d_in, d_sae, k)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return sae


def by_hand(sae: TopKSAE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and reconstruction of x [..., d_in], written out: TopK of ReLU((x - b_dec) W_enc + b_enc)."""
    pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc
    threshold = pre.topk(sae.k, dim=-1).values[..., -1:]
    features = torch.where(pre >= threshold, pre.relu(), 0.0)
    return features, features @ sae.W_dec + sae.b_dec


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, seed=0)


@pytest.fixture(scope="module")
def ids():
    return token_ids(TINY, batch=2, length=9)


@pytest.fixture(scope="module")
def clean(model, ids):
    with torch.no_grad():
        return model.run_with_cache(ids, names=PROBES)


@pytest.mark.parametrize("probe", ANY_PROBE)
def test_keep_error_leaves_the_forward_unchanged_at_any_probe(model, ids, probe):
    with torch.no_grad():
        # The reference reads the probe too: reading a pattern takes attention off its fused kernel (rounding).
        logits, reference = model.run_with_cache(ids, names=probe)
        width = reference[probe].shape[-1]
        with splice(model, probe, random_sae(d_in=width, d_sae=64, k=4), keep_error=True) as features:
            spliced, cache = model.run_with_cache(ids, names=[probe, features.name])
    assert (spliced - logits).abs().max() <= 1e-6
    assert torch.equal(cache[probe], reference[probe])
    assert cache[features.name].shape == (*reference[probe].shape[:-1], 64)
    assert ((cache[features.name] > 0).sum(-1) <= 4).all()


@pytest.mark.parametrize("leaf", REFUSED)
def test_splice_refuses_probes_without_activations_to_encode(model, ids, leaf):
    probe = f"layers.1.{leaf}"
    with pytest.raises(ValueError, match=f"{probe} {REFUSED[leaf]}"), torch.no_grad():
        with splice(model, probe, random_sae(d_in=ids.shape[1])):
            model(ids)
    assert "hook_features" not in " ".join(model.hook_names())


def test_splice_is_an_intervention():
    assert k2lab.interventions.splice is splice


def test_keep_error_with_a_transcoder_leaves_the_forward_unchanged(model, ids, clean):
    transcoder = Transcoder(D, D, 512, 8)
    with torch.no_grad(), splice(model, (READ, WRITE), transcoder, keep_error=True):
        assert (model(ids) - clean[0]).abs().max() <= 1e-6


@pytest.mark.parametrize("probe", [RESID, WRITE, "norm.hook_out"])
def test_a_perfect_dictionary_without_the_error_term_changes_nothing(model, ids, clean, probe):
    with torch.no_grad(), splice(model, probe, Identity()):
        assert (model(ids) - clean[0]).abs().max() <= 1e-6


def test_the_probe_carries_the_reconstruction_and_the_features_probe_the_encoding(model, ids, clean):
    sae = random_sae()
    with torch.no_grad(), splice(model, RESID, sae) as features:
        _, cache = model.run_with_cache(ids, names=[RESID, FEATURES])
        want_features, want_recon = by_hand(sae, clean[1][RESID])  # the probe's input is upstream: unchanged
    assert features.name == FEATURES
    torch.testing.assert_close(cache[FEATURES], want_features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[RESID], want_recon, rtol=1e-5, atol=1e-5)
    assert ((cache[FEATURES] > 0).sum(-1) <= sae.k).all()


def test_zeroing_every_feature_equals_zero_ablating_the_probe(model, ids):
    zero = lambda t, hook: torch.zeros_like(t)
    with torch.no_grad():
        with model.hooks(fwd_hooks=[(RESID, zero)]):
            ablated = model(ids)
        with splice(model, RESID, Identity()), model.hooks(fwd_hooks=[(FEATURES, zero)]):
            spliced = model(ids)
    assert (spliced - ablated).abs().max() <= 1e-6


def test_steering_a_feature_moves_the_probe_along_its_decoder_row(model, ids, clean):
    sae, feature, amount = random_sae(), 17, 2.5

    def steer(features: torch.Tensor, hook) -> torch.Tensor:
        features = features.clone()
        features[..., feature] += amount
        return features

    with torch.no_grad(), splice(model, RESID, sae, keep_error=True):
        with model.hooks(fwd_hooks=[(FEATURES, steer)]):
            steered, cache = model.run_with_cache(ids, names=RESID)
    want = clean[1][RESID] + amount * sae.W_dec[feature]
    torch.testing.assert_close(cache[RESID], want, rtol=1e-5, atol=1e-5)
    assert (steered - clean[0]).abs().max() > 1e-3


def test_a_transcoder_reads_one_probe_and_replaces_another(model, ids, clean):
    transcoder = Transcoder(D, D, 512, 8)
    with torch.no_grad():
        for p in transcoder.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
        with splice(model, (READ, WRITE), transcoder) as features:
            _, cache = model.run_with_cache(ids, names=[READ, WRITE, features.name])
        x = clean[1][READ]
        pre = x @ transcoder.W_enc + transcoder.b_enc
        kept = torch.where(pre >= pre.topk(8, dim=-1).values[..., -1:], pre.relu(), 0.0)
    assert features.name == WRITE + ".hook_features"
    torch.testing.assert_close(cache[READ], x)
    torch.testing.assert_close(cache[features.name], kept, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[WRITE], kept @ transcoder.W_dec + transcoder.b_dec, rtol=1e-5, atol=1e-5)
    names = list(cache)
    assert names.index(READ) < names.index(features.name) < names.index(WRITE)  # features fire with the write probe


def test_patching_features_from_another_run(model, ids):
    sae, other = random_sae(), token_ids(TINY, batch=2, length=9, seed=3)
    with torch.no_grad(), splice(model, RESID, sae):
        _, source = model.run_with_cache(other, names=FEATURES)
        with patch(model, source, FEATURES):
            _, cache = model.run_with_cache(ids, names=RESID)
    torch.testing.assert_close(cache[RESID], sae.decode(source[FEATURES]), rtol=1e-5, atol=1e-5)


def test_gradients_reach_the_features_through_the_decoder(model, ids):
    sae = random_sae()
    with splice(model, RESID, sae, keep_error=True):
        loss, cache = model.run_with_cache(ids, names=[RESID, FEATURES], incl_bwd=True, return_type="loss")
    plain_loss, plain = model.run_with_cache(ids, names=RESID, incl_bwd=True, return_type="loss")
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-6)
    # keep_error: out = x + decode(f') - decode(f), so d out / d x is the identity and d out / d f' is W_dec.
    torch.testing.assert_close(cache[RESID + "_grad"], plain[RESID + "_grad"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(cache[FEATURES + "_grad"], cache[RESID + "_grad"] @ sae.W_dec.detach().T,
                               rtol=1e-5, atol=1e-7)


def test_the_features_probe_is_removed_on_exit_also_after_an_error(model, ids):
    before = model.hook_names()
    with pytest.raises(RuntimeError, match="inside the block"), splice(model, RESID, random_sae()):
        assert FEATURES in model.hook_names()
        raise RuntimeError("inside the block")
    assert model.hook_names() == before
    assert not hasattr(model.hook_point(RESID), "hook_features")
    with pytest.raises(KeyError, match="no probe named"):
        model.hook_point(FEATURES)
    assert all(not model.hook_point(name).fns for name in model.hook_names())


def test_splice_refuses_what_it_cannot_do(model, ids):
    with pytest.raises(KeyError, match="no probe named 'layers.1.hook_resid_psot'"):
        with splice(model, "layers.1.hook_resid_psot", random_sae()):
            pass
    with pytest.raises(TypeError, match="encode.*decode.*Linear"):
        with splice(model, RESID, nn.Linear(D, D)):
            pass
    with pytest.raises(ValueError, match=f"{RESID} is {D} wide .* d_in=100"), torch.no_grad():
        with splice(model, RESID, random_sae(d_in=100)):
            model(ids)
    with pytest.raises(ValueError, match=f"decodes to d_out=64 but {WRITE} is {D} wide"), torch.no_grad():
        with splice(model, (READ, WRITE), Transcoder(D, 64, 128, 4)):
            model(ids)
    with pytest.raises(ValueError, match="read probe layers.2.hook_resid_pre fires after the write probe"):
        with splice(model, ("layers.2.hook_resid_pre", WRITE), Transcoder(D, D, 128, 4)):
            pass
    with pytest.raises(RuntimeError, match=f"read probe {WRITE} did not fire before the write probe {READ}"):
        with torch.no_grad(), splice(model, (WRITE, READ), Transcoder(D, D, 128, 4)):
            model(ids)
    with pytest.raises(RuntimeError, match="already has a dictionary spliced in"):
        with splice(model, RESID, random_sae()), splice(model, RESID, random_sae()):
            pass
    assert "hook_features" not in " ".join(model.hook_names())



@pytest.mark.parametrize("keep_error", ["no", 0, None, 1.0])
def test_keep_error_is_true_or_false(model, keep_error):
    with pytest.raises(TypeError, match=rf"keep_error must be True or False, got {keep_error!r}"):
        with splice(model, RESID, random_sae(), keep_error=keep_error):
            pass
    assert "hook_features" not in " ".join(model.hook_names())


def test_a_dictionary_of_heads_flattened_is_refused_where_it_cannot_read(model, ids):
    z = "layers.1.self_attn.hook_z"
    heads = TopKSAE(TINY.num_attention_heads * TINY.v_head_dim, 64, 4, reshape_activations="hook_z")
    with pytest.raises(ValueError, match=f"reshape_activations='hook_z'\\) replaces the probe it reads; got {z}"):
        with splice(model, (z, "layers.1.hook_attn_out"), heads):
            pass
    with pytest.raises(ValueError, match=f"splice: {RESID} is \\(2, 9, {D}\\) but the dictionary reads its last two "
                                         f"axes flattened"), torch.no_grad():
        with splice(model, RESID, heads):
            model(ids)

def test_splicing_takes_transformerlens_spellings(model, ids, clean):
    with torch.no_grad(), splice(model, "blocks.1.hook_resid_post", random_sae(), keep_error=True) as features:
        assert features.name == FEATURES
        assert (model(ids) - clean[0]).abs().max() <= 1e-6


def test_nnsight_reads_and_edits_the_features(ids):
    """On a model of its own: nnsight's wrappers stay on a model for good (every probe then counts as active)."""
    nnsight = pytest.importorskip("nnsight", reason="nnsight is an optional test dependency")
    model = random_model(TINY, seed=0)
    sae = random_sae()
    zero = lambda t, hook: torch.zeros_like(t)
    with torch.no_grad(), splice(model, RESID, sae) as features:
        _, cache = model.run_with_cache(ids, names=FEATURES)
        with model.hooks(fwd_hooks=[(FEATURES, zero)]):
            zeroed = model(ids)
        wrapped = nnsight.NNsight(model)  # made inside the block, so it sees the features probe
        with wrapped.trace(ids):
            read = wrapped.layers[1].hook_resid_post.hook_features.output.save()
        with wrapped.trace(ids):
            wrapped.layers[1].hook_resid_post.hook_features.output[:] = 0
            edited = wrapped.output.save()
    assert features.name == FEATURES
    torch.testing.assert_close(read, cache[FEATURES], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(edited, zeroed, rtol=1e-5, atol=1e-5)


def test_saelens_sae_splices_as_it_computes(model, ids, clean):
    sae_lens = pytest.importorskip("sae_lens", reason="sae-lens is an optional test dependency")
    sae = sae_lens.TopKSAE(sae_lens.TopKSAEConfig(d_in=D, d_sae=512, k=8))  # built from its config, offline
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        with splice(model, RESID, sae) as features:
            _, cache = model.run_with_cache(ids, names=[RESID, features.name])
        with splice(model, RESID, sae, keep_error=True):
            kept = model(ids)
        x = clean[1][RESID]
        pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc  # SAELens's TopK SAE, by hand
        want = torch.where(pre >= pre.topk(8, dim=-1).values[..., -1:], pre.relu(), 0.0)
    torch.testing.assert_close(cache[FEATURES], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[RESID], want @ sae.W_dec + sae.b_dec, rtol=1e-5, atol=1e-5)
    assert (kept - clean[0]).abs().max() <= 1e-6


def test_saelens_transcoder_splices_across_two_probes(model, ids, clean):
    sae_lens = pytest.importorskip("sae_lens", reason="sae-lens is an optional test dependency")
    config = sae_lens.TranscoderConfig(d_in=D, d_sae=256, d_out=D, apply_b_dec_to_input=False)
    transcoder = sae_lens.Transcoder(config)  # a ReLU transcoder, built from its config, offline
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in transcoder.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        with splice(model, (READ, WRITE), transcoder) as features:
            _, cache = model.run_with_cache(ids, names=[WRITE, features.name])
        with splice(model, (READ, WRITE), transcoder, keep_error=True):
            kept = model(ids)
        want = (clean[1][READ] @ transcoder.W_enc + transcoder.b_enc).relu()  # [B, T, 256] by hand
    torch.testing.assert_close(cache[WRITE + ".hook_features"], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[WRITE], want @ transcoder.W_dec + transcoder.b_dec, rtol=1e-5, atol=1e-5)
    assert (kept - clean[0]).abs().max() <= 1e-6
