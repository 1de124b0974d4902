"""Loading by Hub repo id: only the shards a slice needs, through the standard cache, offline from it."""

from __future__ import annotations

import fnmatch
import json
import shutil

import pytest
import torch
from huggingface_hub import constants
from release_layout import (
    TINY_FP8,
    release,
    single_thread,  # noqa: F401 - an autouse fixture: one thread for this module
    token_ids,
)

import k2lab
from k2lab import hub
from k2lab.weights import download
from k2lab.weights.load import slice_layers
from k2lab.weights.reader import INDEX_FILE, CheckpointError

REPO, REVISION = "moonshotai/Tiny-K2", "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return release(tmp_path_factory)


def _weight_map(folder):
    return json.loads((folder / INDEX_FILE).read_text())["weight_map"]


def test_allow_patterns_of_a_two_block_slice_name_only_its_shards(folder):
    # Shards: 1 = embedding + block 0, 2 = block 1, 3 = blocks 2-3, 4 = final norm + head.
    patterns = download.allow_patterns(slice_layers(TINY_FP8, 2), _weight_map(folder))
    shards = [p for p in patterns if p.endswith(".safetensors")]
    assert shards == ["model-1-of-4.safetensors", "model-2-of-4.safetensors", "model-4-of-4.safetensors"]
    assert {"config.json", INDEX_FILE, "tiktoken.model", "tokenizer_config.json"} <= set(patterns)
    assert not any(p.endswith(".py") for p in patterns)  # no remote code
    assert "model-3-of-4.safetensors" in download.allow_patterns(TINY_FP8, _weight_map(folder))


def test_allow_patterns_names_a_tensor_missing_from_the_index(folder):
    weight_map = _weight_map(folder)
    del weight_map["model.layers.1.mlp.gate.weight"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.gate\.weight is not in"):
        download.allow_patterns(TINY_FP8, weight_map)


def test_repo_ids_and_paths():
    assert hub.is_repo_id("moonshotai/Kimi-K2-Instruct")
    assert not any(hub.is_repo_id(p) for p in ("./ckpt", "/data/k2", "a/b/c", "k2", "../x/y"))


@pytest.fixture
def hub_cache(folder, tmp_path, monkeypatch):
    """A hub cache holding REPO at REVISION (refs/main points to it), without the shard a 2-block slice does not
    need, used offline."""
    cache = tmp_path / "hub"
    snapshot = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    shutil.copytree(folder, snapshot, ignore=shutil.ignore_patterns("model-3-of-4.safetensors"))
    (snapshot / "tiktoken.model").write_text("")
    (cache / f"models--{REPO.replace('/', '--')}" / "refs").mkdir()
    (cache / f"models--{REPO.replace('/', '--')}" / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return snapshot


def test_offline_load_by_repo_id_from_the_cache(folder, hub_cache):
    model = k2lab.load(REPO, num_layers=2, dtype=torch.float32)
    local = k2lab.load(folder, num_layers=2, dtype=torch.float32)
    ids = token_ids(TINY_FP8)
    with torch.no_grad():
        assert torch.equal(model(ids), local(ids))
    with pytest.raises(FileNotFoundError, match="model-3-of-4"):  # the whole model needs the shard left out
        k2lab.load(REPO, revision=REVISION)


def test_offline_load_of_an_uncached_repo_fails_clearly(hub_cache):
    with pytest.raises(FileNotFoundError):
        k2lab.load("someone/not-cached")


def test_online_load_asks_for_exactly_the_needed_files(folder, tmp_path, monkeypatch):
    """The Hub replaced by the release folder: the index and config come by hf_hub_download, then one snapshot
    with the computed allow_patterns (and a silenced progress bar when asked)."""
    calls = {}

    def fake_file(repo_id, filename, revision=None):
        assert repo_id == REPO and revision == "main"
        return str(folder / filename)

    def fake_snapshot(repo_id, revision=None, allow_patterns=None, tqdm_class=None):
        calls.update(patterns=allow_patterns, tqdm_class=tqdm_class)
        snapshot = tmp_path / "snapshot"
        for file in folder.iterdir():
            if any(fnmatch.fnmatch(file.name, p) for p in allow_patterns):
                snapshot.mkdir(exist_ok=True)
                shutil.copy(file, snapshot)
        return str(snapshot)

    monkeypatch.setattr(hub, "hf_hub_download", fake_file)
    monkeypatch.setattr(download, "snapshot_download", fake_snapshot)
    model = k2lab.load(REPO, revision="main", num_layers=1, progress=False)
    assert len(model.layers) == 1
    assert [p for p in calls["patterns"] if p.endswith(".safetensors")] == ["model-1-of-4.safetensors",
                                                                            "model-4-of-4.safetensors"]
    assert calls["tqdm_class"] is not None and calls["tqdm_class"](total=1).disable
