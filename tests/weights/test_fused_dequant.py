"""Dequantization in one pass and FP8 products with block scales, checked on the CPU: the compiled kernel a GPU runs
equals the exact path and writes no float32 copy; the block-scaled recipe (what ``torch._scaled_mm`` computes on a
Hopper GPU) equals dequantise-then-matmul to the e4m3 rounding of its activations; FP8Linear falls back by name."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from tiny import TINY
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode

from k2lab.weights.quant import fp8, fp8_matmul, fused_dequant, int4
from k2lab.weights.quant.fp8 import FP8Linear, FP8RoutedExperts, dequantize, quantize
from k2lab.weights.quant.fp8_matmul import blockwise_unsupported, emulate_blockwise, quantize_activations
from k2lab.weights.quant.int4 import Int4Format


def allocations(code: list[str]) -> list[str]:
    """The dtypes of the buffers inductor's generated code allocates."""
    return re.findall(r"= empty_strided_\w+\(.*, (torch\.\w+)\)$", "\n".join(code), re.MULTILINE)


@pytest.mark.slow  # compiles with inductor
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_dequantization_compiles_to_one_pass_equal_to_the_exact_path(dtype):
    """Partial edge blocks (80 x 200 in 32 x 48 blocks), whole blocks, and a stack of experts: the kernel's values are
    the exact path's bit for bit (the same float32 product, rounded once). In bfloat16 (the GPU's compute dtype) it
    writes the result alone: no float32 copy."""
    gen = torch.Generator().manual_seed(0)
    for shape, block in [((80, 200), (32, 48)), ((64, 96), (32, 48)), ((3, 64, 96), (32, 48))]:
        weight = torch.randn(shape, generator=gen)
        values, scale = zip(*(quantize(w, block) for w in weight.view(-1, *shape[-2:])), strict=True)
        values, scale = torch.stack(values).view(shape), torch.stack(scale).view(*shape[:-2], *scale[0].shape)
        out, code = run_and_get_code(fused_dequant.run_compiled, dequantize, values, scale, block, dtype)
        assert torch.equal(out, dequantize(values, scale, block, dtype))
        if dtype == torch.bfloat16:
            assert allocations(code) == ["torch.bfloat16"]  # one buffer: the result


@pytest.mark.slow  # compiles with inductor
def test_int4_dequantization_compiles_to_one_pass_equal_to_the_exact_path():
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(1))
    packed, scale, _ = Int4Format().quantize("w", weight)
    out, code = run_and_get_code(fused_dequant.run_compiled, int4.dequantize, packed, scale, 32, torch.bfloat16)
    assert torch.equal(out, Int4Format().dequantize((packed, scale), torch.bfloat16))
    assert allocations(code) == ["torch.bfloat16"]


def test_the_cpu_keeps_the_exact_path_and_a_failed_compile_falls_back_by_name(monkeypatch):
    values, scale = quantize(torch.randn(64, 96), (32, 48))
    expected = dequantize(values, scale, (32, 48), torch.bfloat16)
    monkeypatch.setattr(fused_dequant, "run_compiled", lambda *a: pytest.fail("the CPU compiled a kernel"))
    assert torch.equal(fp8.FP8Format((32, 48)).dequantize((values, scale), torch.bfloat16), expected)
    monkeypatch.undo()

    def exact(*args):  # a dequantize function of its own, so the kernel table of the others is not touched
        return dequantize(*args)

    def failing_compile(fn, **kwargs):
        def kernel(*args):
            raise BackendCompilerFailed(fn, RuntimeError("no working C++ compiler found"), None)
        return kernel

    monkeypatch.setattr(torch, "compile", failing_compile)
    named = r"could not be compiled into one kernel \(RuntimeError: no working C\+\+ compiler found\); it runs eagerly"
    with pytest.warns(RuntimeWarning, match=named):
        assert torch.equal(fused_dequant.run_compiled(exact, values, scale, (32, 48), torch.bfloat16), expected)
    assert torch.equal(fused_dequant.run_compiled(exact, values, scale, (32, 48), torch.bfloat16), expected)
    fused_dequant._KERNELS.pop(exact)


def test_activations_quantize_in_1x128_blocks():
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)) * torch.tensor([1.0, 1e3, 1e-3])[:, None]
    x[1, 128:] = 0  # an all-zero block keeps zeros
    values, scale = quantize_activations(x)
    assert values.dtype == fp8.FP8 and scale.shape == (3, 2)
    blocks = values.float().view(3, 2, 128)
    assert torch.equal(blocks.abs().amax(-1)[[0, 0, 1, 2, 2], [0, 1, 0, 0, 1]], torch.full((5,), 448.0))
    back = (blocks * scale[..., None]).view(3, 256)
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-30).all()  # 3 mantissa bits: within half an ulp
    assert not back[1, 128:].any()


def test_the_block_scaled_recipe_equals_dequantise_then_matmul_to_the_activations_rounding():
    """``emulate_blockwise`` is what the GPU's block-scaled product computes. Activations already on the e4m3 grid of
    their blocks lose nothing (float32 rounding); Gaussian ones cost the e4m3 rounding of each activation: a relative
    error of about 2.6% on the outputs (bfloat16 operands cost 0.3%)."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(256, 512, generator=gen) / 512**0.5
    values, scale = quantize(weight, (128, 128))
    dense = dequantize(values, scale, (128, 128), torch.float32)  # [256, 512]
    x = torch.randn(4, 512, generator=gen)
    error = (emulate_blockwise(x, dense) - x @ dense.T).norm() / (x @ dense.T).norm()
    assert 1e-2 < error < 4e-2
    on_grid = (torch.randint(-448, 449, (4, 512), generator=gen).float().to(fp8.FP8).float()
               * 2.0 ** torch.randint(-8, 8, (4, 4, 1), generator=gen).repeat_interleave(128, -1).view(4, 512))
    torch.testing.assert_close(emulate_blockwise(on_grid, dense), on_grid @ dense.T, rtol=1e-5, atol=1e-4)


def test_block_scaled_products_need_hopper_and_cuda_12_9(monkeypatch):
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    assert blockwise_unsupported(0) == ""
    capability[0] = (10, 0)
    assert "compute capability 9.x (Hopper); this GPU is 10.0" in blockwise_unsupported(0)
    capability[0] = (9, 0)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert "CUDA >= 12.9" in blockwise_unsupported(0)
    monkeypatch.setattr(fp8_matmul, "_REFUSED", {0: "torch._scaled_mm refused it: CUBLAS_STATUS_NOT_SUPPORTED"})
    assert "NOT_SUPPORTED" in blockwise_unsupported(0)
    assert not fp8_matmul.blockwise_applies(torch.randn(1, 256), torch.empty(128, 256, dtype=fp8.FP8), (128, 128))


def _fp8_linear() -> FP8Linear:
    layer = FP8Linear(256, 128, (128, 128), dtype=torch.float32)
    layer.weight_fp8, layer.weight_scale_inv = quantize(torch.randn(128, 256) / 16, (128, 128))
    return layer


def test_fp8_linear_takes_the_block_scaled_product_where_it_applies(monkeypatch):
    """Where the GPU can (stood in for by the recipe's emulation) and ``fp8_products = True``, FP8Linear multiplies
    block-scaled; by default it dequantises, then multiplies."""
    layer, x = _fp8_linear(), torch.randn(2, 3, 256)
    assert FP8Linear.fp8_products is False and FP8RoutedExperts.fp8_products is False  # the lab's arithmetic is exact
    layer.fp8_products = True
    monkeypatch.setattr(fp8, "blockwise_applies", lambda *args: True)
    monkeypatch.setattr(fp8, "blockwise_linear", lambda x, w, s: emulate_blockwise(x, dequantize(w, s, (128, 128),
                                                                                                   torch.float32)))
    assert torch.equal(layer(x), emulate_blockwise(x, layer.weight))
    layer.fp8_products = False
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_a_refused_block_scaled_product_falls_back_with_the_reason(monkeypatch):
    layer, x = _fp8_linear(), torch.randn(2, 256)
    layer.fp8_products = True

    def refused(*args):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")

    monkeypatch.setattr(fp8_matmul, "_REFUSED", {})
    monkeypatch.setattr(fp8, "blockwise_applies", lambda *args: not fp8_matmul._REFUSED)
    monkeypatch.setattr(fp8, "blockwise_linear", refused)
    with pytest.warns(RuntimeWarning, match="take the dequantised path: torch._scaled_mm refused it: CUDA error"):
        out = layer(x)
    torch.testing.assert_close(out, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in fp8_matmul._REFUSED[0]
    torch.testing.assert_close(layer(x), out, rtol=0, atol=0)  # from now on without trying (no second warning)


def test_fp8_experts_run_one_at_a_time_multiply_as_the_linears_do(monkeypatch):
    """The experts' own products (what the grouped path runs for a prefill of FP8 experts): block-scaled where the
    GPU can (stood in for by the emulation), and otherwise each expert's dequantized weights."""
    experts = fp8.FP8RoutedExperts(TINY.replace(hidden_size=256, moe_intermediate_size=128), (128, 128),
                                   dtype=torch.float32)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for e in range(experts.num_experts):
            values, scale = quantize(torch.randn(getattr(experts, proj + "_fp8").shape[1:]) / 16, (128, 128))
            getattr(experts, proj + "_fp8")[e], getattr(experts, proj + "_scale_inv")[e] = values, scale
    h = torch.randn(5, 256)
    gate, *_ = experts.expert_linears(3)
    torch.testing.assert_close(gate(h), h @ experts.expert_weights(3)[0].T, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(fp8, "blockwise_applies", lambda *args: True)
    monkeypatch.setattr(fp8, "blockwise_linear", lambda x, w, s: emulate_blockwise(x, dequantize(w, s, (128, 128),
                                                                                                   torch.float32)))
    experts.fp8_products = True
    gate, *_ = experts.expert_linears(3)
    assert torch.equal(gate(h), emulate_blockwise(h, experts.expert_weights(3)[0]))


def test_the_block_scaled_operator_has_shapes_without_values():
    """A compiled graph sees the block-scaled product as one operator (its activation scales' layout is its own):
    traced on fake tensors, it gives [M, O] in the activations' dtype."""
    with FakeTensorMode():
        rows = torch.empty(3, 256, dtype=torch.bfloat16)
        out = fp8_matmul.blockwise_product(rows, torch.empty(384, 256, dtype=fp8.FP8), torch.empty(3, 2))
    assert out.shape == (3, 384) and out.dtype == torch.bfloat16

