"""Hostile inputs to the checkpoint writer and loader: a failed write leaves the old checkpoint loadable, an
unsaveable model is refused before anything is written, and bad load arguments or files are named."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import MICRO, micro_model

import k2lab
from k2lab import K2Model
from k2lab.weights.reader import INDEX_FILE, CheckpointError
from k2lab.weights.writer import save_checkpoint, write_checkpoint


def stored(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, read by safetensors itself (not by k2lab)."""
    index = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        out.update(load_file(folder / shard))
    return out


@pytest.fixture
def saved(tmp_path):
    """A float32 checkpoint of one model, beside a tokenizer file the writer must keep."""
    folder = tmp_path / "ckpt"
    save_checkpoint(micro_model(0), folder, format="unquantized")
    (folder / "tiktoken.model").write_text("kept")
    return folder


def source_of(model: K2Model, fail_at: int | None = None, wrong_shape_at: int | None = None):
    state, calls = model.state_dict(), []

    def source(spec):
        calls.append(spec.name)
        if len(calls) == fail_at:
            raise RuntimeError("the source failed midway")
        name = spec.name.removeprefix("model.")
        if ".experts." in name:
            _, layer, _, _, index, proj, _ = name.split(".")
            tensor = state[f"layers.{layer}.mlp.experts.{proj}"][int(index)]
        else:
            tensor = state[name]
        return tensor[:1] if len(calls) == wrong_shape_at else tensor
    return source


@pytest.mark.parametrize("failure, error, named", [
    ({"fail_at": 7}, RuntimeError, "the source failed midway"),
    ({"wrong_shape_at": 7}, ValueError, "source gave model.* as .*; the layout needs"),
])
def test_a_write_failing_midway_leaves_the_old_checkpoint_loadable(saved, failure, error, named):
    before = stored(saved)
    old = k2lab.load(saved, dtype=torch.float32)
    with pytest.raises(error, match=named):
        write_checkpoint(saved, MICRO, source_of(micro_model(1), **failure), format="unquantized")
    after = stored(saved)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    again = k2lab.load(saved, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids), old(ids), rtol=0, atol=0)
    assert (saved / "tiktoken.model").read_text() == "kept"
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ckpt"]  # no staging folder left behind


def test_a_complete_write_replaces_the_checkpoint_and_keeps_other_files(saved):
    new = micro_model(1)
    save_checkpoint(new, saved, format="unquantized")
    loaded = k2lab.load(saved, dtype=torch.float32)
    assert torch.equal(loaded.embed_tokens.weight, new.embed_tokens.weight.bfloat16().float())
    assert (saved / "tiktoken.model").read_text() == "kept"
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ckpt"]


@pytest.fixture
def mount_point(saved, monkeypatch):
    """The checkpoint folder as a mount point: it cannot be swapped, so the writer stages inside it."""
    monkeypatch.setattr(os.path, "ismount", lambda path: os.fspath(path) == os.fspath(saved))
    return saved


def test_a_mount_point_keeps_its_checkpoint_on_failure_and_takes_a_new_one(mount_point):
    before = stored(mount_point)
    with pytest.raises(RuntimeError, match="the source failed midway"):
        write_checkpoint(mount_point, MICRO, source_of(micro_model(1), fail_at=7), format="unquantized")
    after = stored(mount_point)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert sorted(p.name for p in mount_point.iterdir()) == sorted(
        ["config.json", INDEX_FILE, "model-1-of-1.safetensors", "tiktoken.model"])
    write_checkpoint(mount_point, MICRO, source_of(micro_model(1)), format="unquantized", num_shards=2)
    assert sorted(p.name for p in mount_point.iterdir()) == sorted(
        ["config.json", INDEX_FILE, "model-1-of-2.safetensors", "model-2-of-2.safetensors", "tiktoken.model"])
    new = micro_model(1)
    loaded = k2lab.load(mount_point, dtype=torch.float32)
    assert torch.equal(loaded.embed_tokens.weight, new.embed_tokens.weight.bfloat16().float())


def test_fewer_shards_leave_no_stale_shard(tmp_path):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, MICRO, source_of(micro_model(0)), format="unquantized", num_shards=3)
    write_checkpoint(folder, MICRO, source_of(micro_model(0)), format="unquantized", num_shards=1)
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model-1-of-1.safetensors"]


def test_save_checkpoint_spreads_whole_blocks_over_num_shards(tmp_path):
    model = micro_model(0)
    folder = save_checkpoint(model, tmp_path / "ckpt", num_shards=2, format="unquantized")
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model-1-of-2.safetensors",
                                                                     "model-2-of-2.safetensors"]
    loaded = k2lab.load(folder, dtype=torch.float32)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.bfloat16().float())  # the stored bytes, widened


def streamed_or_quantized_resident(saved, kind):
    save_checkpoint(micro_model(0), saved, format="fp8")
    if kind == "streamed":
        return k2lab.load(saved, dtype=torch.float32, expert_budget_bytes=10**6)
    return k2lab.load(saved, dtype=torch.float32, quantized_resident=True)


@pytest.mark.parametrize("kind, named", [("streamed", "model cannot be saved: its routed experts are streamed"),
                                         ("quantized_resident", "model cannot be saved: it holds quantized-resident")])
def test_an_unsaveable_model_is_refused_before_anything_is_written(saved, kind, named):
    model = streamed_or_quantized_resident(saved, kind)
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    with pytest.raises(ValueError, match=named):
        save_checkpoint(model, saved)
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before


def test_a_meta_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model cannot be saved: .* is on the meta device"):
        save_checkpoint(K2Model(MICRO, device="meta"), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("kwargs, error, named", [
    ({"num_shards": 0}, ValueError, r"num_shards must be an integer in 1\.\.4"),
    ({"num_shards": 2.5}, ValueError, "num_shards must be an integer"),
    ({"dtype": torch.int64}, ValueError, "dtype must be one of the safetensors dtypes"),
    ({"extra": {"x": [1, 2]}}, TypeError, r"extra\['x'\] must be a tensor"),
    ({"format": "fp9"}, ValueError, "format must be a QuantFormat or one of"),
])
def test_bad_writer_arguments_are_named_before_anything_is_written(tmp_path, kwargs, error, named):
    with pytest.raises(error, match=named):
        write_checkpoint(tmp_path / "ckpt", MICRO, source_of(micro_model(0)), **{"format": "unquantized", **kwargs})
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_a_file_as_folder_and_a_bad_source(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="folder .*file exists and is not a folder"):
        write_checkpoint(tmp_path / "file", MICRO, source_of(micro_model(0)), format="unquantized")
    with pytest.raises(OSError, match="folder .*file/ckpt: cannot make its parent folder"):
        write_checkpoint(tmp_path / "file" / "ckpt", MICRO, source_of(micro_model(0)), format="unquantized")
    with pytest.raises(TypeError, match="source must be a function"):
        write_checkpoint(tmp_path / "ckpt", MICRO, {"not": "callable"}, format="unquantized")
    with pytest.raises(TypeError, match="model must be a K2Model"):
        save_checkpoint({"a": torch.zeros(1)}, tmp_path / "ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_writer_names_a_read_only_parent(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="cannot write there or beside it"):
            write_checkpoint(tmp_path / "ckpt", MICRO, source_of(micro_model(0)), format="unquantized")
    finally:
        tmp_path.chmod(0o700)


# -- load ---------------------------------------------------------------------------------------------------


def test_load_of_a_missing_folder_offline_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="no_such_dir/ckpt: no such folder, and not in the Hub cache"):
        k2lab.load("no_such_dir/ckpt")


@pytest.mark.parametrize("name, want", [("bfloat16", torch.bfloat16), ("torch.float32", torch.float32)])
def test_load_takes_a_dtype_by_name(saved, name, want):
    assert k2lab.load(saved, dtype=name).embed_tokens.weight.dtype == want


@pytest.mark.parametrize("kwargs, named", [
    ({"dtype": "bf17"}, "dtype must be a floating torch dtype or its name.*'bf17'"),
    ({"dtype": torch.int8}, "dtype must be a floating torch dtype.*torch.int8"),
    ({"dtype": "cuda"}, "dtype must be a floating torch dtype"),
    ({"expert_budget_bytes": "1GB"}, r"expert_budget_bytes must be a whole number of bytes >= 0 .*'1GB'"),
    ({"expert_budget_bytes": -1}, "expert_budget_bytes must be a whole number of bytes >= 0"),
    ({"expert_budget_bytes": 1.5e9}, "expert_budget_bytes must be a whole number"),
])
def test_load_names_a_bad_argument(saved, kwargs, named):
    with pytest.raises(ValueError, match=named):
        k2lab.load(saved, **kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_block_scale_is_named(tmp_path, bad):
    folder = tmp_path / "ckpt"
    save_checkpoint(micro_model(0), folder, format="fp8")
    shard = folder / "model-1-of-1.safetensors"
    tensors = load_file(shard)
    name = "model.layers.1.self_attn.q_a_proj.weight_scale_inv"
    tensors[name][0, 0] = bad
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{name} holds non-finite block scales"):
        k2lab.load(folder, dtype=torch.float32)


def test_streamed_experts_refuse_a_file_changed_after_loading(tmp_path):
    folder = tmp_path / "ckpt"
    save_checkpoint(micro_model(0), folder, format="unquantized")
    model = k2lab.load(folder, dtype=torch.float32, expert_budget_bytes=0)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(ids)
        save_checkpoint(micro_model(1), folder, format="unquantized")  # same names and sizes, other weights
        with pytest.raises(CheckpointError, match="changed on disk since the model was loaded"):
            model(ids)


def test_load_names_a_source_that_is_not_a_path():
    with pytest.raises(TypeError, match="path_or_repo_id must be a checkpoint folder or a Hub repo id, got None"):
        k2lab.load(None)


@pytest.mark.parametrize("device", ["tpu", 2.5])
def test_load_names_a_device_that_is_not_one(tmp_path, device):
    folder = save_checkpoint(micro_model(0), tmp_path / "ckpt", format="unquantized")
    with pytest.raises(ValueError, match=r"device_map\[''\]=.* is not a device"):
        k2lab.load(folder, device_map={"": device})
