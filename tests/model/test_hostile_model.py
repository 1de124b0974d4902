"""Hostile inputs to the config, the model's forward and generate: each refused with an error naming the argument,
and a refused forward leaves the weights, the hooks and the logits as they were."""

from __future__ import annotations

import pytest
import torch
from tiny import MICRO, assert_refused_unchanged, micro_model

import k2lab
from k2lab import K2Model

IDS = torch.tensor([[1, 2, 3, 4]])


@pytest.mark.parametrize("field, value, named", [
    ("rms_norm_eps", -1.0, "rms_norm_eps must be a finite number > 0, got -1.0"),
    ("rms_norm_eps", 0.0, "rms_norm_eps must be a finite number > 0"),
    ("rope_theta", 0.0, "rope_theta must be a finite number > 0, got 0.0"),
    ("rope_theta", float("nan"), "rope_theta must be a finite number > 0, got nan"),
    ("routed_scaling_factor", float("inf"), "routed_scaling_factor must be a finite number > 0"),
    ("hidden_size", 0, "hidden_size must be a positive integer, got 0"),
    ("hidden_size", -32, "hidden_size must be a positive integer"),
    ("n_routed_experts", 2.5, "n_routed_experts must be a positive integer, got 2.5"),
    ("num_experts_per_tok", 2.0, "num_experts_per_tok must be a positive integer, got 2.0"),
    ("first_k_dense_replace", 0.5, "first_k_dense_replace must be a non-negative integer, got 0.5"),
    ("n_shared_experts", -1, "n_shared_experts must be a non-negative integer"),
    ("intermediate_size", 1.5, "intermediate_size must be a non-negative integer"),
    ("q_lora_rank", 0, "q_lora_rank must be a positive integer or None"),
    ("q_lora_rank", True, "q_lora_rank must be a non-negative integer or None, got True"),
    ("bos_token_id", 1.0, "bos_token_id must be a non-negative integer or None"),
    ("norm_topk_prob", "yes", "norm_topk_prob must be True or False"),
    ("original_max_position_embeddings", -1, "original_max_position_embeddings must be a non-negative integer"),
])
def test_a_bad_config_is_refused_when_made(field, value, named):
    with pytest.raises(ValueError, match=rf"K2Config\.{named}"):
        MICRO.replace(**{field: value})


@pytest.fixture(scope="module")
def model():
    return micro_model()


def other_cache(kind: str):
    if kind == "layers":
        return K2Model(MICRO.replace(num_hidden_layers=3)).new_cache(1)
    if kind == "width":
        return K2Model(MICRO.replace(kv_lora_rank=8)).new_cache(1)
    return K2Model(MICRO, dtype=torch.bfloat16).new_cache(1)


@pytest.mark.parametrize("call, error, named", [
    (lambda m: m([["a"]]), TypeError, r"input_ids must be integer token ids \[B, T\] .*got list"),
    (lambda m: m("hello"), ValueError, r"text input needs a tokenizer and this model has none attached"),
    (lambda m: m(torch.zeros(1, 3)), ValueError, r"input_ids must be integer token ids \[B, T\]; got torch.float32"),
    (lambda m: m(torch.ones(1, 3, dtype=torch.bool)), ValueError, "input_ids must be integer token ids"),
    (lambda m: m(torch.zeros(0, 4, dtype=torch.long)), ValueError, r"input_ids has no rows \(\(0, 4\)\)"),
    (lambda m: m(torch.zeros(1, 0, dtype=torch.long)), ValueError, "input_ids is empty"),
    (lambda m: m(torch.tensor([[1, 64]])), ValueError, "token id 64 is outside the vocabulary of 64"),
    (lambda m: m(IDS, cache="x"), TypeError, "cache must be a LatentCache from model.new_cache.*got str"),
    (lambda m: m(IDS, cache=other_cache("layers")), ValueError, "cache holds 3 layers .* needs 2 layers"),
    (lambda m: m(IDS, cache=other_cache("width")), ValueError, "cache holds 2 layers of 16 .* needs 2 layers of 24"),
    (lambda m: m(IDS, cache=other_cache("dtype")), ValueError, "cache holds .*torch.bfloat16.*needs .*torch.float32"),
    (lambda m: m(IDS, cache=m.new_cache(2)), ValueError, "cache holds 2 rows but input_ids has 1"),
    (lambda m: k2lab.generate(m, IDS, max_new_tokens=2.5), ValueError,
     "max_new_tokens must be an integer >= 0, got 2.5"),
    (lambda m: k2lab.generate(m, IDS, 3, temperature=float("nan")), ValueError,
     "temperature must be a finite number >= 0 .*got nan"),
    (lambda m: k2lab.generate(m, IDS, 3, temperature="hot"), ValueError, "temperature must be a finite number"),
    (lambda m: k2lab.generate(m, IDS, 3, temperature=1.0, top_k=2.5), ValueError,
     "top_k must be None or an integer >= 1, got 2.5"),
    (lambda m: k2lab.generate(m, IDS, 3, temperature=1.0, top_p=float("nan")), ValueError,
     r"top_p must be None or lie in \(0, 1\], got nan"),
    (lambda m: k2lab.generate(m, IDS, 3, seed=1.5), ValueError, "seed must be None or an integer, got 1.5"),
    (lambda m: k2lab.generate(m, IDS, -1), ValueError, "max_new_tokens must be an integer >= 0, got -1"),
])
def test_a_bad_forward_or_generate_argument_is_named_and_changes_nothing(model, call, error, named):
    assert_refused_unchanged(model, IDS, call, error, named)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_any_integer_dtype_of_ids_gives_the_int64_logits(model, dtype):
    with torch.no_grad():
        assert torch.equal(model(IDS.to(dtype)), model(IDS))
