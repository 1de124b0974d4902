"""The compiled decode step of models held quantized (FP8-resident, INT4-resident): a plain call
``model(next_ids, cache=cache)`` after a prefill compiles with ``fullgraph=True`` (no graph break, so nothing inside
reads a value back to the host) and gives the eager step's logits; ``generate(compile=True)`` gives eager generation's
tokens. Also the speed rooms this rests on, on the CPU: the experts read by index (quantized), the GPU's sync-free
grouped experts (``sorted_experts``), and the static step a CUDA graph replays (``static_decode_step``)."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import relative_error
from tiny import TINY, random_model, token_ids
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import k2lab
from k2lab.model.speed import grouped_experts
from k2lab.model.speed.grouped_experts import grouped_mm_runs, sorted_experts
from k2lab.model.speed.indexed_experts import indexed_experts
from k2lab.model.speed.static_decode import StaticCache, static_decode_step
from k2lab.weights.quant.fp8 import FP8Format
from k2lab.weights.writer import save_checkpoint

# One dense block and one MoE block: what a compile must get through, at half TINY's compile time.
SMALL = TINY.replace(num_hidden_layers=2)
FORMATS = {"fp8": FP8Format(block=(32, 32)), "int4": "int4"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    """A checkpoint of the same random SMALL model in each format; dynamo's caches start empty (the graphs other test
    modules compiled would count towards the recompile limit)."""
    torch._dynamo.reset()
    model = random_model(SMALL, seed=5)
    return {name: save_checkpoint(model, tmp_path_factory.mktemp(name), format=fmt) for name, fmt in FORMATS.items()}


def resident(folders, name: str, **kwargs) -> k2lab.K2Model:
    """The checkpoint in format ``name`` loaded with its matrices held as stored, float32 elsewhere."""
    return k2lab.load(folders[name], dtype=torch.float32, quantized_resident=True, **kwargs).eval()


def breaks() -> int:
    return sum(counters["graph_break"].values())


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_quantized_decode_step_traces_as_one_graph_for_every_cache_length(folders, name):
    """Traced only (dynamo with the eager backend: seconds): the plain call ``model(next_ids, cache=cache)`` after a
    prefill is one graph under ``fullgraph=True``, reused as the cache grows, with the eager step's logits."""
    model = resident(folders, name)
    experts = model.layers[1].mlp.experts
    assert experts.stacks is None and experts.indexable  # held quantized: read by index, not as stacks
    ids = token_ids(SMALL, batch=1, length=10, seed=3)
    backend = CompileCounterWithBackend("eager")
    traced = torch.compile(model, dynamic=True, fullgraph=True, backend=backend)
    before = breaks()
    caches = [model.new_cache(1, capacity=10) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model(ids[:, :6], cache=cache)
        for t in range(6, 10):
            next_ids = ids[0, t].view(1, 1)
            expected = model(next_ids, cache=caches[0])
            assert relative_error(traced(next_ids, cache=caches[1]), expected) < 1e-5
    assert backend.frame_count == 1 and breaks() == before


@pytest.mark.slow  # compiles with inductor
@pytest.mark.parametrize("name", list(FORMATS))
def test_generate_compiled_on_a_quantized_model_gives_eager_tokens(folders, name):
    model = resident(folders, name)
    ids = token_ids(SMALL, batch=1, length=7, seed=4)
    compiled = k2lab.generate(model, ids, 5, compile=True)
    assert torch.equal(compiled, k2lab.generate(model, ids, 5))


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_experts_read_by_index_equal_the_loop(folders, name):
    """What a GPU runs eagerly for a decode step of quantized experts, and the products inside a compiled step: the
    chosen matrices gathered by the routing tensor and dequantized, against each expert's ``expert_weights``."""
    experts = resident(folders, name).layers[1].mlp.experts
    x = torch.randn(2, 1, SMALL.hidden_size, generator=torch.Generator().manual_seed(0))
    idx = torch.stack([torch.randperm(SMALL.n_routed_experts)[: SMALL.num_experts_per_tok] for _ in range(2)])[:, None]
    expected = torch.empty(2, 1, SMALL.num_experts_per_tok, SMALL.hidden_size)
    for b in range(2):
        for s, e in enumerate(idx[b, 0].tolist()):
            gate, up, down = experts.expert_weights(e)
            expected[b, 0, s] = torch.nn.functional.silu(x[b, 0] @ gate.T) * (x[b, 0] @ up.T) @ down.T
    assert relative_error(indexed_experts(experts, x, idx), expected) < 1e-5
    compiled = torch.compile(indexed_experts, fullgraph=True, backend="eager")  # the multiply-and-sum form
    assert relative_error(compiled(experts, x, idx), expected) < 1e-5


def test_streamed_experts_generate_eagerly_with_the_reason(folders):
    model = k2lab.load(folders["fp8"], dtype=torch.float32, expert_budget_bytes=2**20)
    ids = token_ids(SMALL, batch=1, length=5, seed=6)
    with pytest.warns(UserWarning, match="runs eagerly: layer 1.s routed experts .*streamed"):
        tokens = k2lab.generate(model, ids, 3, compile=True)
    assert torch.equal(tokens, k2lab.generate(model, ids, 3))


@pytest.mark.parametrize("tokens", [1, 12])
def test_sorted_experts_compile_whole_and_equal_the_loop(tokens):
    """The GPU's grouped experts (bfloat16 stacks, offsets computed on the device): one graph under fullgraph=True on
    the CPU, since nothing is read back, and the reference loop's outputs to bfloat16 rounding."""
    moe = random_model(SMALL, seed=1).layers[1].mlp.to(torch.bfloat16)
    x = torch.randn(2, tokens, SMALL.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        idx, _ = moe.gate(x)
        expected = torch.zeros(2, tokens, idx.shape[-1], SMALL.hidden_size)
        for e in idx.unique().tolist():
            b, t, s = torch.where(idx == e)
            gate, up, down = (w.float() for w in moe.experts.expert_weights(e))
            h = x[b, t].float()
            expected[b, t, s] = torch.nn.functional.silu(h @ gate.T) * (h @ up.T) @ down.T
        backend = CompileCounterWithBackend("eager")
        got = torch.compile(sorted_experts, fullgraph=True, backend=backend)(moe.experts, x, idx)
    assert backend.frame_count == 1
    assert relative_error(got.float(), expected) < 2e-2  # bfloat16 products against float32 ones


def test_the_grouped_kernel_is_chosen_on_hopper_in_bfloat16_only(monkeypatch):
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    cuda = torch.device("cuda", 0)
    assert grouped_mm_runs(cuda, torch.bfloat16)
    assert not grouped_mm_runs(cuda, torch.float32)  # torch's fallback loop reads the offsets back
    assert not grouped_mm_runs(torch.device("cpu"), torch.bfloat16)
    capability[0] = (8, 0)
    assert not grouped_mm_runs(cuda, torch.bfloat16)
    assert grouped_experts.paired_experts is not None  # the CPU's path is still there


@pytest.mark.parametrize("attn_impl", ["absorbed", "naive"])
def test_the_static_step_gives_the_plain_step_on_a_padded_batch(attn_impl):
    """The step a CUDA graph replays (attention over the whole reserved storage, positions and write slot on the
    device) gives the plain step's logits; traced, one graph serves every step."""
    model = random_model(TINY, seed=2)
    ids = token_ids(TINY, batch=2, length=10, seed=7)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :3] = False  # row 1 left-padded
    caches = [model.new_cache(2, capacity=12) for _ in range(2)]
    backend = CompileCounterWithBackend("eager")
    step = torch.compile(static_decode_step, fullgraph=True, backend=backend)
    with torch.inference_mode():
        for cache in caches:
            model(ids[:, :6], cache=cache, attention_mask=mask[:, :6])
        static = StaticCache(model, caches[1])
        for t in range(6, 10):
            expected = model(ids[:, t : t + 1], cache=caches[0], attn_impl=attn_impl)
            assert relative_error(step(model, ids[:, t : t + 1], static, attn_impl), expected) < 1e-5
    assert backend.frame_count == 1
    assert static.slot.item() == 10 and static.positions.tolist() == [10, 7]
    with pytest.raises(ValueError, match="one token per row"):
        static.append(0, torch.zeros(2, 2, static.buffers[0].shape[-1]))


def test_a_step_past_the_recompile_limit_runs_eagerly_with_the_reason():
    """``fullgraph=True`` turns torch.compile's recompile limit (8 graphs of one function by default) into an error;
    generate then finishes eagerly, after a warning that says why."""
    model = random_model(SMALL, seed=3)
    ids = token_ids(SMALL, batch=1, length=5, seed=8)
    named = r"runs eagerly from here: torch.compile has compiled .*recompile_limit \(0\)"
    with torch._dynamo.config.patch(recompile_limit=0), pytest.warns(UserWarning, match=named):
        tokens = k2lab.generate(model, ids, 3, compile=True)
    assert torch.equal(tokens, k2lab.generate(model, ids, 3))

