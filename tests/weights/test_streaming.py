"""Routed experts streamed from the files through an LRU cache: results identical to the fully loaded model,
and the cache's counts."""

from __future__ import annotations

import math

import pytest
import torch
from release_layout import (
    TINY_FORMAT,
    TINY_FP8,
    release,
    single_thread,  # noqa: F401 - an autouse fixture: one thread for this module
    token_ids,
)
from tiny import experts_one_at_a_time

import k2lab
from k2lab.weights.quant.fp8 import scale_shape
from k2lab.weights.streaming import ExpertCache, StreamedExperts

E, D, I = TINY_FP8.n_routed_experts, TINY_FP8.hidden_size, TINY_FP8.moe_intermediate_size
EXPERT_FLOAT32_BYTES = 3 * I * D * 4
GRID_UP, GRID_DOWN = scale_shape((I, D), TINY_FORMAT.block), scale_shape((D, I), TINY_FORMAT.block)
EXPERT_STORED_BYTES = 3 * I * D + 4 * (2 * math.prod(GRID_UP) + math.prod(GRID_DOWN))  # e4m3 + float32 scales


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return release(tmp_path_factory)


@pytest.fixture(scope="module")
def full(folder):
    return experts_one_at_a_time(k2lab.load(folder, dtype=torch.float32))


def test_streamed_experts_equal_the_fully_loaded_model(folder, full):
    budget = 2 * EXPERT_FLOAT32_BYTES + 100  # about two experts
    model = k2lab.load(folder, dtype=torch.float32, expert_budget_bytes=budget)
    assert isinstance(model.layers[1].mlp.experts, StreamedExperts)
    assert not any(".experts." in name for name, _ in model.named_parameters())  # experts stay in the files
    ids = token_ids(TINY_FP8)
    with torch.no_grad():
        for attn_impl in ("naive", "absorbed"):
            torch.testing.assert_close(model(ids, attn_impl=attn_impl), full(ids, attn_impl=attn_impl),
                                       rtol=1e-5, atol=1e-5)  # other expert modules: equal to float32 rounding
    stats = model.expert_cache.stats
    assert stats.evictions > 0 and stats.hits + stats.misses > 0
    assert stats.bytes_read == stats.misses * EXPERT_STORED_BYTES
    assert stats.peak_bytes <= budget and stats.cached_bytes == 2 * EXPERT_FLOAT32_BYTES


def test_streamed_greedy_generation_equals_the_fully_loaded_model(folder, full):
    model = k2lab.load(folder, dtype=torch.float32, expert_budget_bytes=3 * EXPERT_FLOAT32_BYTES)
    ids = token_ids(TINY_FP8, batch=1, length=5, seed=3)
    assert torch.equal(k2lab.generate(model, ids, 6), k2lab.generate(full, ids, 6))


def test_experts_kept_during_generation_serve_a_later_forward_under_autograd(folder, full):
    """generate runs in inference mode; what the expert cache keeps from it must stay ordinary tensors."""
    model = k2lab.load(folder, dtype=torch.float32, expert_budget_bytes=10 * EXPERT_FLOAT32_BYTES)
    ids = token_ids(TINY_FP8, batch=1, length=5, seed=3)
    k2lab.generate(model, ids, 2)
    assert model.expert_cache.stats.cached_bytes > 0
    assert not any(t.is_inference() for entry in model.expert_cache._entries.values() for t in entry)
    model(ids, return_type="loss").backward()  # saving an inference tensor for backward would raise here
    assert model.embed_tokens.weight.grad is not None


def test_fp8_resident_streaming_caches_e4m3_and_matches(folder, full):
    model = k2lab.load(folder, dtype=torch.float32, expert_budget_bytes=10**7, quantized_resident=True)
    ids = token_ids(TINY_FP8, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), full(ids), rtol=1e-5, atol=1e-5)
    stats = model.expert_cache.stats
    assert stats.cached_bytes == stats.misses * EXPERT_STORED_BYTES  # held as stored: e4m3 values and scales


def test_a_budget_holding_everything_reads_each_expert_once(folder):
    model = k2lab.load(folder, dtype=torch.float32, expert_budget_bytes=10**9)
    ids = token_ids(TINY_FP8, seed=5)
    with torch.no_grad():
        model(ids)
        misses, read = model.expert_cache.stats.misses, model.expert_cache.stats.bytes_read
        model.expert_cache.reset_stats()
        model(ids)
    stats = model.expert_cache.stats
    assert stats.misses == 0 and stats.hits == misses and stats.bytes_read == 0 and read > 0
    assert stats.evictions == 0 and stats.cached_bytes == misses * EXPERT_FLOAT32_BYTES


def test_a_zero_budget_streams_every_use_and_keeps_nothing(folder, full):
    model = k2lab.load(folder, dtype=torch.float32, expert_budget_bytes=0)
    ids = token_ids(TINY_FP8, seed=6)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), full(ids), rtol=1e-5, atol=1e-5)
    assert model.expert_cache.stats.peak_bytes == 0 and model.expert_cache.stats.hits == 0


def test_a_streamed_model_follows_a_later_dtype_change(folder):
    model = k2lab.load(folder, dtype=torch.float32, expert_budget_bytes=10**7).bfloat16()
    ids = token_ids(TINY_FP8, seed=7)
    assert model.layers[1].mlp.experts.dtype == torch.bfloat16  # the streamed experts' weights follow
    with torch.no_grad():  # each weight is rounded once from the same float32 values either way; other modules
        torch.testing.assert_close(model(ids), experts_one_at_a_time(k2lab.load(folder, dtype=torch.bfloat16))(ids),
                                   rtol=1.6e-2, atol=1e-2)  # compute in bfloat16: equal to its rounding


def test_lru_order_and_budget():
    reads = []

    def fetch(layer, expert):
        reads.append((layer, expert))
        return (torch.zeros(25),), 100  # 100 bytes each, as cached and as read

    cache = ExpertCache(250, fetch)
    for key in [(1, 0), (1, 1), (1, 0), (2, 0), (1, 1), (1, 0)]:
        cache.get(*key)
    # (1, 1) was least recently used when (2, 0) arrived; it is read again, evicting (1, 0), read again too.
    assert reads == [(1, 0), (1, 1), (2, 0), (1, 1), (1, 0)]
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 5, 3)
    assert cache.stats.peak_bytes == 200 and cache.stats.bytes_read == 500
    with pytest.raises(ValueError, match="expert_budget_bytes"):
        ExpertCache(-1, fetch)
