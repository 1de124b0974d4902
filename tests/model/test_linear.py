"""k2lab.model.speed.linear: few-row products split one block of weight rows per thread (``threaded_linear``: the split
where ``split_pays``, else F.linear). CI runs at one thread, where the split never happens, so every test here sets two
threads itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_oracle import hf_model, relative_error, save_and_load
from tiny import TINY

from k2lab.model.speed.linear import SPLIT_MAX_ROWS, SPLIT_MIN_BLOCK, split_count
from k2lab.model.speed.linear import threaded_linear as linear


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _ran_batched(fn) -> bool:
    """Whether fn() ran a batched matmul (the split path) rather than F.linear's mm."""
    with torch.profiler.profile() as prof:
        fn()
    names = {event.key for event in prof.key_averages()}
    return "aten::bmm" in names


def _random(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("x_shape", [(1, 256), (1, 1, 256), (3, 256), (2, 8, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stacked", [False, True], ids=["own storage", "one of a stack"])
def test_few_rows_split_over_threads_and_equal_f_linear(two_threads, x_shape, dtype, stacked):
    x = _random(*x_shape, dtype=dtype)
    w = _random(3, 4096, 256, dtype=dtype, seed=1)[1] if stacked else _random(4096, 256, dtype=dtype, seed=1)
    assert _ran_batched(lambda: linear(x, w))
    out = linear(x, w)
    assert out.shape == (*x_shape[:-1], 4096) and out.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert relative_error(out, F.linear(x.double(), w.double())) < tolerance


@pytest.mark.parametrize("case", ["many rows", "odd rows of weight", "small weight", "transposed weight",
                                  "one thread"])
def test_other_products_go_to_f_linear_unchanged(two_threads, case):
    x, w = _random(1, 256), _random(4096, 256, seed=1)
    if case == "many rows":
        x = _random(SPLIT_MAX_ROWS + 1, 256)
    elif case == "odd rows of weight":
        w = _random(4095, 256, seed=1)
    elif case == "small weight":
        w = _random(2 * SPLIT_MIN_BLOCK // 256 - 2, 256, seed=1)
    elif case == "transposed weight":
        w = _random(256, 4096, seed=1).T
    else:
        torch.set_num_threads(1)
    assert not _ran_batched(lambda: linear(x, w))
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize(("out_features", "threads", "blocks"),
                         [(4096, 2, 2), (4096, 3, 2), (4096, 12, 8), (2048 * 3, 12, 12), (4095, 2, 1), (7, 6, 1)])
def test_split_count_is_the_most_equal_blocks_up_to_the_thread_count(out_features, threads, blocks):
    assert split_count(out_features, threads) == blocks


def test_a_thread_count_that_does_not_divide_the_rows_still_splits():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        x, w = _random(1, 256), _random(4096, 256, seed=1)  # 4096 rows: 2 blocks for 3 threads
        assert _ran_batched(lambda: linear(x, w))
        assert relative_error(linear(x, w), F.linear(x.double(), w.double())) < 1e-6
    finally:
        torch.set_num_threads(before)


def test_a_width_mismatch_is_named_as_f_linear_names_it(two_threads):
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        linear(_random(1, 255), _random(4096, 256, seed=1))


@pytest.mark.parametrize("stacked", [False, True], ids=["own storage", "one of a stack"])
def test_gradients_equal_f_linear(two_threads, stacked):
    """Also through a view of a stacked parameter (a routed expert's matrix), whose gradient lands in the stack."""
    x = _random(2, 256).requires_grad_()
    param = _random(3, 4096, 256, seed=1) if stacked else _random(4096, 256, seed=1)
    param.requires_grad_()
    grads = []
    for product in (linear, F.linear):
        x.grad = param.grad = None
        product(x, param[1] if stacked else param).pow(2).sum().backward()
        grads.append((x.grad, param.grad))
    (x_split, w_split), (x_ref, w_ref) = grads
    assert relative_error(x_split, x_ref) < 1e-5  # sums over 4,096 outputs
    assert relative_error(w_split, w_ref) < 1e-5


def test_decode_at_two_threads_matches_hf(two_threads, tmp_path):
    """TINY's head (8192 x 256) splits at two threads: decode steps through the cache still give
    HF's logits (HF's DeepseekV3 run at the same two threads, over the whole sequence at once)."""
    ref = hf_model(TINY, seed=5)
    ours = save_and_load(ref, tmp_path)
    ids = torch.randint(0, TINY.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits[:, 8:]  # [1, 4, V]
        cache = ours.new_cache(1)
        ours(ids[:, :8], cache=cache)
        assert _ran_batched(lambda: ours(ids[:, 8:9], cache=cache))
        cache.crop(8)
        steps = [ours(ids[:, t : t + 1], cache=cache) for t in range(8, 12)]
    assert relative_error(torch.cat(steps, dim=1), expected) < 1e-5


def test_a_compiled_caller_traces_linear_as_one_graph(two_threads):
    """Under torch.compile the thread count is read once while tracing (``thread_count``), so a compiled training step
    keeps each projection inside its graph instead of breaking it at every one."""
    import torch._dynamo

    weight = _random(128, 64)
    explained = torch._dynamo.explain(lambda t: linear(t, weight).relu())(_random(4, 64, seed=1))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_compiled_few_row_products_split_and_recompile_when_the_threads_change(two_threads):
    """A compiled decode step keeps the split (its product is a bmm over the blocks inside the graph); the thread
    count is guarded, so the same compiled function run at one thread is traced again, unsplit, and both give
    F.linear's result."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    weight = _random(4096, 256, seed=1)
    backend = CompileCounterWithBackend("eager")
    product = torch.compile(lambda t: linear(t, weight), backend=backend)
    x = _random(1, 256)
    at_two = product(x)
    assert backend.frame_count == 1
    assert "torch.bmm" in str(backend.graphs[0].code)
    torch.set_num_threads(1)
    at_one = product(x)
    assert backend.frame_count == 2
    assert "bmm" not in str(backend.graphs[1].code)
    for out in (at_two, at_one):
        assert relative_error(out, F.linear(x.double(), weight.double())) < 1e-6
