"""K2-Thinking's INT4 experts (compressed-tensors pack-quantized): packing and dequantization against the
compressed-tensors package on matrices of the real expert shapes, the release's quantization_config, the byte figures,
and a K2-Thinking-layout checkpoint written by k2lab's writer, loaded against HF transformers holding the weights
dequantized by compressed-tensors' own unpacking."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hf_oracle import hf_model, relative_error
from release_layout import _quiet_transformers, hf_reference, single_thread, token_ids  # noqa: F401
from safetensors.torch import load_file, save_file
from tiny import experts_one_at_a_time

import k2lab
from k2lab import K2Config
from k2lab.model.layers import Linear
from k2lab.weights import download
from k2lab.weights.load import slice_layers
from k2lab.weights.quant import format_from_quantization_config
from k2lab.weights.quant.base import QuantizedRoutedExperts
from k2lab.weights.quant.int4 import Int4Format
from k2lab.weights.reader import INDEX_FILE, CheckpointError, read_config
from k2lab.weights.schema import checkpoint_tensors
from k2lab.weights.streaming import StreamedExperts
from k2lab.weights.writer import write_checkpoint

ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402

K2 = K2Config.kimi_k2()  # K2-Thinking's weights have K2-Instruct's shapes
SCHEME = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
    num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
# K2-Thinking's quantization_config as published with the checkpoint.
K2_THINKING_QUANTIZATION = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
EXPERT_SHAPES = [(2048, 7168), (7168, 2048)]  # K2's gate/up and down projections


def _random_packed(shape, seed):
    """Random int32 words (every nibble pattern) and bfloat16 group scales for an [O, I] matrix."""
    O, I = shape
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(-2**31, 2**31, (O, I // 8), generator=gen, dtype=torch.int64).to(torch.int32)
    scale = (torch.rand(O, I // 32, generator=gen) * 0.02 + 1e-3).bfloat16()
    return packed, scale


@pytest.mark.parametrize("shape", EXPERT_SHAPES)
def test_dequantization_equals_compressed_tensors_and_is_exact(shape):
    packed, scale = _random_packed(shape, seed=shape[0])
    ours = Int4Format().dequantize((packed, scale), torch.float32)
    values = ct_helpers.unpack_from_int32(packed, 4, torch.Size(shape))  # their unpacking: int8 in -8..7
    exact = (values.double().unflatten(-1, (-1, 32)) * scale.double()[..., None]).flatten(-2)
    assert torch.equal(ours.double(), exact)  # every product exact in float32
    state = {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor(shape)}
    theirs = PackedQuantizationCompressor.decompress(state, SCHEME)["weight"]  # bfloat16, as the scales
    assert torch.equal(Int4Format().dequantize((packed, scale), torch.bfloat16), theirs)


def test_quantize_packs_as_compressed_tensors_compresses():
    weight = torch.randn(2048, 7168, generator=torch.Generator().manual_seed(0))
    packed, scale, stored_shape = Int4Format().quantize("w", weight)
    theirs = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, SCHEME)
    assert torch.equal(packed, theirs["weight_packed"]) and stored_shape.tolist() == theirs["weight_shape"].tolist()
    assert packed.dtype == torch.int32 and packed.shape == (2048, 896) and scale.shape == (2048, 224)
    back = Int4Format().dequantize((packed, scale), torch.float32)
    step = scale.float().repeat_interleave(32, dim=-1)
    # Round to nearest: within half a step, plus what rounding the scale down to bfloat16 (up to 2^-8 relative) moves
    # the largest magnitude, 7.5 steps, past the clamp at 7: 7.5 / (1 - 2^-8) - 7 < 0.5 + 8 * 2^-8.
    assert ((back - weight).abs() <= step * (0.5 + 8 * 2**-8)).all()


def test_k2_thinking_quantization_config_chooses_int4_for_the_routed_experts_only():
    fmt = format_from_quantization_config(K2_THINKING_QUANTIZATION)
    assert fmt == Int4Format() and fmt.quantization_config() == K2_THINKING_QUANTIZATION
    mini = K2Config.mini()
    assert {s.component for s in checkpoint_tensors(mini) if fmt.quantizes(s)} == {"routed_experts"}
    assert all(fmt.quantizes(s) for s in checkpoint_tensors(mini) if s.component == "routed_experts")


@pytest.mark.parametrize(("change", "named"), [
    ({"format": "float-quantized"}, "format='float-quantized'"),
    ({"quantization_status": "frozen"}, "quantization_status='frozen'"),
    ({"weights": {"num_bits": 8}}, "weights.num_bits=8"),
    ({"weights": {"symmetric": False}}, "weights.symmetric=False"),
    ({"weights": {"strategy": "channel"}}, "weights.strategy='channel'"),
    ({"weights": {"actorder": "group"}}, "weights.actorder='group'"),
    ({"weights": {"group_size": 12}}, "group_size must be a positive multiple of 8"),
    ({"input_activations": {"num_bits": 8}}, "activation quantization"),
    ({"ignore": ["re:.*self_attn.*"]}, "quantizes lm_head"),
])
def test_unsupported_compressed_tensors_settings_are_refused_by_name(change, named):
    config = json.loads(json.dumps(K2_THINKING_QUANTIZATION))
    group = config["config_groups"]["group_0"]
    if "weights" in change:
        group["weights"].update(change["weights"])
    elif "input_activations" in change:
        group.update(change)
    else:
        config.update(change)
    with pytest.raises(ValueError, match=named):
        format_from_quantization_config(config, "ckpt/config.json")


def test_k2_thinking_weighs_about_594_gb_and_the_gpus_it_needs():
    total = k2lab.weight_bytes(K2, format="int4", scales=True)
    assert round(total / 1e9) == 594  # the published size of K2-Thinking's checkpoint
    experts = sum(s.numel for s in checkpoint_tensors(K2) if s.component == "routed_experts")
    rest = k2lab.weight_bytes(K2, format="unquantized") - 2 * experts  # everything else, in bfloat16
    assert total == experts // 2 + experts // 32 * 2 + 8 * 3 * 384 * 60 + rest  # nibbles, bf16 scales, shapes
    fits = lambda gb, n: k2lab.plan(K2, devices=[gb * 10**9] * n, format="int4").fits  # with 4 GiB headroom each
    assert fits(80, 9) and not fits(80, 8)  # 8 x 80 GB hold the weights, but leave under 2 GB per GPU
    assert fits(141, 5) and not fits(141, 4)


# ---- a K2-Thinking-layout checkpoint written by k2lab's writer ---------------------------------------------------

TINY = K2Config.mini().replace(vocab_size=512, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    hf = hf_model(TINY, seed=0)
    with tempfile.TemporaryDirectory() as tmp, _quiet_transformers():
        hf.save_pretrained(tmp)  # per-expert names, as released
        tensors = {k: v for f in sorted(Path(tmp).glob("*.safetensors")) for k, v in load_file(f).items()}
    out = tmp_path_factory.mktemp("k2_thinking")
    write_checkpoint(out, TINY, lambda spec: tensors[spec.name], num_shards=3, format="int4")
    return out


def _dequantized_by_compressed_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder in float32, INT4 ones unpacked by compressed-tensors and scaled by definition."""
    stored = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    out = {}
    for name, tensor in stored.items():
        if name.endswith(("_scale", "_shape")):
            continue
        if name.endswith("_packed"):
            base = name.removesuffix("_packed")
            shape = torch.Size(stored[base + "_shape"].tolist())
            values = ct_helpers.unpack_from_int32(tensor, 4, shape)
            scale = stored[base + "_scale"].float().repeat_interleave(32, dim=-1)
            out[base] = values.float() * scale
        else:
            out[name] = tensor.float()
    return out


def test_the_writer_writes_the_k2_thinking_layout(folder):
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"] == K2_THINKING_QUANTIZATION
    assert read_config(folder)[1] == Int4Format()
    index = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    expert = "model.layers.1.mlp.experts.3.down_proj."
    assert {n for n in index if n.startswith(expert)} == {expert + p for p in ("weight_packed", "weight_scale",
                                                                                "weight_shape")}
    headers = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert headers[expert + "weight_packed"].dtype == torch.int32
    assert headers[expert + "weight_packed"].shape == (TINY.hidden_size, TINY.moe_intermediate_size // 8)
    assert headers[expert + "weight_scale"].shape == (TINY.hidden_size, TINY.moe_intermediate_size // 32)
    assert headers[expert + "weight_shape"].tolist() == [TINY.hidden_size, TINY.moe_intermediate_size]
    for bf16 in ("model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert headers[bf16].dtype == torch.bfloat16
    assert headers["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


@pytest.mark.parametrize("attn_impl", ["naive", "absorbed"])
def test_int4_checkpoint_matches_hf_on_compressed_tensors_dequantized_weights(folder, attn_impl):
    ref = hf_reference(TINY, _dequantized_by_compressed_tensors(folder))
    model = k2lab.load(folder, dtype=torch.float32)
    ids = token_ids(TINY)
    with torch.no_grad():
        assert relative_error(model(ids, attn_impl=attn_impl), ref(ids).logits) < 1e-4


def test_int4_resident_and_streamed_equal_the_dequantized_model(folder):
    dense = experts_one_at_a_time(k2lab.load(folder, dtype=torch.float32))
    resident = k2lab.load(folder, dtype=torch.float32, quantized_resident=True)
    experts = resident.layers[1].mlp.experts
    assert isinstance(experts, QuantizedRoutedExperts) and experts.gate_proj_packed.dtype == torch.int32
    assert experts.down_proj_scale.dtype == torch.bfloat16
    assert type(resident.layers[1].self_attn.kv_b_proj) is Linear  # attention stays bfloat16 in the files
    D, I = TINY.hidden_size, TINY.moe_intermediate_size
    expert_bytes = 3 * (I * D // 2 + I * D // 32 * 2 + 8)  # packed nibbles, bfloat16 scales, the shape
    streamed = k2lab.load(folder, dtype=torch.float32, expert_budget_bytes=2 * expert_bytes, quantized_resident=True)
    assert isinstance(streamed.layers[1].mlp.experts, StreamedExperts)
    ids = token_ids(TINY, seed=1)

    for model in (resident, streamed):  # made per use: no stacks to pair or index, so pairing would copy both
        assert all(layer.mlp.experts.stacks is None for layer in model.layers[TINY.first_k_dense_replace :])
    with torch.no_grad():
        expected = dense(ids)
        torch.testing.assert_close(resident(ids), expected, rtol=1e-5, atol=1e-5)  # other modules: float32 rounding
        torch.testing.assert_close(streamed(ids), expected, rtol=1e-5, atol=1e-5)
    stats = streamed.expert_cache.stats
    assert stats.bytes_read == stats.misses * expert_bytes and stats.evictions > 0
    assert stats.peak_bytes <= 2 * expert_bytes


def test_a_wrong_weight_shape_is_refused_by_name(folder, tmp_path):
    damaged = Path(tempfile.mkdtemp(dir=tmp_path))
    for f in folder.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    name = "model.layers.2.mlp.experts.5.up_proj.weight_shape"
    shard = damaged / json.loads((damaged / INDEX_FILE).read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = torch.tensor([TINY.hidden_size, TINY.moe_intermediate_size], dtype=torch.int32)  # transposed
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{shard.name}: {name} is \[256, 96\], but config.json implies"):
        k2lab.load(damaged)


def test_hub_slices_fetch_the_shards_of_the_packed_experts(folder):
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    # Shards: 1 = embedding + block 0 (dense), 2 = blocks 1-2 (INT4 experts), 3 = final norm + head.
    def shards(num_layers):
        patterns = download.allow_patterns(slice_layers(TINY, num_layers), weight_map)
        return [p.split("-")[1] for p in patterns if p.endswith(".safetensors")]

    assert shards(1) == ["1", "3"] and shards(2) == ["1", "2", "3"]
    del weight_map["model.layers.1.mlp.experts.0.gate_proj.weight_packed"]
    del weight_map["model.layers.1.mlp.experts.0.gate_proj.weight_scale"]
    del weight_map["model.layers.1.mlp.experts.0.gate_proj.weight_shape"]
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj\.weight is not in"):
        download.allow_patterns(TINY, weight_map)
