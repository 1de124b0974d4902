"""k2lab.load on a synthetic checkpoint in the release layout (FP8 blocks with partial edges, four shards, a
stale inv_freq) against HF transformers holding the dequantized tensors; and every loader error."""

from __future__ import annotations

import json

import pytest
import torch
from hf_oracle import relative_error
from release_layout import (
    STALE,
    TINY_FP8,
    copy_release,
    dequantized_tensors,
    hf_reference,
    release,
    single_thread,  # noqa: F401 - an autouse fixture: one thread for this module
    token_ids,
)
from safetensors.torch import load_file, save_file

import k2lab
from k2lab.weights.quant import UNQUANTIZED
from k2lab.weights.reader import INDEX_FILE, Checkpoint, CheckpointError, read_config
from k2lab.weights.writer import write_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return release(tmp_path_factory)


@pytest.fixture(scope="module")
def tensors(folder):
    return dequantized_tensors(folder)


@pytest.mark.parametrize("attn_impl", ["naive", "absorbed"])
def test_fp8_release_matches_hf_on_dequantized_tensors(folder, tensors, attn_impl):
    ref = hf_reference(TINY_FP8, tensors)
    model = k2lab.load(folder, dtype=torch.float32)
    ids = token_ids(TINY_FP8)
    with torch.no_grad():
        assert relative_error(model(ids, attn_impl=attn_impl), ref(ids).logits) < 1e-4


def test_num_layers_keeps_a_prefix_with_norm_and_head(folder, tensors):
    ref = hf_reference(TINY_FP8, tensors, num_layers=2)
    model = k2lab.load(folder, dtype=torch.float32, num_layers=2)
    assert len(model.layers) == 2 and model.config.num_hidden_layers == 2
    ids = token_ids(TINY_FP8, seed=1)
    with torch.no_grad():
        assert relative_error(model(ids), ref(ids).logits) < 1e-4


def test_fp8_checkpoint_defaults_to_bfloat16_with_float32_router_bias(folder):
    model = k2lab.load(folder)
    assert model.dtype == torch.bfloat16
    assert model.layers[1].self_attn.kv_a_proj_with_mqa.weight.dtype == torch.bfloat16
    assert model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_unquantized_release_loads_as_stored(tmp_path, tensors):
    write_checkpoint(tmp_path, TINY_FP8, lambda spec: tensors[spec.name], num_shards=2, format="unquantized")
    model = k2lab.load(tmp_path)
    assert model.dtype == torch.bfloat16 and read_config(tmp_path)[1] == UNQUANTIZED
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"].bfloat16())


@pytest.mark.parametrize("num_layers", [0, 5, 2.0])
def test_num_layers_out_of_range(folder, num_layers):
    with pytest.raises(ValueError, match="num_layers"):
        k2lab.load(folder, num_layers=num_layers)


# ---- errors: each names the file or the tensor, and nothing is read before the checks pass -----------------

def _shard_of(folder, name):
    return json.loads((folder / INDEX_FILE).read_text())["weight_map"][name]


def _rewrite_shard(folder, name, change):
    """Apply ``change(tensors)`` to the shard holding ``name`` and write it back, index untouched."""
    path = folder / _shard_of(folder, name)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return path.name


def _drop_from_index(folder, name):
    index = json.loads((folder / INDEX_FILE).read_text())
    del index["weight_map"][name]
    (folder / INDEX_FILE).write_text(json.dumps(index))


@pytest.fixture
def damaged(folder, tmp_path):
    return copy_release(folder, tmp_path / "damaged")


KV_A = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"


def test_missing_shard(damaged):
    (damaged / "model-3-of-4.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-3-of-4\.safetensors.*missing"):
        k2lab.load(damaged)


def test_tensor_absent_from_index(damaged):
    _drop_from_index(damaged, KV_A)
    with pytest.raises(CheckpointError, match=rf"{KV_A} is not in .*{INDEX_FILE}"):
        k2lab.load(damaged)


def test_index_names_a_tensor_its_shard_lacks(damaged):
    shard = _rewrite_shard(damaged, KV_A, lambda t: (t.pop(KV_A), t.pop(KV_A + "_scale_inv")))
    with pytest.raises(CheckpointError, match=rf"{shard} has no tensor {KV_A}"):
        k2lab.load(damaged)


def test_shape_disagreeing_with_config_names_both_shapes(damaged):
    name = "model.layers.2.mlp.shared_experts.down_proj.weight"
    shard = _rewrite_shard(damaged, name, lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor {name} has shape \(200, 79\).*implies \(200, 80\)"):
        k2lab.load(damaged)


def test_truncated_file(damaged):
    path = damaged / "model-4-of-4.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model-4-of-4\.safetensors is not a valid safetensors file"):
        k2lab.load(damaged)


def test_corrupt_header(damaged):
    path = damaged / "model-2-of-4.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"#garbage"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model-2-of-4\.safetensors is not a valid safetensors file"):
        k2lab.load(damaged)


def test_unsupported_dtype(damaged):
    name = "model.norm.weight"
    shard = _rewrite_shard(damaged, name, lambda t: t.update({name: t[name].to(torch.float8_e5m2)}))
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor {name} is stored as F8_E5M2"):
        k2lab.load(damaged)


def test_fp8_tensor_without_scale(damaged):
    _rewrite_shard(damaged, KV_A, lambda t: t.pop(KV_A + "_scale_inv"))
    _drop_from_index(damaged, KV_A + "_scale_inv")
    with pytest.raises(CheckpointError, match=rf"FP8 tensor {KV_A} has no {KV_A}_scale_inv"):
        k2lab.load(damaged)


def test_scale_grid_of_the_wrong_shape(damaged):
    scale = KV_A + "_scale_inv"
    _rewrite_shard(damaged, scale, lambda t: t.update({scale: t[scale][:1].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"{scale} is F32 \(1, 5\).*needs F32 \(2, 5\)"):
        k2lab.load(damaged)


def test_fp8_where_the_release_keeps_bfloat16(damaged):
    name = "lm_head.weight"
    _rewrite_shard(damaged, name, lambda t: t.update({name: t[name].to(torch.float8_e4m3fn)}))
    with pytest.raises(CheckpointError, match=rf"tensor {name} is stored as F8_E4M3, but K2 keeps it in bfloat16"):
        k2lab.load(damaged)


def test_unknown_quantization_config(damaged):
    config = json.loads((damaged / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (damaged / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config.*not implemented"):
        k2lab.load(damaged)


def test_unexpected_tensor(damaged):
    name = "model.layers.9.mlp.gate.weight"
    _rewrite_shard(damaged, STALE, lambda t: t.update({name: torch.zeros(2)}))
    index = json.loads((damaged / INDEX_FILE).read_text())
    index["weight_map"][name] = _shard_of(damaged, STALE)
    (damaged / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"not in the model config.json describes: \['{name}'\]"):
        k2lab.load(damaged)


def test_not_a_folder_nor_a_repo_id(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a checkpoint folder nor a Hub repo id"):
        k2lab.load(tmp_path / "nowhere" / "at" / "all")


def test_failed_load_reads_no_tensor_data(damaged, monkeypatch):
    """The last shard is broken: the checks fail on its header before any tensor of the first is read."""
    path = damaged / "model-4-of-4.safetensors"
    path.write_bytes(path.read_bytes()[:-1])
    reads = []
    monkeypatch.setattr(Checkpoint, "read", lambda self, info, device="cpu": reads.append(info.name))
    with pytest.raises(CheckpointError, match="model-4-of-4"):
        k2lab.load(damaged)
    assert reads == []


def test_pickled_checkpoints_are_refused_not_unpickled(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_FP8.to_hf()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    with pytest.raises(FileNotFoundError, match="never unpickles"):
        k2lab.load(tmp_path)
