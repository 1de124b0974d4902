"""The model on the meta device: shapes without memory, so a learner can run the full Kimi K2 (1.03 trillion
parameters) and see every probe's shape on a laptop. Ids made on the CPU go in as they would on a GPU node."""

from __future__ import annotations

import pytest
import torch

from k2lab import K2Config, K2Model


@pytest.fixture(scope="module", params=["nano", "kimi_k2"])
def model(request):
    return K2Model(getattr(K2Config, request.param)(), device="meta")


def test_a_forward_of_cpu_ids_gives_the_logits_shape_on_meta(model):
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    logits = model(ids)
    assert logits.device.type == "meta" and logits.shape == (2, 5, model.config.vocab_size)
    assert logits.dtype == torch.float32


def test_run_with_cache_shows_every_probes_shape(model):
    cfg = model.config
    ids = torch.tensor([[1, 2, 3, 4]])
    _, cache = model.run_with_cache(ids, names=["hook_resid_post", "mlp.gate.", "hook_expert_out", "hook_pattern",
                                                "hook_kv_latent"])
    last = cfg.num_hidden_layers - 1
    assert cache[f"layers.{last}.hook_resid_post"].shape == (1, 4, cfg.hidden_size)
    assert cache[f"layers.{last}.mlp.gate.hook_scores"].shape == (1, 4, cfg.n_routed_experts)
    assert cache[f"layers.{last}.mlp.gate.hook_topk_idx"].shape == (1, 4, cfg.num_experts_per_tok)
    assert cache[f"layers.{last}.mlp.hook_expert_out"].shape == (1, 4, cfg.num_experts_per_tok, cfg.hidden_size)
    assert cache[f"layers.{last}.self_attn.hook_pattern"].shape == (1, cfg.num_attention_heads, 4, 4)
    assert cache[f"layers.{last}.self_attn.hook_kv_latent"].shape == (1, 4, cfg.kv_lora_rank)
    assert all(t.device.type == "meta" for t in cache.values())


def test_a_decode_step_through_the_latent_cache_and_a_padded_batch_run_on_meta(model):
    cache = model.new_cache(2)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    model(ids, cache=cache, attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    step = model(torch.tensor([[8], [9]]), cache=cache)
    assert step.shape == (2, 1, model.config.vocab_size) and cache.length == 5
    assert cache.latents(0).shape == (2, 5, model.config.kv_lora_rank + model.config.qk_rope_head_dim)
