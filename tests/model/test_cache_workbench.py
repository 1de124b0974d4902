"""The activation cache as a workbench (issue #40): pickled and saved without the model, moved and cast, read with
TransformerLens's spellings, split per head and per expert, laid out as tables, and refusing bad positions by name.
Every check compares with the probes themselves or a recomputation from the model's weights."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import sys

import numpy as np
import pytest
import safetensors.torch
import torch
from tiny import TINY

import k2lab
from k2lab import K2Model
from k2lab.model.activation_cache import ACTIVATIONS_FILE, CACHE_JSON, ActivationCache
from k2lab.weights.quant.fp8 import FP8Format

pytestmark = pytest.mark.usefixtures("no_grad")

L, H, E, D = TINY.num_hidden_layers, TINY.num_attention_heads, TINY.n_routed_experts, TINY.hidden_size
MOE_LAYERS = [1, 2]  # TINY: layer 0 dense


@pytest.fixture(scope="module")
def cache(model, ids) -> ActivationCache:
    with torch.no_grad():
        return model.run_with_cache(ids)[1]


def mixed_dtypes(cache: ActivationCache, model: K2Model) -> ActivationCache:
    """The cache with its attention probes in bfloat16: int64 topk_idx, float32 logits and bf16 side by side."""
    return ActivationCache({n: t.bfloat16() if ".self_attn." in n else t for n, t in cache.items()}, model)


def column(table, *names: str) -> torch.Tensor:
    """Columns of a pandas table as a tensor (a copy: pandas hands out read-only arrays)."""
    return torch.tensor(table[list(names) if len(names) > 1 else names[0]].to_numpy())


def unpickled(cache: ActivationCache) -> ActivationCache:
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# ---- pickling: tensors and config, no model --------------------------------------------------------------------------
def test_torch_save_writes_the_tensors_not_the_model(cache, model):
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in cache.values()}
    weights = sum(p.nbytes for p in model.parameters())
    assert weights > 4 * sum(storages.values())  # so a pickled model could not hide in the bound below
    assert buffer.tell() <= sum(storages.values()) + 64 * 1024  # the storages torch.save writes, plus pickle overhead


def test_unpickled_cache_keeps_config_analyses_and_names_the_weight_ones(cache, model):
    loaded = unpickled(cache)
    assert loaded.model is None and loaded.config == model.config and list(loaded) == list(cache)
    assert all(torch.equal(loaded[n], cache[n]) for n in cache)
    assert torch.equal(loaded.stack("hook_resid_post"), cache.stack("hook_resid_post"))
    assert torch.equal(loaded.accumulated_resid(), cache.accumulated_resid())
    assert torch.equal(loaded.decompose_resid(return_labels=True)[0], cache.decompose_resid(return_labels=True)[0])
    assert torch.equal(loaded.stack_expert_results(1), cache.stack_expert_results(1))
    assert torch.equal(loaded["resid_post", -1], cache["layers.2.hook_resid_post"])
    needs_weights = {
        "logit_lens": lambda c: c.logit_lens(),
        "logit_attribution": lambda c: c.logit_attribution(3),
        "apply_ln_to_stack": lambda c: c.apply_ln_to_stack(c.accumulated_resid()),
        "stack_head_results": lambda c: c.stack_head_results(),
    }
    for what, call in needs_weights.items():
        with pytest.raises(RuntimeError, match=rf"{what} reads the model's weights.*cache\.attach\(model\)"):
            call(loaded)
    with pytest.raises(RuntimeError, match="apply_ln_to_stack reads the model's weights"):
        loaded.accumulated_resid(apply_ln=True)
    assert loaded.attach(model) is loaded
    assert torch.equal(loaded.logit_lens(pos=-1), cache.logit_lens(pos=-1))


def test_attach_checks_the_config(cache):
    loaded = unpickled(cache)
    with pytest.raises(ValueError, match=r"rms_norm_eps: cache 1e-06, model 1e-05"):
        loaded.attach(K2Model(TINY.replace(rms_norm_eps=1e-5)))
    with pytest.raises(TypeError, match="attach takes the K2Model the cache was recorded from, got dict"):
        loaded.attach({})
    assert loaded.model is None


# ---- to(device, dtype) -----------------------------------------------------------------------------------------------
def test_to_casts_floating_tensors_only_and_keeps_the_model(cache, model):
    half = cache.to("cpu", torch.bfloat16)
    assert half is not cache and half.model is model and list(half) == list(cache)
    for name, t in cache.items():
        expected = t.bfloat16() if t.is_floating_point() else t
        assert half[name].dtype == expected.dtype and torch.equal(half[name], expected), name
    assert half["topk_idx", 1].dtype == torch.int64 and cache["logits"].dtype == torch.float32  # original unchanged
    assert {t.device.type for t in cache.to("meta").values()} == {"meta"}
    with pytest.raises(ValueError, match=r"give a floating torch.dtype .* got torch.int32"):
        cache.to("cpu", torch.int32)


# ---- save / load -----------------------------------------------------------------------------------------------------
def test_save_load_round_trip_keeps_order_dtypes_and_values(cache, model, tmp_path):
    mixed = mixed_dtypes(cache, model)
    path = mixed.save(tmp_path / "run")
    assert sorted(p.name for p in path.iterdir()) == sorted([ACTIVATIONS_FILE, CACHE_JSON])
    meta = json.loads((path / CACHE_JSON).read_text())
    assert meta["probes"] == list(cache) and meta["k2lab_version"] == k2lab.__version__
    assert meta["config"] == dataclasses.asdict(model.config)
    loaded = ActivationCache.load(path)
    assert loaded.model is None and loaded.config == model.config and list(loaded) == list(mixed)
    dtypes = {loaded[n].dtype for n in loaded}
    assert {torch.int64, torch.float32, torch.bfloat16} <= dtypes
    assert loaded["topk_idx", 1].dtype == torch.int64 and loaded["logits"].dtype == torch.float32
    assert loaded["z", 0].dtype == torch.bfloat16
    for name, t in mixed.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    attached = ActivationCache.load(path, model=model)
    assert attached.model is model and torch.equal(attached.logit_lens(pos=-1), cache.logit_lens(pos=-1))


def test_save_replaces_a_saved_cache_and_leaves_nothing_beside_it(cache, model, tmp_path):
    path = tmp_path / "run"
    cache.save(path)
    fewer = ActivationCache({n: t for n, t in cache.items() if "resid" in n}, model)
    fewer.save(path)
    assert list(ActivationCache.load(path)) == list(fewer)
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    (tmp_path / "empty").mkdir()
    cache.save(tmp_path / "empty")  # an empty directory holds nothing to lose
    assert list(ActivationCache.load(tmp_path / "empty")) == list(cache)


def test_save_refuses_to_write_over_what_is_not_a_cache(cache, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    with pytest.raises(FileExistsError, match=r"notes.txt' exists and is not a saved ActivationCache"):
        cache.save(notes)
    assert notes.read_text() == "keep me"
    project = tmp_path / "project"
    project.mkdir()
    (project / "main.py").write_text("print(1)")
    with pytest.raises(FileExistsError, match=r"holds \['main.py'\], and a save replaces the whole directory"):
        cache.save(project)
    assert [p.name for p in project.iterdir()] == ["main.py"]


@pytest.mark.parametrize("earlier", [False, True], ids=["new path", "over a saved cache"])
def test_a_failed_save_leaves_nothing_half_written(cache, model, tmp_path, monkeypatch, earlier):
    path = tmp_path / "run"
    before = ActivationCache({"embed_tokens.hook_out": cache["embed"]}, model)
    if earlier:
        before.save(path)

    def write_then_fail(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)  # a partial file, then the disk fills up
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        cache.save(path)
    assert [p.name for p in tmp_path.iterdir()] == (["run"] if earlier else [])
    if earlier:
        monkeypatch.undo()
        assert list(ActivationCache.load(path)) == ["embed_tokens.hook_out"]


def test_load_names_what_is_wrong(cache, model, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'.*nowhere' is not a saved ActivationCache: it has no cache.json"):
        ActivationCache.load(tmp_path / "nowhere")
    path = cache.save(tmp_path / "run")
    with pytest.raises(ValueError, match=r"n_routed_experts: cache 16, model 8"):
        ActivationCache.load(path, model=K2Model(TINY.replace(n_routed_experts=8)))
    (path / CACHE_JSON).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match=r"does not describe an ActivationCache \(format 'something else'"):
        ActivationCache.load(path)


# ---- TransformerLens spellings ---------------------------------------------------------------------------------------
def test_transformer_lens_names_are_keys(cache):
    assert cache["blocks.2.hook_resid_post"] is cache["layers.2.hook_resid_post"]
    assert cache["blocks.0.attn.hook_z"] is cache["layers.0.self_attn.hook_z"]
    assert cache["hook_embed"] is cache["embed_tokens.hook_out"]
    assert cache["ln_final.hook_normalized"] is cache["norm.hook_out"]
    assert "blocks.1.mlp.gate.hook_topk_idx" in cache and "blocks.0.mlp.gate.hook_topk_idx" not in cache
    with pytest.raises(KeyError, match="'layers.7.hook_resid_post' is not in this cache"):
        cache["blocks.7.hook_resid_post"]


def test_decompose_resid_with_labels_is_transformer_lens_stack(cache):
    stack, labels = cache.decompose_resid(return_labels=True)
    assert labels == ["embed", "L0.attn", "L0.mlp", "L1.attn", "L1.mlp", "L2.attn", "L2.mlp"]
    assert stack.shape == (7, 2, 7, D)
    assert torch.equal(stack[0], cache["embed"]) and torch.equal(stack[3], cache["attn_out", 1])
    assert torch.equal(stack[6], cache["mlp_out", 2])
    assert torch.allclose(stack.sum(0), cache["resid_post", 2], atol=1e-5)
    assert hasattr(cache.decompose_resid(), "by_expert")  # the default return is still the decomposition


def test_pos_slice_is_a_spelling_of_pos(cache):
    at_last, _ = cache.decompose_resid(pos_slice=-1, return_labels=True)
    assert torch.equal(at_last, cache.decompose_resid(return_labels=True)[0][:, :, -1])
    window = cache.accumulated_resid(pos_slice=slice(2, 5))
    assert torch.equal(window, cache.accumulated_resid()[:, :, 2:5])
    scaled = cache.apply_ln_to_stack(at_last, pos_slice=-1)
    assert torch.allclose(scaled.sum(0), cache["norm.hook_out"][:, -1], atol=1e-4)
    with pytest.raises(ValueError, match=r"give pos= or pos_slice= .* not both: got pos=-1, pos_slice=-1"):
        cache.decompose_resid(pos=-1, pos_slice=-1)


# ---- per head --------------------------------------------------------------------------------------------------------
def test_head_results_are_each_heads_slice_of_o_proj(cache, model):
    stack, labels = cache.stack_head_results(return_labels=True)
    assert stack.shape == (L * H, 2, 7, D) and stack.dtype == torch.float32
    assert labels == [f"L{l}H{h}" for l in range(L) for h in range(H)]
    V = TINY.v_head_dim
    for l in range(L):
        z, weight = cache["z", l], model.layers[l].self_attn.o_proj.weight  # [B, T, H, V], [D, H*V]
        for h in range(H):
            by_hand = z[..., h, :] @ weight[:, h * V : (h + 1) * V].T  # [B, T, D]
            assert torch.allclose(stack[l * H + h], by_hand, atol=1e-6), labels[l * H + h]
        assert torch.allclose(stack[l * H : (l + 1) * H].sum(0), cache["attn_out", l], atol=1e-5)
    assert torch.equal(cache.stack_head_results(2), stack[: 2 * H])  # the heads of the layers before layer 2
    assert torch.equal(cache.stack_head_results(None), stack)
    assert torch.allclose(cache.stack_head_results(pos_slice=-1), stack[:, :, -1], atol=1e-6)


def test_head_results_through_the_final_norm(cache, model):
    stack = cache.stack_head_results(pos_slice=-1)  # [L*H, B, D]
    x = cache["resid_post", 2][:, -1]  # [B, D] the final residual
    scale = model.norm.weight / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + TINY.rms_norm_eps)
    assert torch.allclose(cache.stack_head_results(pos_slice=-1, apply_ln=True), stack * scale, atol=1e-6)


@pytest.mark.parametrize("layer", [0, L + 1, -2, True, 1.0])
def test_head_results_layer_is_checked(cache, layer):
    with pytest.raises(ValueError, match=rf"layer must be in 1..{L} .* or -1 or None for every layer; got"):
        cache.stack_head_results(layer)


def test_quantized_o_proj_runs_one_head_at_a_time(model, ids):
    """An FP8 o_proj holds no float matrix: its heads come from running it on z with the other heads zeroed, which
    must agree with the matrix route on the same (dequantized) weights, and sum to the attention output."""
    fmt, quantized, dense = FP8Format(block=(32, 32)), copy.deepcopy(model), copy.deepcopy(model)
    for quant_layer, dense_layer in zip(quantized.layers, dense.layers, strict=True):
        weight = quant_layer.self_attn.o_proj.weight  # [D, H*V]
        o_proj = fmt.linear(weight.shape[1], weight.shape[0], dtype=torch.float32)
        for suffix, stored in zip(o_proj.suffixes, fmt.quantize("o_proj.weight", weight), strict=True):
            getattr(o_proj, "weight" + suffix).copy_(stored)
        quant_layer.self_attn.o_proj = o_proj
        dense_layer.self_attn.o_proj.weight.data = o_proj.weight  # the same linear map, as a plain matrix
    _, fp8_cache = quantized.run_with_cache(ids)
    by_module = fp8_cache.stack_head_results()
    by_matrix = ActivationCache(dict(fp8_cache), dense).stack_head_results()
    assert not isinstance(quantized.layers[0].self_attn.o_proj, torch.nn.Linear)
    assert torch.allclose(by_module, by_matrix, atol=1e-5)
    assert torch.allclose(by_module.unflatten(0, (L, H)).sum(1), fp8_cache.stack("hook_attn_out"), atol=1e-5)


# ---- per expert ------------------------------------------------------------------------------------------------------
def test_expert_results_scatter_each_slot_to_its_expert(cache):
    for layer in MOE_LAYERS:
        stack, labels = cache.stack_expert_results(layer, return_labels=True)
        assert stack.shape == (E, 2, 7, D) and labels == [f"L{layer}E{e}" for e in range(E)]
        ids, weights = cache["topk_idx", layer], cache["topk_weights", layer]  # [B, T, k]
        outs = cache["expert_out", layer]  # [B, T, k, D]
        by_hand = torch.zeros(E, 2, 7, D)
        for b in range(2):
            for t in range(7):
                for s in range(ids.shape[-1]):
                    by_hand[ids[b, t, s], b, t] += weights[b, t, s] * outs[b, t, s]
        assert torch.allclose(stack, by_hand, atol=1e-6)
        chosen = torch.zeros(E, 2, 7, dtype=torch.bool)
        chosen.scatter_(0, ids.permute(2, 0, 1), True)
        assert (stack[~chosen] == 0).all()  # zero where the token did not choose the expert
        total = stack.sum(0) + cache["shared_out", layer]
        assert torch.allclose(total, cache["mlp_out", layer], atol=1e-5)
    assert torch.equal(cache.stack_expert_results(-1), cache.stack_expert_results(2))
    assert torch.equal(cache.stack_expert_results(1, pos_slice=-1), cache.stack_expert_results(1)[:, :, -1])


def test_expert_results_refuse_a_dense_layer(cache):
    with pytest.raises(ValueError, match=r"layer 0 is a dense layer, with no routed experts; MoE layers: \[1, 2\]"):
        cache.stack_expert_results(0)
    with pytest.raises(ValueError, match=r"layer must be an int in -3..2, got 3"):
        cache.stack_expert_results(3)


# ---- tables ----------------------------------------------------------------------------------------------------------
def test_router_choice_as_one_long_table(cache):
    ids, weights = cache["topk_idx", 1], cache["topk_weights", 1]  # [B, T, k]
    table = cache.to_dataframe("layers.1.mlp.gate.hook_topk_idx")
    assert list(table.columns) == ["batch", "position", "slot", "expert", "weight"] and len(table) == ids.numel()
    b, t, s = (column(table, c) for c in ("batch", "position", "slot"))
    rebuilt_ids, rebuilt_weights = torch.zeros_like(ids), torch.zeros_like(weights)
    rebuilt_ids[b, t, s] = column(table, "expert")
    rebuilt_weights[b, t, s] = column(table, "weight")
    assert torch.equal(rebuilt_ids, ids) and torch.equal(rebuilt_weights, weights)
    assert table.equals(cache.to_dataframe(("topk_weights", 1)))


def test_small_probes_as_tables(cache):
    max_logit = cache["max_logit", 0]  # [B, H]
    table = cache.to_dataframe(("max_logit", 0))
    assert list(table.columns) == ["batch", "head", "value"]
    assert torch.equal(torch.tensor(table.pivot(index="batch", columns="head", values="value").to_numpy()),
                       max_logit)
    scores = cache["scores", 2]  # [B, T, E]
    table = cache.to_dataframe("blocks.2.mlp.gate.hook_scores")
    assert list(table.columns) == ["batch", "position", *[f"expert_{e}" for e in range(E)]]
    assert torch.equal(column(table, "batch", "position"),
                       torch.cartesian_prod(torch.arange(2), torch.arange(7)))
    assert torch.equal(torch.tensor(table.iloc[:, 2:].to_numpy()), scores.flatten(0, 1))
    k_pe = cache.to_dataframe(("k_pe", 0))
    assert list(k_pe.columns)[2:] == [f"index_{i}" for i in range(TINY.qk_rope_head_dim)]


def test_big_probes_point_to_the_tensor(cache):
    with pytest.raises(ValueError, match=r"layers.0.self_attn.hook_z is \[2, 7, 4, 32\], too big for a table.*"
                                         r"cache\['layers.0.self_attn.hook_z'\]"):
        cache.to_dataframe(("z", 0))
    with pytest.raises(ValueError, match=r"hook_resid_post is \[2, 7, 256\].*n <= 64"):
        cache.to_dataframe(("resid_post", 0))


def test_tables_name_the_extra_without_pandas(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas now raises ImportError
    with pytest.raises(ImportError, match=r"pip install k2lab\[lab\]"):
        cache.to_dataframe(("topk_idx", 1))


# ---- named errors ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", [99999, -1, torch.tensor([3, 512])], ids=["too big", "negative", "tensor"])
def test_logit_attribution_names_a_token_outside_the_vocabulary(cache, target):
    with pytest.raises(IndexError, match=r"target token id (99999|-1|512) is outside the vocabulary: .* 0..511"):
        cache.logit_attribution(target)


POSITION_READERS = {
    "decompose_resid": lambda c, **p: c.decompose_resid(**p),
    "logit_attribution": lambda c, **p: c.logit_attribution(3, **p),
    "logit_lens": lambda c, **p: c.logit_lens(**p),
    "accumulated_resid": lambda c, **p: c.accumulated_resid(**p),
    "apply_ln_to_stack": lambda c, **p: c.apply_ln_to_stack(torch.zeros(1, 2, D), **p),
    "stack_head_results": lambda c, **p: c.stack_head_results(**p),
    "stack_expert_results": lambda c, **p: c.stack_expert_results(1, **p),
}


@pytest.mark.parametrize("reader", POSITION_READERS.values(), ids=POSITION_READERS.keys())
@pytest.mark.parametrize("pos", [7, 99, -8])
def test_every_pos_is_checked(cache, reader, pos):
    with pytest.raises(IndexError, match=rf"pos={pos} is outside the 7 positions of this cache: give an int in -7..6"):
        reader(cache, pos=pos)


def test_pos_names_its_spelling_and_type(cache):
    with pytest.raises(IndexError, match=r"pos_slice=99 is outside the 7 positions"):
        cache.decompose_resid(pos_slice=99)
    with pytest.raises(TypeError, match=r"pos selects positions: give an int, a slice or None, got 'last'"):
        cache.decompose_resid(pos="last")
    with pytest.raises(TypeError, match=r"got True"):
        cache.accumulated_resid(pos=True)
    assert torch.equal(cache.accumulated_resid(pos=np.int64(-1)), cache.accumulated_resid()[:, :, -1])
