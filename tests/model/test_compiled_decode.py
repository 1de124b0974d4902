"""The compiled decode step (``generate(compile=True)``, or ``torch.compile(model, dynamic=True)`` over a cache with
reserved storage): one graph for every cache length, with no graph break; HF's logits; eager generation's tokens;
and eager generation, after a warning, where hooks could not run. Each compile of the tiny model costs CI tens of
seconds, so the graphs are shared: every single-row step below reuses the first one."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_model, relative_error, save_and_load
from tiny import TINY, random_model, token_ids
from torch._dynamo.utils import counters

import k2lab


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """HF's DeepseekV3 and k2lab's model on the same weights; dynamo's caches and counters start empty."""
    torch._dynamo.reset()
    counters.clear()
    ref = hf_model(TINY, seed=11)
    return ref, save_and_load(ref, tmp_path_factory.mktemp("compiled"))


def graphs() -> tuple[int, int]:
    """(graphs compiled, graph breaks) since the fixture reset dynamo."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.slow  # compiles
@torch.no_grad()  # as generate runs its steps: a graph is guarded on the grad mode
def test_compiled_decode_steps_give_hf_logits_from_one_graph(pair):
    """Eight tokens of prefill (eager), then four compiled steps at growing cache lengths: HF's logits over the whole
    sequence, from one graph compiled once, without a break."""
    ref, ours = pair
    ids = token_ids(TINY, batch=1, length=12, seed=4)
    expected = ref(ids).logits[:, 8:]  # [1, 4, V]
    cache = ours.new_cache(1, capacity=12)
    ours(ids[:, :8], cache=cache)
    compiled = torch.compile(ours, dynamic=True)
    # Called as generate calls it (a [1, 1] token of its own, no view of a 12-token row whose size dynamo would tie to
    # the cache's capacity of 12; the same keywords), so that generate's steps find this graph.
    steps = [compiled(ids[0, t].view(1, 1).clone(), cache=cache, attn_impl="auto", attention_mask=None)
             for t in range(8, 12)]
    assert cache.length == 12
    assert relative_error(torch.cat(steps, dim=1), expected) < 1e-5
    assert graphs() == (1, 0)


@pytest.mark.slow  # compiles
def test_generate_compiled_gives_eager_tokens_and_reuses_the_graph(pair):
    _, ours = pair
    ids = token_ids(TINY, batch=1, length=9, seed=5)
    before = graphs()
    compiled = k2lab.generate(ours, ids, 6, compile=True)
    assert torch.equal(compiled, k2lab.generate(ours, ids, 6))
    assert not compiled.is_inference()
    assert graphs() == before  # the same shapes as the steps above: nothing compiled again


@pytest.mark.slow  # compiles
def test_generate_compiled_on_a_padded_batch_gives_eager_tokens(pair):
    """Two rows, one left-padded: the cache's pad mask enters the compiled graph (a second graph, for two rows)."""
    _, ours = pair
    ids = token_ids(TINY, batch=2, length=9, seed=6)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    eager = k2lab.generate(ours, ids, 5, attention_mask=mask)
    assert torch.equal(k2lab.generate(ours, ids, 5, attention_mask=mask, compile=True), eager)
    assert graphs()[1] == 0


@pytest.mark.parametrize("attn_impl", ["absorbed", "naive"])
def test_every_decode_path_traces_as_one_graph_for_all_cache_lengths(attn_impl):
    """Traced only (dynamo with the eager backend, no inductor: seconds, not a compile): a decode step of either
    attention path is one graph without a break, reused as the cache grows, and gives the eager model's logits."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = random_model(TINY, seed=2)
    ids = token_ids(TINY, batch=1, length=10, seed=7)
    backend = CompileCounterWithBackend("eager")
    traced = torch.compile(model, dynamic=True, backend=backend)
    breaks = sum(counters["graph_break"].values())
    caches = [model.new_cache(1, capacity=10) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model(ids[:, :6], cache=cache)
        for t in range(6, 10):
            step = ids[0, t].view(1, 1)
            expected = model(step, cache=caches[0], attn_impl=attn_impl)
            got = traced(step, cache=caches[1], attn_impl=attn_impl)
            assert relative_error(got, expected) < 1e-5
    assert backend.frame_count == 1
    assert sum(counters["graph_break"].values()) == breaks


def test_compile_runs_an_observed_model_eagerly_and_refuses_bad_values():
    """Hooks cannot run inside a compiled graph: an observed model generates eagerly (its hooks fire), after a warning
    that says why."""
    model = random_model(TINY, seed=2)
    ids = token_ids(TINY, batch=1, length=4)
    fired = []
    with model.hooks(fwd_hooks=[("hook_resid_post", lambda t, hook: fired.append(hook.name))]):
        with pytest.warns(UserWarning, match="runs eagerly: something observes this model"):
            tokens = k2lab.generate(model, ids, 2, compile=True)
    assert fired and torch.equal(tokens, k2lab.generate(model, ids, 2))
    handle = model.layers[0].mlp.register_forward_hook(lambda *args: None)
    with pytest.warns(UserWarning, match="model.is_observed"):
        k2lab.generate(model, ids, 2, compile=True)
    handle.remove()
    with pytest.raises(ValueError, match="compile must be True or False"):
        k2lab.generate(model, ids, 2, compile="yes")
    with pytest.raises(ValueError, match="compiles a K2Model's decode step"):
        k2lab.generate(torch.nn.Identity(), ids, 2, compile=True)


def test_a_cache_reserves_its_capacity_and_names_a_bad_one():
    model = random_model(TINY, seed=2)
    cache = model.new_cache(1, capacity=10)
    storage = [buf.data_ptr() for buf in cache._buffers]
    with torch.no_grad():
        model(token_ids(TINY, batch=1, length=6), cache=cache)
        for t in range(4):
            model(token_ids(TINY, batch=1, length=1, seed=t), cache=cache)
    assert cache.length == 10
    assert [buf.data_ptr() for buf in cache._buffers] == storage  # written in place, never grown
    assert model.new_cache(1, capacity=10**9)._buffers[0].shape[1] == TINY.max_position_embeddings
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="capacity must be a whole number"):
            model.new_cache(1, capacity=bad)
