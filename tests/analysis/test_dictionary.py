"""Sparse dictionaries (k2lab/analysis/dictionary.py): the TopK SAE and transcoder against their formulas, the metrics
against computations written out here, activations streamed without pads, a short training run on K2-nano, saving
and loading (also through SAELens), and the shipped dictionaries."""

from __future__ import annotations

import json
import math

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


# ---- what a dictionary refuses, and what it reports (issue 49) -------------------------------------------------------
Z = "layers.3.self_attn.hook_z"  # [B, T, H, V]: K2-nano's 4 heads of 32


def test_token_batches_pad_with_the_tokenizers_pad(nano):
    _, tok = nano
    [(ids, mask)] = dl.token_batches(tok, TEXTS, batch_size=3)
    assert not mask.all() and (ids[~mask] == tok.special_tokens["[PAD]"]).all()  # not id 0, a real byte token
    assert mask.sum(-1).tolist() == [len(tok.encode(t)) + 1 for t in TEXTS]  # each text and its EOS


def test_evaluate_reports_the_cost_in_nats_and_a_mean_ablation(nano):
    model, tok = nano
    sae = randomized(dl.TopKSAE(128, 256, 8))
    metrics = dl.evaluate(model, RESID, sae, TEXTS, batch_size=3)
    [(ids, mask)] = dl.token_batches(tok, TEXTS, batch_size=3)
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names=RESID, attention_mask=mask)
        mean = cache[RESID][mask].mean(0)  # [128] over the real tokens only: no pad enters it
        with model.hooks(fwd_hooks=[(RESID, lambda t, hook: mean.expand_as(t))]):
            ablated = model(ids, attention_mask=mask)
    scored = mask[:, 1:] & mask[:, :-1]
    ce_mean = F.cross_entropy(ablated[:, :-1][scored], ids[:, 1:][scored]).item()
    assert metrics.ce_mean == pytest.approx(ce_mean, rel=1e-5)
    assert metrics.ce_cost == pytest.approx(metrics.ce_spliced - metrics.ce_clean)
    assert metrics.ce_recovered_mean == pytest.approx(
        (ce_mean - metrics.ce_spliced) / (ce_mean - metrics.ce_clean), rel=1e-6)
    # The residual stream zeroed leaves next to the uniform distribution: a far lower bar than its mean.
    assert metrics.ce_zero > ce_mean
    assert {"ce_cost", "ce_mean", "ce_recovered", "ce_recovered_mean"} <= set(metrics.as_dict())
    assert f"splicing costs {metrics.ce_cost:.3f} nats" in str(metrics) and "against mean-ablation" in str(metrics)
    # Pads enter nothing: the same texts one at a time (no pads at all) give the same figures.
    alone = dl.evaluate(model, RESID, sae, TEXTS, batch_size=1)
    for name in ("fvu", "mean_l0", "dead_fraction", "ce_clean", "ce_spliced", "ce_zero", "ce_mean", "tokens"):
        assert getattr(alone, name) == pytest.approx(getattr(metrics, name), rel=1e-4), name


def test_training_that_runs_out_of_text_says_so(nano):
    model, tok = nano
    available = sum(len(tok.encode(t)) + 1 for t in TEXTS)  # about 60 tokens
    with pytest.raises(ValueError, match=r"the texts ran out after \d+ tokens \(\d+ steps of 16\) of the 200,000 "
                                         r"asked \(12500 steps\)"):
        dl.train_sae(model, RESID, TEXTS, d_sae=64, k=4, tokens=200_000, batch_tokens=16, buffer_tokens=32,
                     progress=False)
    sae = dl.train_sae(model, RESID, TEXTS, d_sae=64, k=4, tokens=32, batch_tokens=16, buffer_tokens=32,
                       progress=False)  # what the texts hold is enough
    assert sae.metadata["k2lab_training"]["tokens"] == 32 < available


def test_a_dictionary_of_attention_heads_flattened_as_saelens_trains_them(nano, tmp_path):
    model, tok = nano
    texts = ["\n".join(TEXTS * 60)]
    sae = dl.train_sae(model, Z, texts, d_sae=256, k=16, tokens=1024, batch_tokens=256, buffer_tokens=512,
                       progress=False)
    assert (sae.d_in, sae.reshape_activations) == (4 * 32, "hook_z")
    ids = torch.tensor([tok.encode(TEXTS[0])])
    with torch.no_grad():
        clean, cache = model.run_with_cache(ids, names=Z)
        z = cache[Z]  # [1, T, 4, 32]
        with splice(model, Z, sae, keep_error=True) as point:
            kept, spliced_cache = model.run_with_cache(ids, names=[Z, point.name])
        with splice(model, Z, sae):
            _, replaced = model.run_with_cache(ids, names=Z)
        want = sae(z.flatten(-2)).unflatten(-1, (4, 32))  # the heads flattened, reconstructed, put back
    assert (kept - clean).abs().max() <= 1e-6
    assert spliced_cache[point.name].shape == (1, z.shape[1], 256)  # one feature vector per token
    torch.testing.assert_close(replaced[Z], want, rtol=1e-5, atol=1e-5)
    metrics = dl.evaluate(model, Z, sae, TEXTS)
    [(batch, mask)] = dl.token_batches(tok, TEXTS)
    with torch.no_grad():
        rows = model.run_with_cache(batch, names=Z, attention_mask=mask)[1][Z][mask].flatten(-2)  # [N, 128]
        assert metrics.fvu == pytest.approx(dl.fraction_of_variance_unexplained(rows, sae(rows)), rel=1e-4)
    assert metrics.tokens == len(rows) and metrics.mean_l0 == 16
    x = z[0].flatten(-2)  # [T, 128]
    loaded = dl.load(sae.save(tmp_path / "z"))
    assert loaded.reshape_activations == "hook_z"
    assert json.loads((tmp_path / "z" / "cfg.json").read_text())["reshape_activations"] == "hook_z"
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), sae(x))
    sae_lens = pytest.importorskip("sae_lens", reason="sae-lens is an optional test dependency")
    theirs = sae_lens.SAE.load_from_disk(tmp_path / "z")  # SAELens reshapes hook_z itself: [..., H, V] in and out
    with torch.no_grad():
        torch.testing.assert_close(theirs.encode(z[0]), sae.encode(x))
        with splice(model, Z, theirs):
            _, theirs_cache = model.run_with_cache(ids, names=Z)
    torch.testing.assert_close(theirs_cache[Z], want, rtol=1e-5, atol=1e-5)


def test_probes_of_other_layouts_are_refused_by_name(nano):
    model, _ = nano
    probe = "layers.3.self_attn.hook_q_nope"
    with pytest.raises(ValueError, match=rf"{probe} is \[1, 2, 4, 32\]: dictionaries train on \[B, T, D\] probes and "
                                         rf"on hook_z"):
        dl.train_sae(model, probe, TEXTS, d_sae=64, k=4, progress=False)
    with pytest.raises(ValueError, match=rf"{Z}'s rows are 128 wide \(heads flattened: reshape_activations='hook_z'\),"
                                         rf" but the TopKSAE reads 32"):
        dl.train_dictionary(model, dl.TopKSAE(32, 64, 4), Z, TEXTS, progress=False)
    with pytest.raises(ValueError, match=rf"evaluate: {Z} is \[3, \d+, 4, 32\]; a dictionary of it reads the heads"):
        dl.evaluate(model, Z, dl.TopKSAE(32, 64, 4), TEXTS, batch_size=3)


def test_a_dictionary_with_nan_weights_is_refused_in_memory_and_in_its_file(nano, tmp_path):
    model, _ = nano
    sae = randomized(dl.TopKSAE(128, 64, 4, {"hook_name": RESID}))
    folder = sae.save(tmp_path / "sae")
    with torch.no_grad():
        sae.W_dec[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"splice: the dictionary's W_dec holds non-finite values \(1 of 8192"):
        with splice(model, RESID, sae):
            pass
    with pytest.raises(ValueError, match=r"W_dec holds non-finite values"):
        dl.evaluate(model, RESID, sae, TEXTS)
    with pytest.raises(ValueError, match=r"TopKSAE.save: W_dec holds non-finite values"):
        sae.save(tmp_path / "nan")
    assert not (tmp_path / "nan").exists()
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "sae_weights.safetensors")
    save_file({**weights, "b_enc": torch.full((64,), float("inf"))}, folder / "sae_weights.safetensors")
    with pytest.raises(ValueError, match=r"sae_weights.safetensors: b_enc holds non-finite values \(64 of 64"):
        dl.load(folder)
    save_file({**weights, "W_enc": weights["W_enc"].to(torch.int32)}, folder / "sae_weights.safetensors")
    with pytest.raises(ValueError, match=r"sae_weights.safetensors: W_enc is int32; a dictionary's weights are "
                                         r"floating point"):
        dl.load(folder)


def test_fit_refuses_what_no_step_can_train_on():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    sae = dl.TopKSAE(16, 32, 4)
    for steps in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=rf"steps must be a positive integer, got {steps!r}"):
            dl.fit(sae, [[x]], steps=steps, progress=False)
    with pytest.raises(ValueError, match="aux_k must be a positive integer, got -1"):
        dl.fit(sae, [[x]], steps=1, aux_k=-1, progress=False)
    with pytest.raises(ValueError, match=r"lr must be a number > 0, got nan"):
        dl.fit(sae, [[x]], steps=1, lr=float("nan"), progress=False)
    poisoned = x.clone()
    poisoned[5, 2] = float("nan")
    before = [p.detach().clone() for p in sae.parameters()]
    with pytest.raises(ValueError, match=r"fit: batch 1's x has NaN or infinite values \(row 5 of 64, 1 rows in all\)"):
        dl.fit(sae, [[x], [poisoned]], steps=5, progress=False)
    assert all(p.isfinite().all() for p in sae.parameters()) and len(before) == 4
    with pytest.raises(ValueError, match=r"fit: batch 0's x is torch.float32 \[64, 8\]; the TopKSAE trains on float "
                                         r"rows \[N, d_in=16\]"):
        dl.fit(sae, [[x[:, :8]]], steps=1, progress=False)
    with pytest.raises(ValueError, match=r"fit: batch 0's x has no variance \(all 64 rows are the same\)"):
        dl.fit(sae, [[torch.ones(64, 16)]], steps=1, progress=False)
    transcoder = dl.Transcoder(16, 12, 32, 4)
    with pytest.raises(ValueError, match=r"fit: batch 0's x is all zeros"):
        dl.fit(transcoder, [[torch.zeros(64, 16), x[:, :12]]], steps=1, progress=False)
    with pytest.raises(ValueError, match=r"fit: batch 0's y is torch.float32 \[64, 16\]; the Transcoder trains on "
                                         r"float rows \[N, d_out=12\]"):
        dl.fit(transcoder, [[x]], steps=1, progress=False)


def test_training_names_a_bad_argument(nano):
    model, _ = nano
    with pytest.raises(TypeError, match=r"texts must be a list of strings, got one string \(32 characters\)"):
        dl.train_sae(model, RESID, TEXTS[0], progress=False)
    with pytest.raises(TypeError, match=r"texts\[1\] is a int; texts are strings"):
        dl.evaluate(model, RESID, dl.TopKSAE(128, 64, 4), [TEXTS[0], 3])
    for name in ("context", "batch_size"):
        with pytest.raises(ValueError, match=rf"{name} must be a positive integer, got 0"):
            dl.train_sae(model, RESID, TEXTS, **{name: 0}, progress=False)
        with pytest.raises(ValueError, match=rf"{name} must be a positive integer, got 0"):
            dl.evaluate(model, RESID, dl.TopKSAE(128, 64, 4), TEXTS, **{name: 0})
    with pytest.raises(ValueError, match="aux_k must be a positive integer, got -1"):
        dl.train_sae(model, RESID, TEXTS, aux_k=-1, progress=False)
    with pytest.raises(ValueError, match=r"buffer_tokens=100 cannot fill one step of batch_tokens=256"):
        dl.train_sae(model, RESID, TEXTS, batch_tokens=256, buffer_tokens=100, progress=False)
    with pytest.raises(ValueError, match=r"layers.3.hook_resid_post's rows are 128 wide, but the TopKSAE reads 64"):
        dl.train_dictionary(model, dl.TopKSAE(64, 64, 4), RESID, TEXTS, progress=False)
    with pytest.raises(ValueError, match=r"evaluate: layers.3.hook_resid_post's rows are 128 wide \(\[3, \d+, 128\]\) "
                                         r"but the dictionary encodes d_in=64"):
        dl.evaluate(model, RESID, dl.TopKSAE(64, 64, 4), TEXTS)
    with pytest.raises(TypeError, match="dictionary must have encode.* got Linear"):
        dl.evaluate(model, RESID, torch.nn.Linear(128, 128), TEXTS)


def test_a_failed_save_leaves_the_folder_as_it_was(tmp_path):
    old = randomized(dl.TopKSAE(16, 64, 5, {"hook_name": RESID}), seed=1)
    folder = old.save(tmp_path / "sae")
    (folder / "notes.txt").write_text("mine")  # a file of the user's, beside the dictionary
    new = randomized(dl.TopKSAE(16, 64, 5, {"hook_name": RESID}), seed=2)

    def broken() -> dict:
        raise OSError("disk full")

    new.config = broken  # the failure comes while cfg.json is written, after the weights
    with pytest.raises(OSError, match="disk full"):
        new.save(folder)
    kept = dl.load(folder)
    assert torch.equal(kept.W_enc, old.W_enc)  # the old weights under the old config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sae"]  # no staging folder left, beside or inside
    assert sorted(p.name for p in folder.iterdir()) == ["cfg.json", "notes.txt", "sae_weights.safetensors"]
    assert (folder / "notes.txt").read_text() == "mine"
    del new.config
    new.save(folder)
    assert torch.equal(dl.load(folder).W_enc, new.W_enc) and (folder / "notes.txt").read_text() == "mine"
    with pytest.raises(NotADirectoryError, match="exists and is not a folder"):
        new.save(folder / "notes.txt")


def test_load_names_the_file_and_the_field(tmp_path):
    folder = randomized(dl.TopKSAE(16, 64, 5)).save(tmp_path / "sae")
    config, weights = folder / "cfg.json", folder / "sae_weights.safetensors"
    cfg = json.loads(config.read_text())
    config.write_text("{not json")
    with pytest.raises(ValueError, match=r"cfg.json is not valid JSON"):
        dl.load(folder)
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"cfg.json must hold a JSON object \(the dictionary's fields\), got a list"):
        dl.load(folder)
    config.write_text(json.dumps({key: value for key, value in cfg.items() if key != "d_sae"}))
    with pytest.raises(ValueError, match=r"cfg.json has no d_sae \(a topk dictionary's sizes\)"):
        dl.load(folder)
    config.write_text(json.dumps({**cfg, "d_in": "16"}))
    with pytest.raises(ValueError, match=r"cfg.json: d_in must be a positive integer, got '16'"):
        dl.load(folder)
    config.write_text(json.dumps({**cfg, "metadata": ["hook_name"]}))
    with pytest.raises(ValueError, match=r"cfg.json: metadata must be a JSON object, got a list"):
        dl.load(folder)
    config.write_text(json.dumps({**cfg, "d_in": 8}))
    with pytest.raises(ValueError, match=r"sae_weights.safetensors: W_enc is \[16, 64\] but cfg.json gives \[8, 64\] "
                                         r"\(d_in=8, d_sae=64, k=5\)"):
        dl.load(folder)
    config.write_text(json.dumps(cfg))
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"sae_weights.safetensors is not a readable safetensors file"):
        dl.load(folder)
    weights.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"sae_weights.safetensors is not a readable safetensors file"):
        dl.load(folder)
    from safetensors.torch import save_file

    save_file({"W_enc": torch.zeros(16, 64)}, weights)
    with pytest.raises(ValueError, match=r"sae_weights.safetensors has no tensor b_enc \(it holds \['W_enc'\]\)"):
        dl.load(folder)


def test_a_failed_first_save_leaves_nothing(tmp_path):
    sae = randomized(dl.TopKSAE(16, 64, 5))

    def broken() -> dict:
        raise OSError("disk full")

    sae.config = broken
    with pytest.raises(OSError, match="disk full"):
        sae.save(tmp_path / "new")
    assert list(tmp_path.iterdir()) == []


def test_ce_recovered_is_undefined_where_the_ablation_costs_nothing():
    assert math.isnan(dl.ce_recovered(ce_clean=3.0, ce_spliced=3.1, ce_zero=3.0))
    metrics = dl.DictionaryMetrics(fvu=0.1, mean_l0=4.0, dead_fraction=0.0, ce_clean=3.0, ce_spliced=3.1, ce_zero=9.0,
                                   ce_mean=3.0, tokens=10)
    assert math.isnan(metrics.ce_recovered_mean) and "nan% against mean-ablation" in str(metrics)
