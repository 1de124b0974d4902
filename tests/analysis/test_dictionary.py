"""Sparse dictionaries (k2lab/analysis/dictionary.py): the TopK SAE and transcoder against their formulas, the metrics
against computations written out here, activations streamed without pads, a short training run on K2-nano, saving
and loading (also through SAELens), and the shipped dictionaries."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import k2lab
from k2lab.analysis import dictionary as dl
from k2lab.analysis.splicing import splice

RESID = "layers.3.hook_resid_post"
TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n",
         "The for statement iterates over the items of any sequence, in the order that they appear."]


@pytest.fixture(scope="module")
def nano():
    return k2lab.load_nano()


def randomized(dictionary: dl.TopKDictionary, seed: int = 0) -> dl.TopKDictionary:
    """Random weights and biases, decoder rows not of unit norm (so no formula leans on them being so)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in dictionary.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return dictionary


def test_topk_sae_encodes_and_decodes_by_its_formula():
    sae = randomized(dl.TopKSAE(16, 64, 5))
    x = torch.randn(3, 7, 16)
    pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc  # [3, 7, 64]
    order = pre.argsort(dim=-1, descending=True)
    want = torch.zeros_like(pre).scatter(-1, order[..., :5], pre.gather(-1, order[..., :5]).relu())
    features = sae.encode(x)
    torch.testing.assert_close(features, want)
    assert ((features > 0).sum(-1) <= 5).all() and (features >= 0).all()
    torch.testing.assert_close(sae.decode(features), want @ sae.W_dec + sae.b_dec)
    torch.testing.assert_close(sae(x), sae.decode(features))


def test_transcoder_has_no_pre_encoder_bias_and_its_own_output_width():
    transcoder = randomized(dl.Transcoder(16, 12, 64, 5))
    x = torch.randn(4, 16)
    pre = x @ transcoder.W_enc + transcoder.b_enc
    threshold = pre.topk(5, dim=-1).values[:, -1:]
    features = torch.where(pre >= threshold, pre.relu(), 0.0)
    torch.testing.assert_close(transcoder.encode(x), features)
    assert transcoder(x).shape == (4, 12)


def test_initialisation_follows_gao_et_al():
    sae = dl.TopKSAE(16, 64, 5)
    torch.testing.assert_close(sae.W_dec.norm(dim=-1), torch.ones(64))
    torch.testing.assert_close(sae.W_enc, sae.W_dec.T)  # tied at the start
    transcoder = dl.Transcoder(16, 12, 64, 5)
    torch.testing.assert_close(transcoder.W_dec.norm(dim=-1), torch.ones(64))


def test_dictionaries_refuse_bad_sizes_and_inputs():
    with pytest.raises(ValueError, match="k=65 features cannot be active out of d_sae=64"):
        dl.TopKSAE(16, 64, 65)
    with pytest.raises(ValueError, match="d_sae must be a positive integer, got 0"):
        dl.TopKSAE(16, 0, 1)
    with pytest.raises(ValueError, match=r"encodes d_in=16, got an input of shape \(2, 8\)"):
        dl.TopKSAE(16, 64, 4).encode(torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"decodes d_sae=64 features, got shape \(2, 8\)"):
        dl.TopKSAE(16, 64, 4).decode(torch.zeros(2, 8))


def test_fraction_of_variance_unexplained_by_hand():
    x = torch.tensor([[1.0, 0.0], [3.0, 2.0]])  # mean [2, 1]: sum of squared deviations 1 + 1 + 1 + 1 = 4
    reconstruction = torch.tensor([[1.0, 1.0], [2.0, 2.0]])  # squared error 0 + 1 + 1 + 0 = 2
    assert dl.fraction_of_variance_unexplained(x, reconstruction) == pytest.approx(0.5)
    assert dl.fraction_of_variance_unexplained(x, x.mean(0).expand_as(x)) == pytest.approx(1.0)
    assert dl.ce_recovered(ce_clean=2.0, ce_spliced=2.5, ce_zero=4.0) == pytest.approx(0.75)


def test_loss_adds_auxk_for_dead_latents_only():
    sae = randomized(dl.TopKSAE(8, 32, 2), seed=1)
    x = torch.randn(64, 8)
    pre = sae.pre_activations(x)
    never = int(pre.topk(2, dim=-1).indices.flatten().bincount(minlength=32).argmin())  # a latent outside every top-k
    dead = torch.zeros(32, dtype=torch.bool)
    loss, error, fired = dl._loss(sae, x, x, dead, aux_k=4, aux_coefficient=1 / 32)
    variance = (x - x.mean(0)).pow(2).sum()
    assert loss.item() == pytest.approx((error.pow(2).sum() / variance).item(), rel=1e-6)
    torch.testing.assert_close(error, x - sae(x).detach())
    assert fired.sum() <= 2 * 64 and not fired[never]
    loss.backward()
    assert sae.W_dec.grad[never].abs().max() == 0  # no path to a latent that never fires
    sae.zero_grad()
    dead[never] = True
    aux_loss, _, _ = dl._loss(sae, x, x, dead, aux_k=4, aux_coefficient=1 / 32)
    aux_features = pre.detach()[:, never].relu()  # the only dead latent: it is the aux top-k
    aux_error = error - aux_features[:, None] * sae.W_dec.detach()[never]
    assert aux_loss.item() == pytest.approx((loss + aux_error.pow(2).sum() / variance / 32).item(), rel=1e-5)
    aux_loss.backward()
    assert sae.W_dec.grad[never].abs().max() > 0  # AuxK gives the dead latent a gradient


def test_folding_the_training_scales_maps_raw_activations():
    transcoder = randomized(dl.Transcoder(8, 6, 32, 3))
    x = torch.randn(10, 8) * 7
    scale_in, scale_out = 7.0, 0.25
    want_features = transcoder.encode(x / scale_in) * scale_out
    want = transcoder(x / scale_in) * scale_out
    dl._fold_scales(transcoder, scale_in, scale_out)
    torch.testing.assert_close(transcoder.encode(x), want_features, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(transcoder(x), want, rtol=1e-5, atol=1e-6)


def test_token_batches_cut_texts_into_windows_closed_by_eos(nano):
    _, tok = nano
    batches = list(dl.token_batches(tok, TEXTS, batch_size=2, context=8))
    rows = [ids[mask].tolist() for ids, mask in batches for ids, mask in zip(*(ids, mask), strict=True)]
    want = []
    for text in TEXTS:
        tokens = [*tok.encode(text), tok.eos_id]
        want += [tokens[i:i + 8] for i in range(0, len(tokens), 8)]
    assert rows == want
    assert all(ids.shape[0] <= 2 and ids.shape[1] <= 8 for ids, _ in batches)


def test_streamed_activations_are_each_text_run_alone_without_pads(nano):
    model, tok = nano
    probes = ["layers.2.post_attention_layernorm.hook_out", "layers.2.hook_mlp_out"]
    chunks = list(dl.stream_activations(model, probes, TEXTS, batch_size=3, context=256))
    assert len(chunks) == 1  # the three texts in one padded batch
    with torch.no_grad():
        alone = [model.run_with_cache(torch.tensor([[*tok.encode(t), tok.eos_id]]), names=probes)[1] for t in TEXTS]
    for i, name in enumerate(probes):
        want = torch.cat([cache[name][0] for cache in alone])  # [N, D]
        torch.testing.assert_close(chunks[0][i], want, rtol=1e-4, atol=1e-4)


def test_evaluate_against_a_computation_written_out(nano):
    model, tok = nano
    sae = randomized(dl.TopKSAE(128, 256, 8))
    metrics = dl.evaluate(model, RESID, sae, TEXTS, batch_size=3)
    [(ids, mask)] = dl.token_batches(tok, TEXTS, batch_size=3)
    zero = lambda t, hook: torch.zeros_like(t)
    replace = lambda t, hook: sae(t)
    with torch.no_grad():
        logits, cache = model.run_with_cache(ids, names=RESID, attention_mask=mask)
        with model.hooks(fwd_hooks=[(RESID, zero)]):
            zeroed = model(ids, attention_mask=mask)
        with model.hooks(fwd_hooks=[(RESID, replace)]):
            spliced = model(ids, attention_mask=mask)
        x = cache[RESID][mask]  # [N, 128] real tokens only
        features = sae.encode(x)

    scored = mask[:, 1:] & mask[:, :-1]

    def cross_entropy(logits: torch.Tensor) -> float:
        return F.cross_entropy(logits[:, :-1][scored], ids[:, 1:][scored]).item()

    assert metrics.tokens == int(mask.sum())
    assert metrics.fvu == pytest.approx(dl.fraction_of_variance_unexplained(x, sae(x)), rel=1e-4)
    assert metrics.mean_l0 == pytest.approx((features > 0).sum(-1).float().mean().item())
    assert metrics.dead_fraction == pytest.approx(1 - (features > 0).any(0).float().mean().item())
    assert metrics.ce_clean == pytest.approx(cross_entropy(logits), rel=1e-5)
    assert metrics.ce_zero == pytest.approx(cross_entropy(zeroed), rel=1e-5)
    assert metrics.ce_spliced == pytest.approx(cross_entropy(spliced), rel=1e-5)
    assert metrics.ce_recovered == pytest.approx(
        dl.ce_recovered(cross_entropy(logits), cross_entropy(spliced), cross_entropy(zeroed)), rel=1e-4)


def test_a_short_training_run_learns_and_records_itself(nano):
    model, _ = nano
    texts = ["\n".join(TEXTS * 60)] * 2  # about 4,700 tokens in windows of 256
    untrained = dl.TopKSAE(128, 256, 16)
    sae = dl.train_sae(model, RESID, texts, d_sae=256, k=16, tokens=4096, batch_tokens=256, buffer_tokens=1024,
                       lr=3e-3, progress=False)
    torch.testing.assert_close(sae.W_dec.norm(dim=-1), torch.ones(256))
    assert sae.probe == RESID
    record = sae.metadata["k2lab_training"]
    assert record["tokens"] == 4096 and record["steps"] == 16
    trained, before = dl.evaluate(model, RESID, sae, TEXTS), dl.evaluate(model, RESID, untrained, TEXTS)
    assert trained.fvu < 0.5 < before.fvu
    transcoder = dl.train_transcoder(model, 2, texts, d_sae=256, k=16, tokens=512, batch_tokens=256,
                                     buffer_tokens=512, progress=False)
    assert transcoder.probe == ("layers.2.post_attention_layernorm.hook_out", "layers.2.hook_mlp_out")


def test_fit_trains_where_autograd_is_off():
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    sae = dl.TopKSAE(8, 32, 4)
    with torch.no_grad():  # as in the lab's notebooks
        record = dl.fit(sae, [[x]] * 20, steps=20, lr=1e-2, progress=False)
    assert record["steps"] == 20 and dl.fraction_of_variance_unexplained(x, sae(x).detach()) < 0.5


def test_training_refuses_what_it_cannot_use(nano):
    model, _ = nano
    with pytest.raises(ValueError, match="layer must be a block index in 0..5, got 6"):
        dl.train_transcoder(model, 6, TEXTS)
    with pytest.raises(ValueError, match="tokens must be a positive integer, got 0"):
        dl.train_sae(model, RESID, TEXTS, tokens=0)
    with pytest.raises(KeyError, match="no probe named"):
        dl.train_sae(model, "layers.3.hook_resid_psot", TEXTS)


@pytest.mark.parametrize("make", [lambda: dl.TopKSAE(16, 64, 5, {"hook_name": RESID}),
                                  lambda: dl.Transcoder(16, 12, 64, 5, {"hook_name": "a", "hook_name_out": "b"})],
                         ids=["sae", "transcoder"])
def test_save_and_load_round_trip(tmp_path, make):
    dictionary = randomized(make())
    folder = dictionary.save(tmp_path / "dictionary")
    assert sorted(p.name for p in folder.iterdir()) == ["cfg.json", "sae_weights.safetensors"]
    loaded = dl.load(folder)
    assert type(loaded) is type(dictionary) and loaded.metadata == dictionary.metadata
    assert (loaded.d_in, loaded.d_out, loaded.d_sae, loaded.k) == (dictionary.d_in, dictionary.d_out, 64, 5)
    for name, p in dictionary.named_parameters():
        assert torch.equal(getattr(loaded, name), p), name
    x = torch.randn(3, 16)
    torch.testing.assert_close(loaded(x), dictionary(x))
    cfg = json.loads((folder / "cfg.json").read_text())
    assert cfg["architecture"] == dictionary.architecture and cfg["metadata"]["sae_lens_version"]


def test_load_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected cfg.json and sae_weights.safetensors"):
        dl.load(tmp_path)
    folder = dl.TopKSAE(16, 64, 5).save(tmp_path / "sae")
    cfg = json.loads((folder / "cfg.json").read_text())
    (folder / "cfg.json").write_text(json.dumps({**cfg, "architecture": "jumprelu"}))
    with pytest.raises(ValueError, match="architecture 'jumprelu'; k2lab reads 'topk' and 'topk_transcoder'"):
        dl.load(folder)
    (folder / "cfg.json").write_text(json.dumps({**cfg, "normalize_activations": "layer_norm"}))
    with pytest.raises(ValueError, match="normalize_activations='layer_norm'; k2lab's topk needs 'none'"):
        dl.load(folder)


def test_a_folder_in_saelens_layout_loads(tmp_path):
    """The folder SAELens 6 writes for a TopK SAE, written out here (its field order, its version fields, no k2lab
    metadata), so that loading is checked also where sae-lens is not installed."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    weights = {"W_dec": torch.randn(16, 8, generator=g), "W_enc": torch.randn(8, 16, generator=g),
               "b_dec": torch.randn(8, generator=g), "b_enc": torch.randn(16, generator=g)}
    cfg = {"d_in": 8, "d_sae": 16, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
           "normalize_activations": "none", "reshape_activations": "none",
           "metadata": {"sae_lens_version": "6.54.12", "sae_lens_training_version": "6.54.12", "hook_name": RESID},
           "k": 3, "rescale_acts_by_decoder_norm": False, "architecture": "topk"}
    tmp_path.joinpath("cfg.json").write_text(json.dumps(cfg))
    save_file(weights, tmp_path / "sae_weights.safetensors")
    sae = dl.load(tmp_path)
    assert isinstance(sae, dl.TopKSAE) and sae.k == 3 and sae.metadata == {"hook_name": RESID}
    x = torch.randn(4, 8, generator=g)
    pre = (x - weights["b_dec"]) @ weights["W_enc"] + weights["b_enc"]
    want = torch.where(pre >= pre.topk(3, dim=-1).values[:, -1:], pre.relu(), 0.0)
    with torch.no_grad():
        torch.testing.assert_close(sae.encode(x), want)
        torch.testing.assert_close(sae(x), want @ weights["W_dec"] + weights["b_dec"])


def test_saelens_loads_what_k2lab_saves_and_back(tmp_path):
    sae_lens = pytest.importorskip("sae_lens", reason="sae-lens is an optional test dependency")
    ours = randomized(dl.TopKSAE(16, 64, 5, {"hook_name": RESID, "model_name": "k2-nano"}))
    theirs = sae_lens.SAE.load_from_disk(ours.save(tmp_path / "ours"))
    assert isinstance(theirs, sae_lens.TopKSAE) and theirs.cfg.metadata.hook_name == RESID
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(theirs.encode(x), ours.encode(x))
        torch.testing.assert_close(theirs.decode(theirs.encode(x)), ours(x))
        theirs.save_model(tmp_path / "theirs")
        back = dl.load(tmp_path / "theirs")
        torch.testing.assert_close(back(x), ours(x))
    assert back.metadata["hook_name"] == RESID


def test_shipped_dictionaries_load_and_splice_into_nano(nano):
    model, tok = nano
    names = dl.shipped()
    assert any(n.startswith("sae_") for n in names) and any(n.startswith("transcoder_") for n in names)
    ids = torch.tensor([tok.encode(TEXTS[0])])
    with torch.no_grad():
        clean = model(ids)
        for name in names:
            dictionary = dl.load_shipped(name)
            assert dictionary.metadata["model_name"] == "k2-nano"
            with splice(model, dictionary.probe, dictionary, keep_error=True):
                assert (model(ids) - clean).abs().max() <= 1e-6
    with pytest.raises(KeyError, match="no shipped dictionary named 'sae_nope'"):
        dl.load_shipped("sae_nope")
