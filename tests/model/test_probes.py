"""Probes: every hook point fires with the documented meaning, run_with_cache, the activation cache's analyses,
and the hooks context manager (replacement, cleanup, gradients). HF transformers is the oracle for edits."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hf_oracle import hf_model, relative_error, save_and_load
from tiny import TINY, random_model, token_ids

from k2lab.model.moe import MoE

SHAPES = {  # probe leaf -> expected shape, for B=2, T=7 and TINY (H=4 heads, k=4 of E=16 experts)
    "hook_resid_pre": (2, 7, 256), "hook_resid_mid": (2, 7, 256), "hook_resid_post": (2, 7, 256),
    "hook_attn_out": (2, 7, 256), "hook_mlp_out": (2, 7, 256), "hook_out": (2, 7, 256),
    "hook_q_latent": (2, 7, 96), "hook_kv_latent": (2, 7, 64), "hook_q_nope": (2, 7, 4, 32),
    "hook_q_pe": (2, 7, 4, 16), "hook_rot_q_pe": (2, 7, 4, 16), "hook_k_pe": (2, 7, 16), "hook_rot_k_pe": (2, 7, 16),
    "hook_attn_scores": (2, 4, 7, 7), "hook_max_logit": (2, 4), "hook_pattern": (2, 4, 7, 7), "hook_z": (2, 7, 4, 32),
    "hook_logits": (2, 7, 512), "gate.hook_logits": (2, 7, 16), "hook_scores": (2, 7, 16),
    "hook_choice_scores": (2, 7, 16), "hook_topk_idx": (2, 7, 4), "hook_topk_weights": (2, 7, 4),
    "hook_expert_out": (2, 7, 4, 256), "hook_routed_out": (2, 7, 256), "hook_shared_out": (2, 7, 256),
}


_ids = partial(token_ids, length=7)  # [2, 7] unless asked otherwise, as SHAPES assumes


@pytest.fixture(scope="module")
def run(model):
    with torch.no_grad():
        return model.run_with_cache(_ids())


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    ref = hf_model(TINY, seed=3)
    return ref, save_and_load(ref, tmp_path_factory.mktemp("probes"))


# ---- every probe fires, with its documented shape, in both attention paths -------------------------------------------
@pytest.mark.parametrize("cfg", [TINY, TINY.replace(q_lora_rank=None)], ids=["q_latent", "no_q_latent"])
@pytest.mark.parametrize("attn_impl", ["naive", "absorbed"])
def test_every_probe_fires_with_its_shape(cfg, attn_impl):
    model = random_model(cfg)
    with torch.no_grad():
        _, cache = model.run_with_cache(_ids(cfg), attn_impl=attn_impl)
    assert sorted(cache) == sorted(model.hook_names())  # every listed probe fired
    order = list(cache)  # firing order
    assert order[:2] == ["embed_tokens.hook_out", "layers.0.hook_resid_pre"] and order[-2:] == ["norm.hook_out",
                                                                                              "hook_logits"]
    assert ("layers.0.self_attn.hook_q_latent" in cache) == (cfg.q_lora_rank is not None)
    for name, tensor in cache.items():
        leaf = "gate.hook_logits" if name.endswith("gate.hook_logits") else name.rsplit(".", 1)[-1]
        assert tuple(tensor.shape) == SHAPES[leaf], name
    assert cache.layer_indices("mlp.hook_expert_out") == [1, 2]  # layer 0 is dense


def test_pattern_and_z_agree_between_paths(model):
    ids = _ids()
    with torch.no_grad():
        _, naive = model.run_with_cache(ids, names=lambda n: n.endswith(("pattern", "attn_scores", "hook_z")),
                                        attn_impl="naive")
        _, absorbed = model.run_with_cache(ids, names=lambda n: n.endswith(("pattern", "attn_scores", "hook_z")),
                                           attn_impl="absorbed")
    assert list(naive) == list(absorbed) and len(naive) == 3 * TINY.num_hidden_layers
    for name in naive:
        finite = naive[name].isfinite()
        assert torch.equal(finite, absorbed[name].isfinite()), name  # the same masked entries
        assert relative_error(absorbed[name][finite], naive[name][finite]) < 1e-5, name


def test_pattern_and_z_agree_between_paths_when_decoding(model):
    ids = _ids(length=9)
    got = {}
    with torch.no_grad():
        for attn_impl in ("naive", "absorbed"):
            cache = model.new_cache(batch_size=2)
            model(ids[:, :8], cache=cache, attn_impl=attn_impl)
            _, got[attn_impl] = model.run_with_cache(ids[:, 8:], names="layers.2.self_attn",
                                                     cache=cache, attn_impl=attn_impl)
    assert got["naive"]["layers.2.self_attn.hook_pattern"].shape == (2, 4, 1, 9)
    for name in ("layers.2.self_attn.hook_pattern", "layers.2.self_attn.hook_z"):
        assert relative_error(got["absorbed"][name], got["naive"][name]) < 1e-5, name


def test_pattern_is_a_causal_softmax(run):
    _, cache = run
    pattern, scores = cache.stack("hook_pattern"), cache.stack("hook_attn_scores")  # [L, B, H, T, T]
    above = torch.ones(7, 7, dtype=torch.bool).triu(1)
    assert torch.allclose(pattern.sum(-1), torch.ones(()), atol=1e-6)
    assert (pattern[..., above] == 0).all() and (pattern[..., ~above] > 0).all()
    assert scores[..., above].isneginf().all()
    assert torch.allclose(pattern, scores.softmax(-1), atol=1e-7)


@pytest.mark.parametrize("attn_impl", ["naive", "absorbed"])
def test_max_logit_is_each_heads_largest_visible_score(model, attn_impl):
    """Probed alone, the naive path keeps its fused kernel and computes the maximum aside; either way it is the
    largest entry of each row's and head's masked scores, as QK-Clip reads it."""
    ids = _ids()
    with torch.no_grad():
        _, scores = model.run_with_cache(ids, names="hook_attn_scores", attn_impl=attn_impl)
        _, alone = model.run_with_cache(ids, names="hook_max_logit", attn_impl=attn_impl)
    for layer in range(TINY.num_hidden_layers):
        want = scores[f"layers.{layer}.self_attn.hook_attn_scores"].amax(dim=(-2, -1))  # [B, H]
        torch.testing.assert_close(alone[f"layers.{layer}.self_attn.hook_max_logit"], want, rtol=1e-5, atol=1e-6)


# ---- router probes ---------------------------------------------------------------------------------------------------
def test_router_probes_mean_what_the_design_says(model, run):
    _, cache = run
    for i in (1, 2):
        gate, p = model.layers[i].mlp.gate, f"layers.{i}.mlp.gate."
        logits, scores, choice = cache[p + "hook_logits"], cache[p + "hook_scores"], cache[p + "hook_choice_scores"]
        idx, weights = cache[p + "hook_topk_idx"], cache[p + "hook_topk_weights"]
        bias = gate.e_score_correction_bias
        assert bias.abs().min() > 0  # a zero bias would hide swapped scores
        x = model.layers[i].post_attention_layernorm(cache[f"layers.{i}.hook_resid_mid"])
        assert torch.allclose(logits, x @ gate.weight.T, atol=1e-5)
        assert torch.equal(scores, logits.sigmoid())
        assert torch.allclose(choice - scores, bias.expand_as(choice), atol=1e-6)
        assert torch.equal(idx, choice.topk(4, dim=-1).indices)  # chosen by the biased choice scores
        assert not torch.equal(idx.sort(-1).values, scores.topk(4).indices.sort(-1).values)  # the bias matters here
        gathered = scores.gather(-1, idx)  # weights come from the unbiased scores
        assert torch.allclose(weights, gathered / gathered.sum(-1, keepdim=True) * TINY.routed_scaling_factor)


def test_expert_out_is_each_slot_before_weighting(model, run):
    _, cache = run
    moe = model.layers[2].mlp
    x = model.layers[2].post_attention_layernorm(cache["layers.2.hook_resid_mid"])  # [B, T, D]
    idx, out = cache["layers.2.mlp.gate.hook_topk_idx"], cache["layers.2.mlp.hook_expert_out"]
    b, t, slot = 1, 5, 2
    gate, up, down = moe.experts.expert_weights(idx[b, t, slot].item())
    h = x[b, t]
    with torch.no_grad():
        expected = down @ (torch.nn.functional.silu(gate @ h) * (up @ h))
    assert torch.allclose(out[b, t, slot], expected, atol=1e-5)
    weights = cache["layers.2.mlp.gate.hook_topk_weights"]
    assert torch.allclose(cache["layers.2.mlp.hook_routed_out"], (out * weights[..., None]).sum(2), atol=1e-6)
    assert torch.allclose(cache["layers.2.hook_mlp_out"],
                          cache["layers.2.mlp.hook_routed_out"] + cache["layers.2.mlp.hook_shared_out"], atol=1e-6)


def test_replacing_topk_idx_reroutes_and_reweights(model, run):
    _, plain = run
    forced = torch.tensor([3, 7, 11, 15])

    def force(idx, hook):
        return forced.expand_as(idx)

    with torch.no_grad():
        with model.hooks(fwd_hooks=[("layers.1.mlp.gate.hook_topk_idx", force)]):
            logits, cache = model.run_with_cache(_ids())
    assert (cache["layers.1.mlp.gate.hook_topk_idx"] == forced).all()
    gathered = plain["layers.1.mlp.gate.hook_scores"][..., forced]  # the router reweighs the new experts
    expected = gathered / gathered.sum(-1, keepdim=True) * TINY.routed_scaling_factor
    assert torch.allclose(cache["layers.1.mlp.gate.hook_topk_weights"], expected, atol=1e-6)
    moe = model.layers[1].mlp
    x = model.layers[1].post_attention_layernorm(cache["layers.1.hook_resid_mid"])
    with torch.no_grad():
        gate, up, down = moe.experts.expert_weights(7)
        expert7 = torch.nn.functional.silu(x @ gate.T) * (x @ up.T) @ down.T
    assert torch.allclose(cache["layers.1.mlp.hook_expert_out"][:, :, 1], expert7, atol=1e-5)
    assert relative_error(logits, plain["hook_logits"]) > 1e-3


def test_replacing_topk_weights_changes_the_routed_sum(model):
    with torch.no_grad():
        with model.hooks(fwd_hooks=[("layers.2.mlp.gate.hook_topk_weights", lambda w, hook: torch.zeros_like(w))]):
            _, cache = model.run_with_cache(_ids(), names="layers.2.mlp")
    assert (cache["layers.2.mlp.hook_routed_out"] == 0).all()


# ---- run_with_cache --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn_impl", ["naive", "absorbed"])
def test_run_with_cache_returns_the_plain_logits(model, attn_impl):
    ids = _ids()
    with torch.no_grad():
        plain = model(ids, attn_impl=attn_impl)
        logits, cache = model.run_with_cache(ids, attn_impl=attn_impl)  # patterns force the explicit softmax
    assert relative_error(logits, plain) < 1e-5
    assert torch.equal(cache["hook_logits"], logits)


def test_names_as_list_substring_or_predicate(model):
    ids = _ids()
    with torch.no_grad():
        _, by_list = model.run_with_cache(ids, names=["layers.1.hook_attn_out", "norm.hook_out"])
        _, by_substring = model.run_with_cache(ids, names="hook_resid_post")
        _, by_predicate = model.run_with_cache(ids, names=lambda n: n.startswith("layers.2.mlp.gate"))
    assert list(by_list) == ["layers.1.hook_attn_out", "norm.hook_out"]
    assert list(by_substring) == [f"layers.{i}.hook_resid_post" for i in range(3)]
    assert len(by_predicate) == 5
    with pytest.raises(KeyError, match="hook_resid_post"):
        model.run_with_cache(ids, names=["layers.1.hook_resid_pst"])


def test_cache_is_detached_and_moved(model):
    ids = _ids()
    logits, cache = model.run_with_cache(ids, names=["layers.1.hook_attn_out", "layers.1.mlp.gate.hook_topk_idx"],
                                         dtype=torch.float16, device="cpu")
    assert logits.requires_grad  # the forward itself is untouched
    assert not cache["layers.1.hook_attn_out"].requires_grad
    assert cache["layers.1.hook_attn_out"].dtype == torch.float16
    assert cache["layers.1.mlp.gate.hook_topk_idx"].dtype == torch.int64  # ids are never cast


def test_cache_mapping_and_repr(run):
    _, cache = run
    assert "layers.1.hook_attn_out" in cache and "layers.1.hook_attn" not in cache
    assert dict(cache.items()).keys() == set(cache.keys())
    text = repr(cache)
    assert text.startswith(f"ActivationCache({len(cache)} probes)")
    assert "layers.1.mlp.gate.hook_topk_idx" in text and "[2, 7, 4] int64" in text
    with pytest.raises(KeyError, match="layers.1.hook_attn_out"):
        cache["layers.1.hook_attn_ot"]


def test_stack_over_layers(run):
    _, cache = run
    assert cache.stack("hook_resid_post").shape == (3, 2, 7, 256)
    assert torch.equal(cache.stack("hook_resid_post")[1], cache["layers.1.hook_resid_post"])
    assert cache.stack("gate.hook_topk_idx").shape == (3, 2, 7, 4)  # a row per layer, the dense one's -1 ...
    assert bool((cache.stack("gate.hook_topk_idx")[0] == -1).all())
    assert cache.stack_present("gate.hook_topk_idx")[1].shape == (2, 2, 7, 4)  # ... or the MoE layers only,
    assert cache.layer_indices("gate.hook_topk_idx") == [1, 2]  # ... which are these
    assert cache.layer_indices("hook_topk_idx") == [1, 2]
    assert cache.layer_indices("hook_logits") == [1, 2]  # the router's; the model's own is not per layer
    with pytest.raises(KeyError, match="closest"):
        cache.stack("hook_resid_pots")


# ---- logit lens, decomposition, direct logit attribution -------------------------------------------------------------
def test_logit_lens_last_layer_is_the_logits(run):
    logits, cache = run
    lens = cache.logit_lens()
    assert lens.shape == (3, 2, 7, 512)
    assert torch.equal(lens[-1], logits)
    assert torch.allclose(cache.logit_lens(pos=-1), lens[:, :, -1], atol=1e-5)  # other matmul blocking


def test_decomposition_sums_to_the_final_residual(run):
    _, cache = run
    parts = cache.decompose_resid()
    residual = cache["layers.2.hook_resid_post"]
    assert torch.allclose(parts.total(), residual, atol=1e-5)
    labels, stacked = parts.components(split_moe=True)
    assert labels == ["embed", "L0.attn", "L0.mlp", "L1.attn", "L1.shared", "L1.routed", "L2.attn", "L2.shared",
                      "L2.routed"]
    assert torch.allclose(stacked.sum(0), residual, atol=1e-5)
    assert parts.moe_layers == [1, 2] and parts.expert_slots.shape == (2, 2, 7, 4, 256)
    assert torch.allclose(parts.expert_slots.sum(-2), parts.routed, atol=1e-6)
    assert torch.allclose(parts.shared + parts.routed, parts.mlp[1:], atol=1e-6)
    assert torch.equal(parts.expert_ids, cache.stack("gate.hook_topk_idx")[1:])
    by_expert = parts.by_expert(2)  # [E, B, T, D]
    assert by_expert.shape == (16, 2, 7, 256)
    assert torch.allclose(by_expert.sum(0), parts.routed[1], atol=1e-6)
    chosen = torch.zeros(2, 7, 16, dtype=torch.bool).scatter_(-1, cache["layers.2.mlp.gate.hook_topk_idx"], True)
    assert (by_expert.permute(1, 2, 0, 3)[~chosen] == 0).all()


def test_direct_logit_attribution_sums_to_the_logit(model, run):
    logits, cache = run
    token = 17
    attr = cache.logit_attribution(token)
    assert attr.attn.shape == (3, 2, 7) and attr.expert_slots.shape == (2, 2, 7, 4)
    assert torch.allclose(attr.residual, logits[..., token], atol=1e-4)
    assert torch.allclose(attr.total(), logits[..., token], atol=1e-4)
    assert torch.allclose(attr.by_expert(1).sum(0), attr.routed[0], atol=1e-5)
    # per-row targets at one position, and a logit difference as a direction
    targets = torch.tensor([5, 9])
    at_last = cache.logit_attribution(targets, pos=-1)
    assert torch.allclose(at_last.total(), logits[:, -1].gather(-1, targets[:, None])[:, 0], atol=1e-4)
    assert at_last.by_expert(2).shape == (16, 2)  # [E, B] at one position
    assert torch.allclose(at_last.by_expert(2).sum(0), at_last.routed[1], atol=1e-5)
    head = model.lm_head.weight
    diff = cache.logit_attribution(head[5] - head[9], pos=-1)
    assert torch.allclose(diff.total(), logits[:, -1, 5] - logits[:, -1, 9], atol=1e-4)


def test_attribution_target_must_fit_the_residual(run):
    _, cache = run
    with pytest.raises(ValueError, match=r"direction of shape \(3, 256\).*\(2, 7, 256\)"):
        cache.logit_attribution(torch.randn(3, 256))


def test_analyses_name_missing_probes(model):
    with torch.no_grad():
        _, cache = model.run_with_cache(_ids(), names="hook_attn_out")
    with pytest.raises(KeyError, match="decompose_resid needs"):
        cache.decompose_resid()
    with pytest.raises(KeyError, match="logit_lens needs"):
        cache.logit_lens()


# ---- the hooks context manager ---------------------------------------------------------------------------------------
def test_hooks_are_removed_after_an_exception(model):
    with pytest.raises(RuntimeError, match="boom"):
        with model.hooks(fwd_hooks=[("layers.1.hook_attn_out", lambda t, hook: t * 0),
                                    (lambda n: n.endswith("hook_pattern"), lambda t, hook: None)]):
            assert model.hook_point("layers.1.hook_attn_out").active
            raise RuntimeError("boom")
    assert not any(model.hook_point(n).active for n in model.hook_names())


def test_hook_raising_inside_the_forward_is_cleaned_up(model):
    def fail(t, hook):
        raise RuntimeError(f"inside {hook.name}")

    with pytest.raises(RuntimeError, match="inside layers.2.hook_mlp_out"):
        with model.hooks(fwd_hooks=[("layers.2.hook_mlp_out", fail)]):
            model(_ids())
    assert not any(model.hook_point(n).active for n in model.hook_names())


def test_unknown_name_raises_with_suggestions_and_attaches_nothing(model):
    with pytest.raises(KeyError, match=r"closest: \['layers.1.hook_attn_out'"):
        with model.hooks(fwd_hooks=[("layers.1.hook_mlp_out", print), ("layers.1.hook_atn_out", print)]):
            pass
    assert not model.hook_point("layers.1.hook_mlp_out").active
    with pytest.raises(KeyError, match="matched no probe"):
        with model.hooks(fwd_hooks=[(lambda n: "nowhere" in n, print)]):
            pass


def test_replacement_must_keep_the_shape(model):
    with pytest.raises(ValueError, match=r"layers.1.hook_attn_out returned \(2, 256\)"):
        with model.hooks(fwd_hooks=[("layers.1.hook_attn_out", lambda t, hook: t[:, 0])]):
            model(_ids())


def test_gradients_flow_through_probes(model):
    """Attribution patching: d(logit)/d(activation) through a hook, checked against a finite difference."""
    ids = _ids(batch=1)
    delta = torch.zeros(1, 7, 256, requires_grad=True)
    name = "layers.1.hook_resid_mid"
    with model.hooks(fwd_hooks=[(name, lambda t, hook: t + delta)]):
        model(ids)[0, -1, 17].backward()
    grad = delta.grad
    assert grad is not None and grad[0, -1].abs().sum() > 0
    step = 1e-2 * grad / grad.norm()
    with torch.no_grad():
        base = model(ids)[0, -1, 17]
        with model.hooks(fwd_hooks=[(name, lambda t, hook: t + step)]):
            moved = model(ids)[0, -1, 17]
    assert torch.allclose(moved - base, (grad * step).sum(), rtol=5e-2)
    model.zero_grad(set_to_none=True)


# ---- edits against HF transformers with edited weights ---------------------------------------------------------------
def test_zeroing_attn_out_equals_hf_with_o_proj_zeroed(hf_pair):
    ref, ours = hf_pair
    ids = _ids()
    with torch.no_grad():
        with ours.hooks(fwd_hooks=[("layers.1.hook_attn_out", lambda t, hook: torch.zeros_like(t))]):
            got = ours(ids)
        saved = ref.model.layers[1].self_attn.o_proj.weight.clone()
        ref.model.layers[1].self_attn.o_proj.weight.zero_()
        try:
            expected = ref(ids).logits
        finally:
            ref.model.layers[1].self_attn.o_proj.weight.copy_(saved)
        assert relative_error(got, expected) < 1e-4
        assert relative_error(ours(ids), expected) > 1e-2  # the edit mattered


def test_zeroing_one_experts_slots_equals_hf_with_its_down_proj_zeroed(hf_pair):
    ref, ours = hf_pair
    ids, layer, expert = _ids(), 2, 5
    seen = {}

    def remember(idx, hook):
        seen["idx"] = idx

    def zero_expert(out, hook):  # [B, T, k, D]
        return out.masked_fill((seen["idx"] == expert)[..., None], 0.0)

    with torch.no_grad():
        with ours.hooks(fwd_hooks=[(f"layers.{layer}.mlp.gate.hook_topk_idx", remember),
                                   (f"layers.{layer}.mlp.hook_expert_out", zero_expert)]):
            got = ours(ids)
        assert (seen["idx"] == expert).any()  # the expert is used by this prompt
        down = ref.model.layers[layer].mlp.experts.down_proj  # [E, D, I] in transformers 5
        assert down.shape == (16, 256, 96)
        saved = down[expert].clone()
        down[expert] = 0
        try:
            expected = ref(ids).logits
        finally:
            down[expert] = saved
    assert relative_error(got, expected) < 1e-4
    assert isinstance(ours.layers[layer].mlp, MoE)
