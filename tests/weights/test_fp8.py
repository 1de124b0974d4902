"""FP8 e4m3 blocks: exact dequantization with partial edge blocks, FP8-resident modules, and the GPU check's
clean exit on a machine without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from release_layout import (
    TINY_FORMAT,
    TINY_FP8,
    release,
    single_thread,  # noqa: F401 - an autouse fixture: one thread for this module
    token_ids,
)

import k2lab
from k2lab import K2Config
from k2lab.weights.quant.fp8 import FP8, FP8Linear, FP8RoutedExperts, dequantize, quantize, scale_shape, to_float32


def _blockwise(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The definition, one block at a time."""
    out = weight.float()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= scale_inv[i, j]
    return out


def _random_fp8(shape, block, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(FP8)
    return weight, torch.rand(scale_shape(shape, block), generator=gen) + 0.5


def test_scale_grid_of_k2_kv_a_proj_has_five_row_blocks():
    cfg = K2Config.kimi_k2()
    assert scale_shape((cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.hidden_size), (128, 128)) == (5, 56)


def test_every_e4m3_byte_converts_exactly():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)
    # Bytes are looked up in pairs: an odd count, an odd offset and a strided view take the padded copy.
    for part in (every, every[1:], every[3:].view(11, 23), every.view(16, 16)[:, 1:]):
        ours, torch_cast = to_float32(part), part.float()
        assert ours.shape == part.shape and ours.dtype == torch.float32
        assert torch.equal(ours.isnan(), torch_cast.isnan())  # a conversion, exact: bit for bit
        assert torch.equal(ours.nan_to_num(), torch_cast.nan_to_num())


@pytest.mark.parametrize("shape, block", [((576, 7168 // 16), (128, 128)), ((56, 200), (32, 48)),
                                          ((256, 384), (128, 128)), ((5, 7), (16, 16))])
def test_dequantize_is_blockwise_value_times_scale(shape, block):
    weight, scale = _random_fp8(shape, block)
    expected = _blockwise(weight, scale, block)
    assert torch.equal(dequantize(weight, scale, block, torch.float32), expected)
    assert torch.equal(dequantize(weight, scale, block), expected.bfloat16())  # rounded once, from float32


def test_dequantize_stacked_experts_matches_each_expert():
    block = (32, 48)
    pairs = [_random_fp8((80, 200), block, seed) for seed in range(3)]
    stacked = dequantize(torch.stack([w for w, _ in pairs]), torch.stack([s for _, s in pairs]), block, torch.float32)
    for e, (w, s) in enumerate(pairs):
        assert torch.equal(stacked[e], _blockwise(w, s, block))


def test_dequantize_refuses_a_scale_grid_of_the_wrong_shape():
    weight, scale = _random_fp8((56, 200), (32, 48))
    with pytest.raises(ValueError, match="does not match"):
        dequantize(weight, scale[:1], (32, 48))


def test_quantize_round_trip_and_block_maxima():
    weight = torch.randn(100, 130, generator=torch.Generator().manual_seed(0))
    values, scale = quantize(weight, (32, 48))
    assert values.dtype == FP8 and scale.shape == (4, 3)
    assert values.float().abs().amax() == 448  # each block's largest magnitude maps to e4m3's largest value
    back = dequantize(values, scale, (32, 48), torch.float32)
    assert ((back - weight).abs() <= weight.abs() * 2**-4 + 1e-6).all()  # 3 mantissa bits: half-ulp 2^-4


def test_fp8_linear_weight_is_dequantized_at_each_read():
    block = (32, 48)
    layer = FP8Linear(200, 56, block, dtype=torch.float32)
    layer.weight_fp8, layer.weight_scale_inv = _random_fp8((56, 200), block)
    x = torch.randn(3, 200)
    assert torch.equal(layer.weight, _blockwise(layer.weight_fp8, layer.weight_scale_inv, block))
    # The forward's own product against F.linear's: equal to float32 rounding, at outputs of a few thousand.
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-2)
    assert dict(layer.named_parameters()) == {}  # the e4m3 bytes are buffers: not trained
    assert layer.weight_fp8.nbytes == 56 * 200


def test_fp8_experts_dequantize_the_chosen_expert():
    experts = FP8RoutedExperts(TINY_FP8, TINY_FORMAT.block, dtype=torch.float32)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        buffer = getattr(experts, f"{proj}_fp8")
        values, scale = _random_fp8(buffer.shape, TINY_FORMAT.block)
        buffer.copy_(values)
        getattr(experts, f"{proj}_scale_inv").copy_(torch.rand(getattr(experts, f"{proj}_scale_inv").shape))
    gate, up, down = experts.expert_weights(5)
    assert gate.shape == (80, 200) and down.shape == (200, 80) and gate.dtype == torch.float32
    assert torch.equal(down, _blockwise(experts.down_proj_fp8[5], experts.down_proj_scale_inv[5], (32, 48)))


def test_fp8_resident_load_equals_dequantized_load(tmp_path_factory):
    folder = release(tmp_path_factory)
    resident = k2lab.load(folder, dtype=torch.float32, quantized_resident=True)
    dense = k2lab.load(folder, dtype=torch.float32)
    assert isinstance(resident.layers[1].self_attn.kv_b_proj, FP8Linear)
    assert isinstance(resident.layers[1].mlp.experts, FP8RoutedExperts)
    assert isinstance(resident.layers[0].mlp.gate_proj, FP8Linear)  # the dense block's MLP too
    assert resident.lm_head.weight.dtype == torch.float32  # embedding, head, norms, router: never FP8
    ids = token_ids(TINY_FP8)
    with torch.no_grad():
        for attn_impl in ("naive", "absorbed"):  # absorbed reads kv_b_proj.weight directly
            # The same weights through other modules (and kernels): equal to float32 rounding, not bit for bit.
            torch.testing.assert_close(resident(ids, attn_impl=attn_impl), dense(ids, attn_impl=attn_impl),
                                       rtol=1e-5, atol=1e-5)
    fp8_bytes = sum(b.nbytes for name, b in resident.named_buffers() if b.dtype == FP8)
    assert fp8_bytes == sum(b.numel() for name, b in resident.named_buffers() if name.endswith("_fp8"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_gpu_check_exits_cleanly_without_a_gpu():
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout and done.stderr == ""


def test_dtype_and_device_moves_keep_the_e4m3_bytes(tmp_path_factory):
    folder = release(tmp_path_factory)
    resident = k2lab.load(folder, quantized_resident=True).float()  # bfloat16 at load, then float32
    kv_b = resident.layers[1].self_attn.kv_b_proj
    assert kv_b.weight_fp8.dtype == FP8 and kv_b.weight_scale_inv.dtype == torch.float32
    assert kv_b.weight.dtype == torch.float32 and resident.layers[1].mlp.experts.gate_proj_fp8.dtype == FP8
    ids = token_ids(TINY_FP8)
    with torch.no_grad():  # the checkpoint's non-FP8 tensors are bfloat16: widening them is exact
        torch.testing.assert_close(resident(ids), k2lab.load(folder, dtype=torch.float32)(ids), rtol=1e-5, atol=1e-5)
