"""Nothing plausible and wrong (issue 49): each habit of a researcher that gave a plausible, wrong answer with no word
now gives the right one or a refusal that names the problem. One test per trap, each failing on the tree before."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from tiny import TINY, random_model, token_ids

import k2lab
from k2lab.analysis.dictionary import TopKSAE
from k2lab.analysis.interventions import ablate_experts, force_route, patch
from k2lab.analysis.splicing import splice
from k2lab.model import ActivationCache

RESID = "layers.1.hook_resid_post"


@pytest.fixture(scope="module")
def nano():
    model, tok = k2lab.load_nano()
    return model, tok


def padded_ids(tok, texts=("def f(x):\n    return x", "import os")) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids with the tokenizer's [PAD] and their mask, as to_tokens makes them."""
    return tok.encode_padded(list(texts))


def sae_of(width: int, seed: int = 0) -> TopKSAE:
    sae = TopKSAE(width, 64, 8)
    sae.reset_parameters(torch.Generator().manual_seed(seed))
    return sae


# ---- A. interventions hold through reset_hooks() ---------------------------------------------------------------------
def test_a_splice_holds_through_reset_hooks_and_its_probe_goes_with_it():
    model, ids = random_model(), token_ids(TINY)
    sae = sae_of(TINY.hidden_size)
    with torch.no_grad(), splice(model, RESID, sae) as features:
        spliced = model(ids)
        model.reset_hooks()
        assert torch.equal(model(ids), spliced)
        _, cache = model.run_with_cache(ids, names=features.name)
        assert cache[features.name].shape == (2, 17, 64) and bool(cache[features.name].any())
    with pytest.raises(KeyError, match="no probe named 'layers.1.hook_resid_post.hook_features'"):
        model.run_with_cache(ids, names=features.name)
    with torch.no_grad():
        assert not torch.allclose(model(ids), spliced)


@pytest.mark.parametrize("intervention", ["ablate_experts", "force_route", "patch"])
def test_interventions_hold_through_reset_hooks(intervention):
    model, ids = random_model(), token_ids(TINY)
    with torch.no_grad():
        plain, clean = model.run_with_cache(token_ids(TINY, seed=5), names="layers.1.hook_attn_out")
        contexts = {"ablate_experts": lambda: ablate_experts(model, {1: [0, 1, 2]}),
                    "force_route": lambda: force_route(model, {1: [3, 4, 5, 6]}),
                    "patch": lambda: patch(model, clean, "layers.1.hook_attn_out")}
        with contexts[intervention]():
            edited = model(ids)
            model.reset_hooks()
            assert torch.equal(model(ids), edited)
        assert not torch.equal(model(ids), edited)


# ---- B. TransformerLens's signatures hold positionally ---------------------------------------------------------------
@pytest.mark.parametrize("method", ["decompose_resid", "accumulated_resid", "apply_ln_to_stack", "logit_attrs"])
def test_the_analyses_take_transformerlens_arguments_in_its_order(method):
    """Every positional parameter of k2lab's method is TransformerLens's, in TransformerLens's order (as installed:
    transformer-lens comes with sae-lens); k2lab's own arguments are keyword-only."""
    tl = pytest.importorskip("transformer_lens")
    ours = [p for p in inspect.signature(getattr(ActivationCache, method)).parameters.values()
            if p.kind == p.POSITIONAL_OR_KEYWORD]
    theirs = list(inspect.signature(getattr(tl.ActivationCache, method)).parameters)
    assert [p.name for p in ours] == theirs[: len(ours)]


def test_decompose_resid_3_is_layer_3_and_accumulated_resid_takes_minus_one(nano):
    model, tok = nano
    ids = torch.tensor([tok.encode("def area(r):\n    return 3.14 * r * r\n")])
    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
    parts = cache.decompose_resid(3)  # TransformerLens: the terms of layer 3's resid_pre
    assert len(parts.attn) == len(parts.mlp) == 3 and parts.moe_layers == [1, 2]
    torch.testing.assert_close(parts.residual, cache["resid_pre", 3])
    torch.testing.assert_close(parts.total(), cache["resid_pre", 3], rtol=1e-5, atol=1e-5)
    mid, labels = cache.decompose_resid(3, True, "attn", return_labels=True)
    assert labels == ["embed", "L0.attn", "L1.attn", "L2.attn", "L3.attn"]
    stack, labels = cache.accumulated_resid(-1, return_labels=True)
    assert labels[-1] == "final_post" and len(labels) == model.config.num_hidden_layers + 1
    torch.testing.assert_close(stack, cache.accumulated_resid(None))
    upto, labels = cache.accumulated_resid(2, True, False, None, True, True)  # TL: incl_mid, apply_ln, pos, mlp_input
    assert labels == ["0_pre", "0_mid", "1_pre", "1_mid", "2_pre", "2_mid"]
    # apply_ln at layer 2's MLP input: each row through post_attention_layernorm with the rms of resid_mid[2] frozen,
    # so the rows that sum to resid_mid[2] come out summing to that norm's output (the MoE's input).
    terms, _ = cache.decompose_resid(2, True, return_labels=True)
    scaled = cache.apply_ln_to_stack(terms, 2, True)
    torch.testing.assert_close(scaled.sum(0), cache["ln2", 2], rtol=1e-4, atol=1e-5)


def test_logit_attrs_sum_to_the_logit_difference(nano):
    model, tok = nano
    ids = torch.tensor([tok.encode("print(len(x")])
    with torch.no_grad():
        logits, cache = model.run_with_cache(ids)
    a, b = tok.encode(")")[0], tok.encode("]")[0]
    stack, _ = cache.decompose_resid(pos_slice=-1, return_labels=True)  # [C, B, D]
    attrs = cache.logit_attrs(stack, a, b, pos_slice=-1)  # [C, B]
    torch.testing.assert_close(attrs.sum(0), logits[:, -1, a] - logits[:, -1, b], rtol=1e-4, atol=1e-4)


# ---- C. mean and resample ablation honour pads -----------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["mean", "resample"])
def test_a_padded_reference_without_a_mask_leaves_its_pads_out(nano, mode):
    model, tok = nano
    ids = torch.tensor([tok.encode("def f(x):")])
    reference, mask = padded_ids(tok)
    seed = {"seed": 0} if mode == "resample" else {}
    with torch.no_grad():
        with ablate_experts(model, {1: [0, 1, 2, 3]}, mode, reference=reference, reference_mask=mask, **seed):
            masked = model(ids)
        with ablate_experts(model, {1: [0, 1, 2, 3]}, mode, reference=reference, **seed):
            inferred = model(ids)
        _, cache = model.run_with_cache(reference, names="post_attention_layernorm.hook_out")
        assert torch.equal(cache.mask, mask.bool())
        with ablate_experts(model, {1: [0, 1, 2, 3]}, mode, reference=cache, **seed):
            from_cache = model(ids)
    torch.testing.assert_close(inferred, masked)
    torch.testing.assert_close(from_cache, masked)


def test_a_reference_that_is_not_finite_or_wrong_or_empty_is_refused_by_name(nano):
    model, tok = nano
    ids = torch.tensor([tok.encode("def f(x):")])
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names="layers.1.post_attention_layernorm.hook_out")
    poisoned = dict(cache)
    poisoned["layers.1.post_attention_layernorm.hook_out"] = cache["ln2", 1].clone().index_fill_(1, torch.tensor([2]),
                                                                                                 float("nan"))
    with pytest.raises(ValueError, match=r"reference\['layers.1.post_attention_layernorm.hook_out'\] holds NaN"):
        with ablate_experts(model, {1: [3]}, "mean", reference=poisoned):
            pass
    narrow = {"layers.1.post_attention_layernorm.hook_out": torch.zeros(1, 4, 64)}
    with pytest.raises(ValueError, match=r"is \(1, 4, 64\), but the model's .* is \[B, T, 128\]"):
        with ablate_experts(model, {1: [3]}, "mean", reference=narrow):
            pass
    with pytest.raises(ValueError, match=r"reference=: the reference ids must be integer token ids"):
        with ablate_experts(model, {1: [3]}, "mean", reference=torch.tensor([[1.5, 2.0]])):
            pass
    with pytest.raises(ValueError, match=r"experts\[1\] names no expert"):
        with ablate_experts(model, {1: []}, "mean", reference=ids):
            pass


# ---- D. the cache keeps the mask it was run with ---------------------------------------------------------------------
def test_a_cache_keeps_its_mask_and_its_tables_and_stacks_leave_pads_out(nano, tmp_path):
    model, tok = nano
    ids, mask = padded_ids(tok)
    with torch.no_grad():
        _, inferred = model.run_with_cache(ids)  # pads at the rows' edges, no mask given: inferred
        _, given = model.run_with_cache(ids, attention_mask=mask)
        trace = k2lab.routing.trace(model, ids)
    for cache in (inferred, given):
        assert torch.equal(cache.mask, mask.bool())
    table = inferred.to_dataframe(("topk_idx", 3))
    assert len(table) == len(trace.to_dataframe().query("layer == 3")) == int(mask.sum()) * 4
    assert torch.equal(k2lab.routing.RoutingTrace.from_cache(inferred).token_mask, mask.bool())
    stack = inferred.stack("hook_resid_post")  # [L, B, T, D]
    assert bool(stack[:, ~mask.bool()].isnan().all()) and not bool(stack[:, mask.bool()].isnan().any())
    assert bool((inferred.stack("hook_topk_idx")[:, ~mask.bool()] == -1).all())
    pattern = inferred.stack("hook_pattern")  # [L, B, H, T, S]: a pad's query row is NaN, a real one's sums to 1
    assert bool(pattern.permute(0, 1, 3, 2, 4)[:, ~mask.bool()].isnan().all())
    torch.testing.assert_close(pattern.permute(0, 1, 3, 2, 4)[:, mask.bool()].sum(-1),
                               torch.ones(pattern.shape[0], int(mask.sum()), pattern.shape[2]))
    assert inferred.stack("hook_max_logit").isfinite().all()  # [L, B, H]: no positions to mask
    loaded = ActivationCache.load(inferred.save(tmp_path / "run"))
    assert torch.equal(loaded.mask, mask.bool())


# ---- E. splice-aware attribution -------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep_error", [False, True])
def test_attribution_under_a_splice_still_sums_to_the_residual(nano, keep_error):
    model, tok = nano
    ids = torch.tensor([tok.encode("def area(r):\n    return 3.14 * r * r\n")])
    sae = sae_of(model.config.hidden_size)
    edit = lambda f, hook: f * 2  # an edit of the features moves the stream by what the dictionary says it means
    with torch.no_grad(), splice(model, "layers.3.hook_resid_post", sae, keep_error=keep_error) as features:
        with model.hooks(fwd_hooks=[(features.name, edit)]):
            logits, cache = model.run_with_cache(ids)
    parts = cache.decompose_resid()
    assert "L3.resid_post.edit" in parts.edits
    torch.testing.assert_close(parts.total(), parts.residual, rtol=1e-5, atol=1e-4)
    token = int(logits[0, -1].argmax())
    attribution = cache.logit_attribution(token)
    torch.testing.assert_close(attribution.total(), logits[0, :, token][None], rtol=1e-4, atol=1e-4)
    labels, _ = parts.components()
    assert labels.index("L3.resid_post.edit") == labels.index("L3.mlp") + 1
    with torch.no_grad():
        _, plain = model.run_with_cache(ids)
    assert plain.decompose_resid().edits == {}


# ---- F. stacks indexed by layer --------------------------------------------------------------------------------------
def test_a_stack_of_moe_probes_has_row_i_for_layer_i(nano):
    model, tok = nano
    ids = torch.tensor([tok.encode("x = 1")])
    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
    idx, scores = cache.stack("hook_topk_idx"), cache.stack("gate.hook_scores")
    assert idx.shape[0] == scores.shape[0] == model.config.num_hidden_layers
    assert bool((idx[0] == -1).all()) and bool(scores[0].isnan().all())  # layer 0 is dense
    assert torch.equal(idx[3], cache["topk_idx", 3]) and torch.equal(scores[4], cache["scores", 4])
    layers, present = cache.stack_present("hook_topk_idx")
    assert layers == [1, 2, 3, 4, 5] and torch.equal(present[2], cache["topk_idx", 3])


# ---- K. selectors match whole name components ------------------------------------------------------------------------
def test_a_selector_matches_whole_components_only():
    model = k2lab.K2Model(TINY.replace(num_hidden_layers=12), device="meta")
    assert {name.split(".")[1] for name in model.select_hook_names("layers.1")} == {"1"}
    assert model.select_hook_names("layers.1.hook_resid_post") == ["layers.1.hook_resid_post"]
    assert len(model.select_hook_names("hook_resid_post")) == 12
    assert len(model.select_hook_names("mlp.gate")) == 5 * 11
    for partial in ("blocks.1.hook_resid", "hook_resid", "layers.1.hook_res"):
        with pytest.raises(KeyError, match="no probe named"):
            model.select_hook_names(partial)


# ---- the hostile sweep's finds in the model and its cache ------------------------------------------------------------
def test_one_text_gives_one_answer_whether_read_as_text_or_as_its_tokens(nano):
    model, _ = nano
    with torch.no_grad():
        assert torch.equal(model("[PAD]x = 1"), model(model.to_tokens("[PAD]x = 1")))


@pytest.mark.parametrize("hooks", [None, ("hook_z", lambda t, hook: None)])
def test_run_with_hooks_names_hooks_that_are_not_a_list_of_pairs(hooks):
    model = random_model()
    with pytest.raises(ValueError, match=r"fwd_hooks takes a list of \(selector, fn\) pairs"):
        model.run_with_hooks(token_ids(TINY), fwd_hooks=hooks)


@pytest.mark.parametrize("device", ["mps", "xpu", "tpu"])
def test_devices_this_machine_lacks_are_named(nano, tmp_path, device):
    if device != "tpu" and getattr(torch.backends, device, None) and torch.accelerator.is_available():
        pytest.skip(f"this machine has {device}")
    model, _ = nano
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([[1, 2, 3]]), names="hook_resid_post")
    with pytest.raises(ValueError, match=rf"device='{device}' is not available on this machine \(available here: cpu"):
        cache.to(device)
    with pytest.raises(ValueError, match=rf"device='{device}' is not available on this machine"):
        ActivationCache.load(cache.save(tmp_path / "run"), device=device)
    with pytest.raises(ValueError, match=rf"device_map='{device}' is (not available on this machine|not a device)"):
        k2lab.load(k2lab.lab.NANO_DIR, device_map=device)


def test_saving_over_a_saved_cache_with_your_files_in_it_is_refused_and_keeps_them(nano, tmp_path):
    model, _ = nano
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([[1, 2, 3]]), names="hook_resid_post")
    folder = cache.save(tmp_path / "run")
    (folder / "notes.md").write_text("my notes")
    with pytest.raises(FileExistsError, match=r"holds \['notes.md'\], and a save replaces the whole directory"):
        cache.save(folder)
    assert (folder / "notes.md").read_text() == "my notes"
    meta = cache.to("meta")
    with pytest.raises(ValueError, match="hook_resid_post .* on the meta device"):
        meta.save(tmp_path / "meta")


def test_a_loaded_cache_is_checked_against_its_config(nano, tmp_path):
    model, _ = nano
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    folder = cache.save(tmp_path / "run")
    meta = json.loads((folder / "cache.json").read_text())
    meta["config"]["num_experts_per_tok"] = 2
    (folder / "cache.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"layers.1.mlp.gate.hook_topk_idx is \(1, 3, 4\), but the saved config makes "
                                         r"it \(1, 3, 2\)"):
        ActivationCache.load(folder)
    tensors = folder / "activations.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-100])  # a copy cut short
    with pytest.raises(ValueError, match="cannot be read as safetensors"):
        ActivationCache.load(folder)
    tensors.write_bytes(b"not a tensor file")
    with pytest.raises(ValueError, match="cannot be read as safetensors"):
        ActivationCache.load(folder)


# ---- generate's arguments, and what an index or a template file may make k2lab do ---------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"eos_token_id": 10**6}, r"eos_token_id must be a token id in 0..8191 \(or None for the config's\), got 1000000"),
    ({"eos_token_id": "[EOS]"}, r"eos_token_id must be a token id in 0..8191 .* got '\[EOS\]'"),
    ({"input_ids": [[1, 2, 3], [4, 5]]}, r"input_ids must be token ids \[B, T\] of one length per row"),
    ({"input_ids": ["def f(", [1, 2]]}, r"input_ids must be token ids \[B, T\] .* or text \(a string, or a list of "
                                        r"strings only\)"),
    ({"input_ids": ""}, r"input_ids must hold at least one token id per row.* \(the text encodes to no token\)"),
    ({"max_new_tokens": 10**6}, r"the prompt's 3 tokens plus max_new_tokens=1000000 exceed the model's "
                                r"max_position_embeddings"),
])
def test_generate_refuses_what_it_cannot_do_before_the_first_step(nano, kwargs, message):
    model, _ = nano
    call = {"input_ids": torch.tensor([[1, 2, 3]]), "max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        k2lab.generate(model, **call)


def test_a_tiny_temperature_samples_the_best_token_and_nan_logits_are_refused(nano):
    model, tok = nano
    ids = torch.tensor([tok.encode("def f(x):")])
    greedy = k2lab.generate(model, ids, 4)
    assert torch.equal(k2lab.generate(model, ids, 4, temperature=1e-30, seed=0), greedy)
    with torch.no_grad():
        saved = model.norm.weight.clone()
        model.norm.weight[0] = float("nan")
    try:
        with pytest.raises(ValueError, match=r"the model's logits hold NaN at step 0 \(row 0\)"):
            k2lab.generate(model, ids, 4)
    finally:
        with torch.no_grad():
            model.norm.weight.copy_(saved)


@pytest.mark.parametrize("entry", ["../elsewhere/model.safetensors", "/etc/passwd", "sub/model.safetensors", ".."])
def test_an_index_that_names_a_file_outside_its_folder_is_refused(tmp_path, entry):
    from k2lab.weights.reader import CheckpointError

    folder, nano = tmp_path / "ckpt", k2lab.lab.NANO_DIR
    folder.mkdir()
    for name in ("config.json", "model-1-of-1.safetensors"):
        (folder / name).write_bytes((nano / name).read_bytes())
    index = json.loads((nano / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.embed_tokens.weight"] = entry
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    wanted = rf"weight_map\['model.embed_tokens.weight'\] = '{entry}' is not a file name in the checkpoint's folder"
    with pytest.raises(CheckpointError, match=wanted):
        k2lab.load(folder)


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10**10 }}",
])
def test_a_chat_template_that_would_run_for_hours_is_stopped(template):
    from k2lab.tokenizer.template import TemplateTooCostly, render_template

    with pytest.raises(TemplateTooCostly, match="k2lab stops it there"):
        render_template(template, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("field", ["probes", "config"])
def test_a_cache_file_without_its_probes_or_config_is_named(nano, tmp_path, field):
    model, _ = nano
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([[1, 2, 3]]), names="hook_resid_post")
    folder = cache.save(tmp_path / "run")
    meta = json.loads((folder / "cache.json").read_text())
    del meta[field]
    (folder / "cache.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"cache.json': its '{field}' field is missing"):
        ActivationCache.load(folder)
