"""Each family member from a tiny checkpoint in its release layout, written here offline, loaded by k2lab.load, with
logits against HF transformers' DeepseekV3 holding the same (dequantized) tensors. DeepSeek-V2-Lite's softmax
router has its own oracle test (tests/model/test_softmax_router.py); K2-Thinking's INT4 experts are read through
the quantization seam and tested there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_configs import DEEPSEEK_V3_2, KIMI_LINEAR
from hf_oracle import relative_error
from release_layout import (
    TINY_FP8,
    dequantized_tensors,
    hf_reference,
    single_thread,  # noqa: F401 - autouse: one thread for this module
    token_ids,
    write_release,
)
from safetensors.torch import save_file

import k2lab
from k2lab.weights.reader import INDEX_FILE

# K2-Instruct-0905 / K2-Thinking's architecture at toy size: YaRN x64, 262,144 positions, FP8 release.
K2_256K_TINY = TINY_FP8.replace(rope_factor=64.0, max_position_embeddings=262_144)
# Moonlight's: no query latent, two shared experts, plain RoPE (theta 50,000), bfloat16 release.
MOONLIGHT_TINY = TINY_FP8.replace(q_lora_rank=None, n_shared_experts=2, rope_type=None, rope_factor=1.0,
                                  max_position_embeddings=8192, routed_scaling_factor=2.446, rms_norm_eps=1e-5)
# DeepSeek-V3's: grouped routing (4 groups of which 2 are kept), two dense blocks, routed scale 2.5, YaRN x40 with
# beta_fast 32, one MTP block after the main ones.
DEEPSEEK_V3_TINY = TINY_FP8.replace(num_hidden_layers=4, first_k_dense_replace=2, n_group=4, topk_group=2,
                                    routed_scaling_factor=2.5, rope_factor=40.0, beta_fast=32.0, rope_theta=10_000.0,
                                    num_nextn_predict_layers=1)


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes, indent=2))


def _as_kimi_release(folder: Path) -> None:
    """config.json as Kimi writes it: model_type kimi_k2, ``rope_scaling`` with ``type`` and a separate rope_theta."""
    raw = json.loads((folder / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    raw.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    (folder / "config.json").write_text(json.dumps(raw, indent=2))


def _logits_agree(folder: Path, cfg) -> None:
    ref = hf_reference(cfg.replace(num_nextn_predict_layers=0), dequantized_tensors(folder))
    model = k2lab.load(folder, dtype=torch.float32)
    ids = token_ids(cfg)
    with torch.no_grad():
        for attn_impl in ("naive", "absorbed"):
            assert relative_error(model(ids, attn_impl=attn_impl), ref(ids).logits) < 1e-4


def test_k2_256k_release(tmp_path):
    write_release(K2_256K_TINY, tmp_path)
    _as_kimi_release(tmp_path)
    cfg = k2lab.K2Config.from_hf(tmp_path)
    assert (cfg.rope_factor, cfg.max_position_embeddings) == (64.0, 262_144)
    _logits_agree(tmp_path, K2_256K_TINY)


def test_moonlight_release_in_bfloat16(tmp_path):
    write_release(MOONLIGHT_TINY, tmp_path)  # FP8 first, for the shared writer; then stored as bfloat16
    tensors = dequantized_tensors(tmp_path)
    for f in tmp_path.iterdir():
        f.unlink()
    from k2lab.weights.writer import write_checkpoint

    cfg = MOONLIGHT_TINY
    write_checkpoint(tmp_path, cfg, lambda spec: tensors[spec.name], num_shards=2, format="unquantized")
    model = k2lab.load(tmp_path, dtype=torch.float32)
    assert model.config.q_lora_rank is None and model.config.rope_type is None
    stored = {k: v.bfloat16().float() for k, v in tensors.items()}
    stored.update({k: v for k, v in tensors.items() if k.endswith("e_score_correction_bias")})  # kept in float32
    ref = hf_reference(cfg, stored)
    ids = token_ids(cfg)
    with torch.no_grad():
        assert relative_error(model(ids), ref(ids).logits) < 1e-4


def _add_mtp_block(folder: Path, cfg) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's MTP block written as released, in a shard of its own: a copy of the last main block's tensors
    renamed to block L = num_hidden_layers, plus eh_proj, enorm, hnorm and shared_head, and the embedding's copy."""
    index = json.loads((folder / INDEX_FILE).read_text())
    last, L, D, V = cfg.num_hidden_layers - 1, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    from safetensors import safe_open

    block = {}
    for name, file in index["weight_map"].items():
        if name.startswith(f"model.layers.{last}."):
            with safe_open(folder / file, "pt") as f:
                block[name.replace(f"layers.{last}.", f"layers.{L}.")] = f.get_tensor(name)
    gen = torch.Generator().manual_seed(7)
    block |= {
        f"model.layers.{L}.eh_proj.weight": torch.randn(D, 2 * D, generator=gen).bfloat16(),
        f"model.layers.{L}.enorm.weight": torch.ones(D).bfloat16(),
        f"model.layers.{L}.hnorm.weight": torch.ones(D).bfloat16(),
        f"model.layers.{L}.embed_tokens.weight": torch.randn(V, D, generator=gen).bfloat16(),
        f"model.layers.{L}.shared_head.norm.weight": torch.ones(D).bfloat16(),
        f"model.layers.{L}.shared_head.head.weight": torch.randn(V, D, generator=gen).bfloat16(),
    }
    save_file(block, folder / "model-mtp.safetensors", metadata={"format": "pt"})
    index["weight_map"] |= dict.fromkeys(block, "model-mtp.safetensors")
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return block


@pytest.fixture(scope="module")
def v3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v3")
    write_release(DEEPSEEK_V3_TINY, folder)
    mtp = _add_mtp_block(folder, DEEPSEEK_V3_TINY)
    return folder, mtp


def test_deepseek_v3_main_model_loads_exactly_and_the_mtp_block_is_skipped_with_a_note(v3_folder):
    folder, mtp = v3_folder
    _logits_agree(folder, DEEPSEEK_V3_TINY)
    model = k2lab.load(folder)
    L = DEEPSEEK_V3_TINY.num_hidden_layers
    assert len(model.layers) == L and not any(f"layers.{L}." in n for n in model.state_dict())
    (note,) = model.load_notes
    assert f"model.layers.{L}.*" in note and "multi-token-prediction" in note
    # count_parameters reports the MTP block apart: what was written there, less FP8 scales.
    written = sum(t.numel() for name, t in mtp.items() if not name.endswith("_scale_inv"))
    count = k2lab.count_parameters(model.config)
    assert count.mtp.total == written
    assert count.total == sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))


def test_deepseek_v3_prefix_and_v3_1_scale_format(v3_folder, tmp_path):
    folder, _ = v3_folder
    model = k2lab.load(folder, num_layers=2)
    assert model.config.num_nextn_predict_layers == 0 and len(model.layers) == 2
    # V3.1 marks its power-of-two block scales as ue8m0; the float32 scales read the same.
    import shutil

    copy = Path(shutil.copytree(folder, tmp_path / "v3_1"))
    quant = json.loads((copy / "config.json").read_text())["quantization_config"]
    _edit_config(copy, quantization_config=quant | {"scale_fmt": "ue8m0"})
    ids = token_ids(DEEPSEEK_V3_TINY)
    with torch.no_grad():
        assert torch.equal(k2lab.load(copy, dtype=torch.float32)(ids), k2lab.load(folder, dtype=torch.float32)(ids))
    _edit_config(copy, quantization_config=quant | {"scale_fmt": "e8m0fnu"})
    with pytest.raises(ValueError, match="scale_fmt"):
        k2lab.load(copy)


def test_mtp_tensors_without_the_config_key_are_refused(v3_folder, tmp_path):
    import shutil

    copy = Path(shutil.copytree(v3_folder[0], tmp_path / "no_key"))
    _edit_config(copy, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=f"model.layers.{DEEPSEEK_V3_TINY.num_hidden_layers}"):
        k2lab.load(copy)


@pytest.mark.parametrize(("config", "named"), [(DEEPSEEK_V3_2, "indexer"), (KIMI_LINEAR, "Kimi Delta Attention")],
                         ids=["V3.2", "Kimi-Linear"])
def test_relatives_k2lab_cannot_run_are_refused_by_name(tmp_path, config, named):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        k2lab.load(tmp_path)

