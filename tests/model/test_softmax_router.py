"""DeepSeek-V2's softmax router (scoring_func "softmax", greedy or group-limited top-k, no correction bias) against
HF transformers' DeepseekV2ForCausalLM in float32, same random weights, read back through k2lab.load."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import randomize, relative_error
from release_layout import _quiet_transformers, single_thread  # noqa: F401 - autouse: one thread for this module

import k2lab
from k2lab import K2Config

# DeepSeek-V2-Lite's switches at toy size: no query latent, 2 shared experts, YaRN x40 with mscale 0.707, theta 1e4.
V2_LITE_TINY = K2Config.mini().replace(
    vocab_size=512, num_hidden_layers=3, q_lora_rank=None, n_shared_experts=2, scoring_func="softmax",
    topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, rope_theta=10_000.0, rope_factor=40.0,
    beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707,
)
CONFIGS = {
    "v2_lite": V2_LITE_TINY,
    # DeepSeek-V2 (236B) routes within the topk_group groups of highest single score and scales by 16.
    "group_limited_greedy": V2_LITE_TINY.replace(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                 routed_scaling_factor=16.0, q_lora_rank=64),
}


def hf_v2_model(cfg: K2Config, seed: int):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**cfg.to_hf(), attn_implementation="eager")).float().eval()
    randomize(model, seed)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    ref = hf_v2_model(cfg, seed=len(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    with _quiet_transformers():
        ref.save_pretrained(folder)
    return cfg, ref, k2lab.load(folder).eval()


def _ids(cfg: K2Config, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(seed))


def test_config_is_read_back_as_a_softmax_router(pair):
    cfg, _, ours = pair
    assert ours.config == cfg
    gate = ours.layers[1].mlp.gate
    assert gate.e_score_correction_bias is None
    assert "layers.1.mlp.gate.e_score_correction_bias" not in ours.state_dict()


@pytest.mark.parametrize("attn_impl", ["naive", "absorbed"])
def test_logits_match_hf_deepseek_v2(pair, attn_impl):
    cfg, ref, ours = pair
    ids = _ids(cfg)
    with torch.no_grad():
        assert relative_error(ours(ids, attn_impl=attn_impl), ref(ids).logits) < 1e-4


def test_scores_are_the_softmax_and_choose_as_hf_does(pair):
    cfg, ref, ours = pair
    ids = _ids(cfg, seed=1)
    names = ["layers.2.mlp.gate.hook_logits", "layers.2.mlp.gate.hook_scores", "layers.2.mlp.gate.hook_choice_scores",
             "layers.2.mlp.gate.hook_topk_idx", "layers.2.mlp.gate.hook_topk_weights", "layers.2.hook_resid_mid"]
    with torch.no_grad():
        _, acts = ours.run_with_cache(ids, names=names)
        hf_gate = ref.model.layers[2].mlp.gate
        normed = ref.model.layers[2].post_attention_layernorm(acts["layers.2.hook_resid_mid"])
        hf_logits, hf_weights, hf_idx = hf_gate(normed)
    scores = acts["layers.2.mlp.gate.hook_scores"]
    assert torch.allclose(scores.sum(-1), torch.ones(()), atol=1e-6)
    assert torch.equal(acts["layers.2.mlp.gate.hook_choice_scores"], scores)  # no bias
    assert torch.allclose(acts["layers.2.mlp.gate.hook_logits"].flatten(0, 1), hf_logits, atol=1e-5)
    idx, weights = acts["layers.2.mlp.gate.hook_topk_idx"].flatten(0, 1), acts["layers.2.mlp.gate.hook_topk_weights"]
    ours_sorted, order = idx.sort(-1)
    hf_sorted, hf_order = hf_idx.sort(-1)
    assert torch.equal(ours_sorted, hf_sorted)
    assert torch.allclose(weights.flatten(0, 1).gather(-1, order), hf_weights.gather(-1, hf_order), atol=1e-6)
    # Without renormalisation the weights are the softmax probabilities times the routed scale.
    chosen = scores.gather(-1, acts["layers.2.mlp.gate.hook_topk_idx"])
    assert torch.allclose(weights, chosen * cfg.routed_scaling_factor)


def test_group_limited_greedy_keeps_the_groups_with_the_best_single_expert():
    cfg = CONFIGS["group_limited_greedy"]
    model = k2lab.K2Model(cfg)
    router = model.layers[1].mlp.gate
    logits = torch.full((1, 1, 16), -10.0)
    # Group 0 holds the single best expert; group 1 the best pair by sum (which noaux_tc would keep instead).
    logits[0, 0, 0] = 5.0
    logits[0, 0, 4:8] = torch.tensor([4.0, 4.0, 4.0, 4.0])
    logits[0, 0, 8] = 4.5
    with torch.no_grad(), model.hooks(fwd_hooks=[("layers.1.mlp.gate.hook_logits", lambda t, hook: logits)]):
        idx, _ = router(torch.zeros(1, 1, cfg.hidden_size))
    groups = set((idx.flatten() // 4).tolist())
    assert groups == {0, 2}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"scoring_func": "softmax"}, "topk_method"),  # with K2's noaux_tc
        ({"scoring_func": "softmax", "topk_method": "greedy", "n_group": 4, "topk_group": 2}, "n_group"),
        ({"scoring_func": "tanh"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),  # with K2's sigmoid
    ],
)
def test_router_switches_that_do_not_go_together_are_refused(change, named):
    with pytest.raises(ValueError, match=named):
        K2Config.mini().replace(**change)
