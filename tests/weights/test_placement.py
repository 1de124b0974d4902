"""Device maps and plan(): balancing K2's blocks over devices by bytes, and explicit maps resolved by prefix."""

from __future__ import annotations

import re

import pytest
import torch
from release_layout import (
    TINY_FP8,
    release,
    single_thread,  # noqa: F401 - an autouse fixture: one thread for this module
    token_ids,
)

import k2lab
from k2lab import K2Config
from k2lab.analysis.accounting import weight_bytes
from k2lab.model.attention import LatentCache
from k2lab.weights.placement import DEFAULT_HEADROOM_BYTES, placement_units, resolve_device_map, unit_bytes, unit_of

K2 = K2Config.kimi_k2()
H200 = 141 * 10**9


def test_k2_fp8_fits_on_eight_h200_and_not_on_one():
    eight = k2lab.plan(K2, devices=[H200] * 8)
    assert eight.fits and not k2lab.plan(K2, devices=[H200]).fits
    assert sum(eight.weight_bytes) == weight_bytes(K2, format="fp8", scales=True)
    assert all(free >= DEFAULT_HEADROOM_BYTES for free in eight.free_bytes)
    assert max(eight.weight_bytes) < 137 * 10**9  # no device holds more than 8 of the ~17 GB MoE blocks
    assert "fits" in str(eight) and "activations and the KV cache" in str(eight)


def test_plan_is_a_pipeline_embedding_first_head_last():
    placed = k2lab.plan(K2, devices=[H200] * 8)
    order = [placed.units[u] for u in placement_units(K2)]
    assert order == sorted(order) and order[0] == 0 and order[-1] == 7
    assert placed.units["norm"] == placed.units["lm_head"]
    assert set(placed.device_map.values()) == {f"cuda:{i}" for i in range(8)}


def test_bfloat16_k2_does_not_fit_on_eight_h200():
    assert not k2lab.plan(K2, devices=[H200] * 8, format="unquantized").fits


def test_streamed_experts_leave_the_budget_reserved_on_every_device():
    budget = 20 * 10**9
    placed = k2lab.plan(K2, devices=[80 * 10**9] * 2, expert_budget_bytes=budget)
    assert placed.fits and placed.expert_cache_bytes == budget
    resident = sum(unit_bytes(K2, expert_budget_bytes=budget).values())
    assert sum(placed.weight_bytes) == resident < 30 * 10**9  # everything but the routed experts
    assert all(f == c - w - budget for f, c, w in zip(placed.free_bytes, placed.capacity_bytes, placed.weight_bytes,
                                                      strict=True))


def test_plan_accepts_devices():
    placed = k2lab.plan(K2Config.mini(), devices=["cpu"])
    assert placed.devices == ("cpu",) and placed.fits and placed.capacity_bytes[0] > 10**9


def test_unit_of_names():
    assert unit_of("model.layers.12.mlp.experts.3.up_proj.weight") == "layers.12"
    assert unit_of("layers.0.self_attn.hook_z") == "layers.0"
    assert unit_of("lm_head.weight") == "lm_head" and unit_of("model.embed_tokens.weight") == "embed_tokens"


def test_explicit_map_by_longest_prefix():
    cfg = TINY_FP8
    devices = resolve_device_map(cfg, {"": "cpu", "layers": "meta", "model.layers.2": "cpu", "lm_head": "meta"})
    assert [devices[u].type for u in placement_units(cfg)] == ["cpu", "meta", "meta", "cpu", "meta", "cpu", "meta"]
    assert resolve_device_map(cfg, None)["lm_head"] == torch.device("cpu")


@pytest.mark.parametrize("device_map, message", [
    ({"layers.1.mlp": "cpu", "": "cpu"}, "names no unit"),
    ({"layers.9": "cpu", "": "cpu"}, "names no unit"),
    ({"embed_tokens": "cpu"}, "no device for layers.0"),
    ({"": 7}, r"device_map\[''\]=7 is not available on this machine"),
    ("balanced", "device_map='balanced' is not a device: use None, 'auto', one device"),
    ({"": "gpu"}, r"device_map\[''\]='gpu' is not a device: use 'cpu', 'cuda'"),
    (True, "device_map must be None, 'auto', one device .* got True"),
    (["cpu"], r"device_map must be None, 'auto', one device .* got \['cpu'\]"),
])
def test_bad_device_maps(device_map, message):
    with pytest.raises(ValueError, match=message):
        resolve_device_map(TINY_FP8, device_map)


@pytest.mark.parametrize("device_map", ["cpu", torch.device("cpu"), "meta"])
def test_one_device_takes_every_unit(device_map):
    devices = resolve_device_map(TINY_FP8, device_map)
    assert list(devices) == placement_units(TINY_FP8) and set(devices.values()) == {torch.device(device_map)}


@pytest.mark.parametrize("device_map", ["cuda", "cuda:1", 0, torch.device("cuda", 1)])
def test_cuda_is_refused_by_name_where_torch_has_none(monkeypatch, device_map):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    wanted = rf"^device_map={re.escape(repr(device_map))} is not available on this machine"
    with pytest.raises(ValueError, match=wanted):
        resolve_device_map(TINY_FP8, device_map)


def test_auto_without_a_gpu_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert set(resolve_device_map(TINY_FP8, "auto").values()) == {torch.device("cpu")}


def test_load_with_an_explicit_map_and_per_layer_cache(tmp_path_factory):
    folder = release(tmp_path_factory)
    model = k2lab.load(folder, dtype=torch.float32, device_map={"": "cpu", "layers.2": torch.device("cpu")})
    reference = k2lab.load(folder, dtype=torch.float32)
    ids = token_ids(TINY_FP8, batch=1)
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))
        # One device for all, as HF spells it: the same model.
        assert torch.equal(k2lab.load(folder, dtype=torch.float32, device_map="cpu")(ids), reference(ids))
    on_meta = k2lab.load(folder, dtype=torch.float32, device_map="meta")  # the shapes, nothing read
    assert all(t.is_meta for t in on_meta.state_dict().values())
    with pytest.raises(ValueError, match="device_map='cuda:x' is not a device"):
        k2lab.load(folder, device_map="cuda:x")
    cache = LatentCache(TINY_FP8, 1, torch.float32, ["cpu", "meta", "cpu", "meta"])
    assert [cache.latents(i).device.type for i in range(4)] == ["cpu", "meta", "cpu", "meta"]


def test_units_mapped_to_meta_are_not_read(tmp_path_factory, monkeypatch):
    """A pipeline stage loads its own blocks only: the others go to the meta device, shapes without data."""
    from k2lab.weights.reader import Checkpoint

    read, original = [], Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, info, device="cpu": (
        read.append(info.name) if torch.device(device).type != "meta" else None, original(self, info, device))[1])
    model = k2lab.load(release(tmp_path_factory), device_map={"": "meta", "layers.1": "cpu", "layers.2": "cpu"})
    assert {p.device.type for p in model.layers[1].parameters()} == {"cpu"}
    assert {p.device.type for p in model.layers[3].parameters()} | {model.lm_head.weight.device.type} == {"meta"}
    assert read and all(name.startswith(("model.layers.1.", "model.layers.2.")) for name in read)
