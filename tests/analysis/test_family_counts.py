"""The family's presets and configs against the published figures: parameter counts (count_parameters), the MTP
block of DeepSeek-V3 apart, and the softmax scale of the 256K-context releases."""

from __future__ import annotations

import math

import pytest
from family_configs import (
    DEEPSEEK_R1,
    DEEPSEEK_V2_LITE,
    DEEPSEEK_V3,
    DEEPSEEK_V3_1,
    K2_INSTRUCT_0905,
    K2_THINKING,
    MOONLIGHT,
)

from k2lab import K2Config, count_parameters
from k2lab.weights.schema import checkpoint_tensors, mtp_tensors


def test_presets_are_the_released_configs():
    assert K2Config.from_hf(K2_INSTRUCT_0905) == K2Config.kimi_k2_0905()
    assert K2Config.from_hf(K2_THINKING) == K2Config.kimi_k2_thinking()
    assert K2Config.from_hf(MOONLIGHT) == K2Config.moonlight()


def test_k2_0905_and_thinking_stretch_yarn_to_256k():
    for cfg in (K2Config.kimi_k2_0905(), K2Config.kimi_k2_thinking()):
        assert (cfg.rope_factor, cfg.max_position_embeddings) == (64, 262_144)
        assert cfg.original_max_position_embeddings == 4096
        assert cfg.softmax_scale == pytest.approx(0.14468, abs=5e-6)  # 192^-0.5 * (0.1 ln 64 + 1)^2
        # Same architecture as K2-Instruct: 1T parameters, 32B active.
        assert count_parameters(cfg).total == count_parameters(K2Config.kimi_k2()).total == 1_026_408_232_448
        assert int(count_parameters(cfg).active / 1e9) == 32


def test_moonlight_counts_as_published():
    count = count_parameters(K2Config.moonlight())
    assert count.total == 15_960_110_208
    without = count.total - count.components["embedding"] - count.components["head"]
    assert round(without / 1e9, 2) == 15.29
    assert round(count.active_without_embeddings / 1e9, 2) == 2.24
    assert count.mtp.total == 0


@pytest.mark.parametrize("config", [DEEPSEEK_V3, DEEPSEEK_R1, DEEPSEEK_V3_1], ids=["V3", "R1", "V3.1"])
def test_deepseek_v3_main_model_and_mtp_apart(config):
    cfg = K2Config.from_hf(config)
    assert (cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.first_k_dense_replace) == (256, 8, 4, 3)
    assert cfg.routed_scaling_factor == 2.5 and cfg.num_nextn_predict_layers == 1
    count = count_parameters(cfg)
    assert count.total == 671_026_419_200  # "671B" main model (README_WEIGHTS)
    # The hub's "685B" counts every stored value: main, MTP, and the float32 scale of each 128x128 FP8 block.
    stored = checkpoint_tensors(cfg) + mtp_tensors(cfg)
    scales = sum(math.ceil(s.shape[0] / 128) * math.ceil(s.shape[1] / 128) for s in stored if s.quantizable)
    assert sum(s.numel for s in stored) == count.total + count.mtp.total
    assert round((count.total + count.mtp.total) / 1e9, 1) == 684.5
    assert round((count.total + count.mtp.total + scales) / 1e9) == 685
    # README_WEIGHTS: the MTP module has 11.5B unique parameters besides its copies of the 0.9B embedding and head
    # (k2lab counts 11.61B: the block 11.51B + eh_proj 0.10B + three norms).
    assert count.mtp.total - count.mtp.unique == 2 * 129_280 * 7168
    assert abs(count.mtp.unique / 1e9 - 11.5) < 0.15
    assert round(count.mtp.total / 1e9, 1) == 13.5  # "14B" = 685B - 671B


def test_deepseek_v2_lite_counts():
    cfg = K2Config.from_hf(DEEPSEEK_V2_LITE)
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob, cfg.has_correction_bias) == (
        "softmax", "greedy", False, False)
    count = count_parameters(cfg)
    assert round(count.total / 1e9, 1) == 15.7  # "15.7B total"
    assert count.components["router"] == 26 * 64 * 2048  # a gate matrix per MoE block and no correction bias
    # "2.4B activated": the active parameters with one of the two vocabulary matrices (2.45B); 2.24B without both.
    assert round(count.active_without_embeddings / 1e9, 2) == 2.24
    assert int((count.active - count.components["head"]) / 1e8) == 24
