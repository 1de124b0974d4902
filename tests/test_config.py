"""K2Config: the release as read from its config.json, HF 5 style, other DeepseekV3 configs, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k2lab import K2Config, K2Model
from k2lab.model.rope import cos_sin_scale, inverse_frequencies, yarn_correction_range, yarn_ramp
from k2lab.weights.quant import UNQUANTIZED
from k2lab.weights.quant.fp8 import FP8Format
from k2lab.weights.reader import read_config

RELEASED = Path(__file__).parent / "data" / "kimi_k2_instruct_config.json"


def released() -> dict:
    return json.loads(RELEASED.read_text())


def test_released_config_reads_as_kimi_k2():
    assert K2Config.from_hf(RELEASED) == K2Config.kimi_k2()
    assert K2Config.from_hf(RELEASED.parent / "kimi_k2_instruct_config.json") == K2Config.from_hf(released())


def test_kimi_k2_preset_is_the_release():
    cfg = K2Config.kimi_k2()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.first_k_dense_replace) == (7168, 61, 1)
    assert (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (64, 1536, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (128, 64, 128)
    assert (cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok) == (384, 1, 8)
    assert (cfg.moe_intermediate_size, cfg.intermediate_size, cfg.vocab_size) == (2048, 18432, 163840)
    assert cfg.routed_scaling_factor == 2.827 and read_config(RELEASED)[1] == FP8Format(block=(128, 128))
    assert (cfg.bos_token_id, cfg.eos_token_id) == (163584, 163585)


def test_softmax_scale_and_yarn_figures():
    cfg = K2Config.kimi_k2()
    assert cfg.yarn_mscale == pytest.approx(1.3465736, abs=1e-7)
    assert cfg.softmax_scale == pytest.approx(0.13086080, abs=1e-8)
    assert K2Config.kimi_k2().replace(rope_type=None).softmax_scale == pytest.approx(0.0721688, abs=1e-7)
    assert yarn_correction_range(cfg) == (19, 20)
    ramp = yarn_ramp(cfg)
    assert ramp[:20].eq(0).all() and ramp[20:].eq(1).all()
    base = 1.0 / 50000.0 ** (2 * __import__("torch").arange(32) / 64)
    inv = inverse_frequencies(cfg)
    assert (inv[:20] / base[:20]).sub(1).abs().max() < 1e-6
    assert (inv[20:] * 32 / base[20:]).sub(1).abs().max() < 1e-6
    assert cos_sin_scale(cfg) == 1.0


def test_hf5_rope_parameters_style_is_equivalent():
    raw = released()
    scaling = raw.pop("rope_scaling")
    theta = raw.pop("rope_theta")
    raw["model_type"] = "deepseek_v3"
    raw["rope_parameters"] = {"rope_type": scaling.pop("type"), "rope_theta": theta, **scaling}
    assert K2Config.from_hf(raw) == K2Config.kimi_k2()


def test_hf_save_pretrained_config_round_trips():
    cfg = K2Config.mini().replace(n_group=4, topk_group=2, q_lora_rank=None, first_k_dense_replace=2)
    transformers = pytest.importorskip("transformers")
    saved = transformers.DeepseekV3Config(**cfg.to_hf()).to_dict()
    assert K2Config.from_hf(saved) == cfg


def test_deepseek_v3_style_config():
    raw = released() | {"model_type": "deepseek_v3", "q_lora_rank": None, "n_group": 8, "topk_group": 4,
                        "n_routed_experts": 256, "first_k_dense_replace": 3, "quantization_config": None}
    cfg, fmt = read_config(raw)
    assert cfg.q_lora_rank is None and (cfg.n_group, cfg.topk_group) == (8, 4)
    assert cfg.first_k_dense_replace == 3 and fmt == UNQUANTIZED


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
        ({"model_type": "deepseek_v32", "index_topk": 2048}, "indexer"),
        ({"linear_attn_config": {"kda_layers": [1]}}, "Delta Attention"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
        ({"model_type": "llama"}, "model_type"),
        ({"sliding_attention_window_size": 4096}, "sliding_attention_window_size"),
        ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, "longrope"),
        ({"n_group": 5}, "n_group"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"hidden_size": "7168"}, "hidden_size"),
    ],
)
def test_unsupported_or_malformed_config_is_refused_by_name(change, named):
    with pytest.raises(ValueError, match=named):
        K2Config.from_hf(released() | change)


def test_the_stored_format_is_the_weights_business_not_the_architectures():
    awq = released() | {"quantization_config": {"quant_method": "awq"}}
    assert K2Config.from_hf(awq) == K2Config.kimi_k2()  # the architecture reads; how weights are stored is apart
    with pytest.raises(ValueError, match="quantization_config"):
        read_config(awq)  # the checkpoint's reader refuses a format k2lab does not implement


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        K2Config.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        K2Config.from_hf(tmp_path)


def test_replace_validates_and_keeps_switches():
    cfg = K2Config.kimi_k2().replace(num_hidden_layers=4)
    assert cfg.num_hidden_layers == 4 and cfg.rope_factor == 32.0 and cfg.q_lora_rank == 1536
    with pytest.raises(ValueError, match="no field"):
        K2Config.kimi_k2().replace(num_layers=4)
    with pytest.raises(ValueError, match="topk_group"):
        K2Config.kimi_k2().replace(topk_group=2)


def test_mini_keeps_every_k2_switch():
    cfg = K2Config.mini()
    assert cfg.q_lora_rank and cfg.rope_type == "yarn" and cfg.rope_factor == 32.0 and cfg.rope_interleave
    assert cfg.first_k_dense_replace == 1 and cfg.n_shared_experts == 1 and cfg.num_experts_per_tok >= 2
    assert cfg.norm_topk_prob and cfg.routed_scaling_factor == 2.827


@pytest.mark.parametrize("width", [64, 128, 192, 256])
def test_nano_scales_every_matrix_with_its_width_and_keeps_k2s_switches(width):
    cfg = K2Config.nano(width)
    assert cfg.hidden_size == width and cfg.intermediate_size == 3 * width
    assert 8 * cfg.q_lora_rank == 3 * width and 4 * cfg.kv_lora_rank == width and 2 * cfg.moe_intermediate_size == width
    assert cfg.q_lora_rank and cfg.first_k_dense_replace == 1 and cfg.n_shared_experts == 1
    assert cfg.vocab_size == 8192 and (cfg.bos_token_id, cfg.eos_token_id) == (7936, 7937)
    K2Model(cfg)  # builds


def test_nano_names_a_width_it_cannot_split():
    with pytest.raises(ValueError, match="multiple of 8, got 100"):
        K2Config.nano(100)
