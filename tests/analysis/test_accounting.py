"""Parameter, byte and KV-cache accounting against the figures published with the release (typed in from the
seeds, not computed by k2lab), and against a model actually built from a small config."""

from __future__ import annotations

import pytest
import torch

import k2lab
from k2lab import K2Config
from k2lab.analysis.accounting import attention_parameters, block_parameters

K2 = K2Config.kimi_k2()
GIB = 2**30


def test_total_parameters_match_the_release():
    count = k2lab.count_parameters(K2)
    assert count.total == 1_026_408_232_448
    assert count.components["embedding"] == 1_174_405_120
    assert count.components["head"] == 1_174_405_120


def test_block_figures_match_the_release():
    assert block_parameters(K2, 0) == 497_500_160
    assert attention_parameters(K2) == 101_124_096
    blocks = sum(block_parameters(K2, i) for i in range(61))
    assert blocks == 1_024_059_415_040


def test_active_parameters():
    count = k2lab.count_parameters(K2)
    assert round(count.active / 1e9, 1) == 32.9
    assert round(count.active_without_embeddings / 1e9, 1) == 30.5


def test_kv_cache_bytes():
    assert k2lab.kv_cache_bytes(K2, 1) == 70_272
    assert k2lab.kv_cache_bytes(K2, 131_072) == 9_210_691_584
    assert round(k2lab.kv_cache_bytes(K2, 1, layout="expanded") / 2**20, 1) == 2.4
    with pytest.raises(ValueError, match="layout"):
        k2lab.kv_cache_bytes(K2, 1, layout="paged")


def test_fp8_weight_bytes():
    assert round(k2lab.weight_bytes(K2, format="fp8") / GIB, 1) == 958.3
    tied = k2lab.weight_bytes(K2, format="fp8") - 2 * 1_174_405_120
    assert round(tied / GIB, 1) == 956.1


def test_counts_equal_a_built_model():
    cfg = K2Config.mini().replace(n_group=2, topk_group=1, q_lora_rank=None, first_k_dense_replace=2)
    model = k2lab.K2Model(cfg, device="meta")
    built = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    assert k2lab.count_parameters(cfg).total == built


def test_cache_nbytes_is_the_latent_layout():
    cfg = K2Config.mini()
    model = k2lab.K2Model(cfg).to(torch.bfloat16)
    cache = model.new_cache(batch_size=2)
    with torch.no_grad():
        model(torch.zeros(2, 5, dtype=torch.long), cache=cache)
    assert cache.nbytes == k2lab.kv_cache_bytes(cfg, 5, batch_size=2)
