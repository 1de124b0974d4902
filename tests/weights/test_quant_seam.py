"""The quantization seam: config.json's quantization_config chooses the stored format, unknown formats are refused by
name, and the bytes each format says a matrix takes add up to the release's published figures (seeds)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import k2lab
from k2lab import K2Config
from k2lab.weights.quant import UNQUANTIZED, format_from_quantization_config, resolve_format
from k2lab.weights.quant.fp8 import FP8Format
from k2lab.weights.schema import checkpoint_tensors

RELEASED = Path(__file__).parent.parent / "data" / "kimi_k2_instruct_config.json"
K2 = K2Config.kimi_k2()
GIB = 2**30


def test_the_released_quantization_config_chooses_fp8_in_128_blocks():
    released = json.loads(RELEASED.read_text())["quantization_config"]
    assert format_from_quantization_config(released) == FP8Format(block=(128, 128))
    assert format_from_quantization_config({"quant_method": "fp8", "weight_block_size": [32, 48]}).block == (32, 48)


@pytest.mark.parametrize("config", [None, {}])
def test_no_quantization_config_is_unquantized(config):
    fmt = format_from_quantization_config(config)
    assert fmt is UNQUANTIZED and not fmt.quantized
    assert not any(fmt.quantizes(spec) for spec in checkpoint_tensors(K2Config.mini()))


@pytest.mark.parametrize(("config", "named"), [
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "gptq"}, "'gptq'"),
    ({"bits": 4}, "quant_method None"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ("fp8", "must be a mapping"),
])
def test_unknown_or_unsupported_formats_are_refused_by_name(config, named):
    with pytest.raises(ValueError, match=rf"quantization_config.*{named}|{named}.*quantization_config"):
        format_from_quantization_config(config, "ckpt/config.json")


def test_formats_by_name_and_their_refusal():
    assert resolve_format("fp8") == FP8Format()
    assert resolve_format("unquantized") is UNQUANTIZED
    assert resolve_format(FP8Format((32, 48))).block == (32, 48)
    for wrong in ("nf4", None, True):  # None and a bool name no format either
        with pytest.raises(ValueError, match=f"format must be .* got {wrong!r}"):
            resolve_format(wrong)
    with pytest.raises(ValueError, match="FP8 block"):
        FP8Format((0, 128))


def test_fp8_bytes_per_matrix_give_the_releases_958_3_gib():
    # Seeds: 958.3 GiB with FP8 matrices and block scales left out; 956.1 GiB with the head tied to the embedding.
    assert round(k2lab.weight_bytes(K2, format="fp8") / GIB, 1) == 958.3
    assert round(k2lab.weight_bytes(K2, format=FP8Format()) / GIB, 1) == 958.3
    assert round((k2lab.weight_bytes(K2, format="fp8") - 2 * 1_174_405_120) / GIB, 1) == 956.1
    kv_a = next(s for s in checkpoint_tensors(K2) if s.name.endswith("layers.1.self_attn.kv_a_proj_with_mqa.weight"))
    assert FP8Format().tensor_bytes(kv_a, scales=False) == 576 * 7168  # one byte per e4m3 value
    assert FP8Format().tensor_bytes(kv_a) == 576 * 7168 + 4 * 5 * 56  # + a float32 scale per (partial) block


def test_unquantized_bytes_are_two_per_parameter_with_a_float32_bias():
    params = k2lab.count_parameters(K2).total
    biases = (K2.num_hidden_layers - K2.first_k_dense_replace) * K2.n_routed_experts
    assert k2lab.weight_bytes(K2, format="unquantized") == 2 * params + 2 * biases  # the bias: 4 bytes, not 2
    assert k2lab.weight_bytes(K2, format="unquantized", dtype=torch.float32) == 4 * params


def test_plan_asks_the_format():
    h200 = 141 * 10**9
    assert sum(k2lab.plan(K2, devices=[h200] * 8, format="fp8").weight_bytes) == k2lab.weight_bytes(K2, scales=True)
    assert not k2lab.plan(K2, devices=[h200] * 8, format="unquantized").fits


def test_the_weights_package_never_imports_analysis():
    root = Path(k2lab.__file__).parent / "weights"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "analysis" not in (node.module or ""), f"{path} imports {node.module}"
