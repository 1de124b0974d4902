"""The benchmarks' measuring sticks measure what they claim: the eager-floor step computes the model's decode step,
and a kernel replay re-issues exactly the recorded kernels."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from tiny import GROUPED, TINY, blocks_modes, random_model, token_ids

from benchmarks.eager_floor import check_supported, minimal_decode_step
from benchmarks.replay import heavy_kernels


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, seed=3)  # randomize spreads the router weights: the chosen experts vary per token


@torch.no_grad()
def test_the_eager_floor_step_gives_the_models_decode_logits_and_leaves_the_cache_alone(model):
    check_supported(model)
    prompt = token_ids(TINY, batch=1, length=12)
    cache = model.new_cache(1)
    model(prompt, cache=cache)
    for token in (5, 77, 300):
        floor = minimal_decode_step(model, cache, token)  # [1, V]
        assert cache.length == 12  # written after the context, not advanced
        expected = model(torch.tensor([[token]]), cache=cache)[0]
        cache.crop(12)
        assert (floor - expected).abs().max() < 1e-4 * expected.abs().max()


def test_the_eager_floor_names_what_it_does_not_handle(model):
    with pytest.raises(ValueError, match="float32 weights.*one expert group"):
        check_supported(random_model(GROUPED).to(torch.bfloat16))


def test_a_replay_reissues_the_recorded_kernels_on_the_same_inputs_and_nothing_else():
    a, b, v = torch.randn(3, 4), torch.randn(4, 5), torch.randn(2, 3, 4)
    seen = []

    def call():
        seen.append(1)  # Python around the kernels does not run again
        return (a @ b + 1).relu(), torch.bmm(v, v.transpose(1, 2))

    replay, count = heavy_kernels(call)
    assert count == 2 and seen == [1]
    product, batched = replay()
    assert seen == [1]
    torch.testing.assert_close(product, a @ b)  # the bare product: the addition and relu are not replayed
    torch.testing.assert_close(batched, torch.bmm(v, v.transpose(1, 2)))


def test_a_replay_and_an_op_count_see_the_same_kernels_in_inference_mode_as_under_no_grad():
    """Inference mode hands composite ops (linear, matmul, attention) to a dispatch mode whole, where no_grad has split
    them into the kernels they run; the model's plain calls run in inference mode, so replay and op_cost split them."""
    from benchmarks.op_cost import op_counts

    x, w, q = torch.randn(2, 8), torch.randn(4, 8), torch.randn(1, 2, 4, 8)

    def call():
        return F.linear(x, w), torch.matmul(x, w.T), F.scaled_dot_product_attention(q, q, q)

    seen = []
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            _, count = heavy_kernels(call)
            seen.append((count, op_counts(call)))
    assert seen[0] == seen[1]
    assert seen[0][0] == 3 and seen[0][1]["mm"] == 2 and seen[0][1]["_scaled_dot_product_flash_attention_for_cpu"] == 1


def test_a_replay_of_a_call_without_kernels_is_refused():
    with pytest.raises(ValueError, match="no matrix product"):
        heavy_kernels(lambda: torch.ones(3) * 2)


@torch.no_grad()
def test_split_gemv_times_the_step_with_and_without_splitting(model, monkeypatch):
    """benchmarks.split_gemv's two contenders differ in exactly the one thing: with its threshold out of reach the
    model's few-row products all run as F.linear's mm; as shipped, at two threads, four of them are split instead:
    TINY's head (8192 x 256) and the dense block's three projections (768 x 256 or 256 x 768, two blocks of 98,304
    weights each, above SPLIT_MIN_BLOCK); the attention's matrices stay whole, and the experts run in pairs as batched
    products either way."""
    from benchmarks.split_gemv import decode_step
    from k2lab.model import linear as linear_module

    monkeypatch.setattr(linear_module, "SPLIT_MIN_BLOCK", linear_module.SPLIT_MIN_BLOCK)  # restored afterwards
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        counts = {}
        for which, block in (("F.linear", 1 << 62), ("linear", linear_module.SPLIT_MIN_BLOCK)):
            step = decode_step(model, 12, block)
            with torch.profiler.profile() as prof:
                step()
            counts[which] = sum(e.count for e in prof.key_averages() if e.key == "aten::mm")
    finally:
        torch.set_num_threads(before)
    assert counts["F.linear"] == counts["linear"] + 4


@torch.no_grad()
def test_moe_dispatch_times_pairs_against_the_same_experts_one_by_one(model):
    """benchmarks.moe_dispatch's "expert pairs" contenders differ in exactly the pairing: the same weights, the same
    results, one batched product per pair (and per odd one out) against one product per expert."""
    from benchmarks.moe_dispatch import one_by_one

    experts = model.layers[1].mlp.experts
    single = one_by_one(experts)
    x = torch.randn(40, TINY.hidden_size, generator=torch.Generator().manual_seed(0))
    idx = model.layers[1].mlp.gate(x[None])[0][0]  # [40, k] the model's own routing
    runs = {}
    for name, contender in (("pairs", experts), ("one by one", single)):
        with torch.profiler.profile() as prof:
            runs[name] = contender(x, idx)
        runs[name + " bmm"] = sum(e.count for e in prof.key_averages() if e.key == "aten::bmm")
    chosen = idx.unique().numel()
    assert runs["pairs bmm"] == 3 * ((chosen + 1) // 2) and runs["one by one bmm"] == 0  # an odd one: a batch of 1
    torch.testing.assert_close(runs["pairs"], runs["one by one"], rtol=1e-5, atol=1e-6)
    assert single.gate_proj is experts.gate_proj


def test_generate_mode_times_the_same_calls_in_inference_mode_and_under_no_grad(model):
    """benchmarks.generate_mode's contenders differ in exactly the mode the model's blocks run in: the same tokens, the
    same decode step at a cached context (each leaves its cache where it was), and the same prefill."""
    from benchmarks.generate_mode import checked, decode_steps, generate_calls, prefills

    runs = generate_calls(model, 3)
    steps, prompts = checked(decode_steps(model, 20)), checked(prefills(model, 9))
    modes = []  # whether the blocks ran in inference mode, forward by forward, over all the calls in turn

    def results(calls):
        out = {}
        for name, run in calls.items():
            out[name], seen = blocks_modes(run)
            modes.extend(seen)
        return out

    tokens, logits, prefilled = results(runs), results(steps), results(prompts)
    # generate: 3 forwards each way; the step: as generate runs it, as a plain no_grad call, observed; the prefill:
    # plain, observed.
    assert modes == [True] * 3 + [False] * 3 + [True, True, False] + [True, False]
    assert torch.equal(tokens["inference mode"], tokens["no_grad"])
    for name in ("inference mode", "plain call"):
        torch.testing.assert_close(logits[name], logits["no_grad"], rtol=0, atol=0)
    torch.testing.assert_close(prefilled["plain call"], prefilled["no_grad"], rtol=0, atol=0)
    assert not model.is_observed()  # the no_grad contenders' probe is gone after their calls


def test_moe_dispatch_training_contenders_differ_only_in_how_the_stacks_gradients_are_built(model):
    """benchmarks.moe_dispatch's "pairs, training": the same gradients, from plain slices (one autograd node per group
    and stack) against StackSlices (one per stack)."""
    from benchmarks.moe_dispatch import forward_backward, sliced_per_group

    experts = model.layers[1].mlp.experts
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, TINY.hidden_size, generator=gen)
    idx = model.layers[1].mlp.gate(x[None])[0][0]  # [40, k]
    upstream = torch.randn(40, idx.shape[1], TINY.hidden_size, generator=gen)
    plain = sliced_per_group(experts)
    assert torch.equal(forward_backward(plain, x, idx, upstream)(), forward_backward(experts, x, idx, upstream)())
    with torch.enable_grad():
        views = [*plain.group_weights([(0, 3)])[0], *experts.group_weights([(0, 3)])[0]]
        names = {type(w.grad_fn).__name__ for w in views}
    assert names == {"SliceBackward0", "StackSlicesBackward"}
    assert all(p.grad is None for p in experts.parameters())  # each run clears what it computed


def bmm_operands(run) -> set[tuple]:
    """(shape, innermost two strides) of both operands of every bmm ``run`` issues."""
    from benchmarks.replay import AtenOps

    seen = set()

    class Record(AtenOps):
        def seen(self, func, args: tuple, kwargs: dict) -> None:
            if func is torch.ops.aten.bmm.default:
                seen.add(tuple((tuple(a.shape), a.stride()[-2:]) for a in args))

    with Record():
        run()
    return seen


@torch.no_grad()
def test_cache_passes_times_the_two_products_the_absorbed_step_issues_over_the_cache(model):
    """benchmarks.cache_passes times, per layer, the absorbed decode step's score and value products over the cache:
    the same shapes and the same memory layout (cache rows read in place, queries transposed), and nothing else."""
    from benchmarks.cache_passes import cache_passes
    from benchmarks.timing import decode_step

    context = 20
    passes, flops = cache_passes(TINY, context, TINY.num_attention_heads)
    timed = bmm_operands(passes)
    width = TINY.kv_lora_rank + TINY.qk_rope_head_dim
    assert len(timed) == 2 and flops == 2 * TINY.num_attention_heads * context * (width + TINY.kv_lora_rank) * (
        TINY.num_hidden_layers)
    step = decode_step(model, context - 1)  # its token's own row makes context rows
    assert timed <= bmm_operands(step)  # the step also issues the two absorptions through W_UK and W_UV


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6])
def test_alternate_threads_lets_every_run_follow_every_other_equally_often(count):
    """The contenders' order changes from round to round so that none always inherits the same neighbour's freed
    memory and caches: over one cycle of the design (count rounds, twice that for an odd count) each run follows
    each other run equally often, and every run is called once per round."""
    from benchmarks.timing import alternate_threads

    names = [f"run{i}" for i in range(count)]
    calls = []
    cycle = count if count % 2 == 0 else 2 * count
    medians = alternate_threads({name: lambda name=name: calls.append(name) for name in names}, [1],
                                rounds=cycle - 1, warmup=1)
    assert set(medians) == {(name, 1) for name in names} and len(calls) == count * cycle
    rounds = [calls[i : i + count] for i in range(0, len(calls), count)]
    assert all(sorted(order) == names for order in rounds)
    follows = Counter(pair for order in rounds for pair in itertools.pairwise(order))
    assert len(follows) == count * (count - 1) and len(set(follows.values())) == 1


def test_op_cost_counts_every_dispatch_and_sets_the_products_apart():
    """benchmarks.op_cost: a step's ops counted with a dispatch mode, views included; products with a weight apart."""
    from benchmarks.op_cost import op_counts, small_ops

    a, b = torch.randn(4, 8), torch.randn(8, 3)
    counts = op_counts(lambda: (torch.bmm(a[None], b[None]).view(4, 3) @ b.T + 1).sum())
    assert counts["bmm"] == 1 and counts["mm"] == 1 and counts["view"] >= 1 and counts["add"] == 1
    assert small_ops(counts) == sum(counts.values()) - 2


def test_op_cost_shrinks_every_width_and_keeps_the_ops():
    """The shrunk model has every width divided by the factor and the same layers, experts and top-k, so its floor
    step runs the same code path."""
    from benchmarks.op_cost import shrunk
    from benchmarks.vs_hf import BENCH

    small = shrunk(BENCH, 8)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert getattr(small, field) * 8 == getattr(BENCH, field), field
    for field in ("num_hidden_layers", "num_attention_heads", "n_routed_experts", "num_experts_per_tok",
                  "first_k_dense_replace", "n_shared_experts"):
        assert getattr(small, field) == getattr(BENCH, field), field
