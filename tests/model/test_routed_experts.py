"""RoutedExperts' dispatch: experts run in pairs of similar load as one batched product over a strided view of the
stacks, rows padded to the pair's larger load. Checked against each slot run through its expert on its own, in
float64, and at one thread and two (a batched product splits its pair over threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_oracle import relative_error
from tiny import TINY

from k2lab.model.moe import RoutedExperts, StackSlices, group_span

E = TINY.n_routed_experts


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _experts(seed: int = 0) -> RoutedExperts:
    experts = RoutedExperts(TINY)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return experts


def _route(tokens: int, k: int, seed: int = 1) -> torch.Tensor:
    """[tokens, k] distinct experts per token, drawn with skewed odds so that loads are uneven and some experts
    get no token."""
    odds = torch.linspace(1, 12, E) ** 2
    odds[E // 2] = 0  # never chosen
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(odds, k, generator=gen) for _ in range(tokens)])


def _each_slot_alone(experts: RoutedExperts, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[N, k, D]: slot (t, j) is token t through expert idx[t, j], one row at a time, in float64."""
    gate, up, down = (w.double() for w in (experts.gate_proj, experts.up_proj, experts.down_proj))
    rows = [[F.silu(gate[e] @ x[t].double()) * (up[e] @ x[t].double()) @ down[e].T for e in route.tolist()]
            for t, route in enumerate(idx)]
    return torch.stack([torch.stack(row) for row in rows])


def _count_pairs(experts: RoutedExperts) -> list[tuple[int, ...]]:
    calls = []
    group_weights = experts.group_weights

    def counting(groups):
        calls.extend(group for group in groups if len(group) == 2)
        return group_weights(groups)

    experts.group_weights = counting
    return calls


@pytest.mark.parametrize(("tokens", "k"), [(1, 4), (1, 3), (2, 4), (37, 4), (37, 3)])
@pytest.mark.parametrize("in_pairs", [True, False], ids=["in pairs", "one at a time"])
def test_dispatch_equals_each_slot_through_its_expert(threads, tokens, k, in_pairs):
    experts = _experts()
    experts.pairs_in_place = in_pairs  # False: as streamed and quantized experts run
    x = torch.randn(tokens, TINY.hidden_size, generator=torch.Generator().manual_seed(2))
    idx = _route(tokens, k)
    pairs = _count_pairs(experts)
    with torch.no_grad():
        out = experts(x, idx)
    assert out.shape == (tokens, k, TINY.hidden_size)
    assert relative_error(out, _each_slot_alone(experts, x, idx)) < 1e-6
    chosen = idx.unique().numel()
    assert len(pairs) == (chosen // 2 if in_pairs else 0) and all(first < second for first, second in pairs)


def test_gradients_equal_each_slot_through_its_expert(threads):
    experts = _experts()
    x = torch.randn(37, TINY.hidden_size, generator=torch.Generator().manual_seed(2), requires_grad=True)
    idx = _route(37, 4)
    upstream = torch.randn(37, 4, TINY.hidden_size, generator=torch.Generator().manual_seed(3))
    (experts(x, idx) * upstream).sum().backward()
    ours = [x.grad] + [p.grad for p in (experts.gate_proj, experts.up_proj, experts.down_proj)]

    reference = _experts()
    x64 = x.detach().double().requires_grad_()
    (_each_slot_alone(reference, x64, idx) * upstream.double()).sum().backward()
    expected = [x64.grad] + [p.grad for p in (reference.gate_proj, reference.up_proj, reference.down_proj)]
    for name, got, want in zip(("x", "gate_proj", "up_proj", "down_proj"), ours, expected, strict=True):
        assert relative_error(got, want) < 1e-6, name
    unchosen = E // 2
    assert experts.gate_proj.grad[unchosen].abs().max() == 0  # no gradient reaches an expert that no token chose


def test_groups_pair_experts_of_similar_load_in_id_order():
    counts = [5, 0, 1, 9, 2, 8, 0, 3, 4] + [0] * (E - 9)
    experts = _experts()
    # By load: expert 2 (1), 4 (2), 7 (3), 8 (4), 0 (5), 5 (8), 3 (9): pairs of neighbours, the last one alone.
    assert experts.groups(counts) == [(2, 4), (7, 8), (0, 5), (3,)]
    experts.pairs_in_place = False
    assert experts.groups(counts) == [(0,), (2,), (3,), (4,), (5,), (7,), (8,)]


def test_group_weights_are_views_of_the_stacks():
    experts = _experts()
    (gate, up, down), (single_gate, _, single_down) = experts.group_weights([(3, 11), (5,)])
    assert gate.data_ptr() == experts.gate_proj[3].data_ptr() and torch.equal(gate[1], experts.gate_proj[11])
    assert torch.equal(up, experts.up_proj[[3, 11]]) and torch.equal(down, experts.down_proj[[3, 11]])
    assert single_gate.shape == (1, *experts.gate_proj.shape[1:]) and torch.equal(single_down[0], experts.down_proj[5])
    assert single_gate.data_ptr() == experts.gate_proj[5].data_ptr()


def test_stack_slices_backward_equals_slicing_and_is_one_node_per_stack():
    """StackSlices' backward writes all groups' gradients into one stack-sized tensor: the gradient plain slices
    give, a group whose output reaches no loss included, from one autograd node instead of one per group."""
    gen = torch.Generator().manual_seed(5)
    groups = [(1, 6), (0, 3), (2, 7), (4,), (5,)]  # strides 5, 3, 5 and two singles; group (5,) reaches no loss
    weights = [torch.randn(len(g), 3, 4, generator=gen) for g in groups]
    stack = torch.randn(8, 3, 4, generator=gen, requires_grad=True)
    views = StackSlices.apply(stack, groups)
    sum((v * w).sum() for v, w in zip(views[:-1], weights, strict=False)).backward()
    plain = stack.detach().clone().requires_grad_()
    sum((plain[group_span(g)] * w).sum() for g, w in zip(groups[:-1], weights, strict=False)).backward()
    assert torch.equal(stack.grad, plain.grad) and stack.grad[5].abs().max() == 0

    x = torch.randn(37, TINY.hidden_size, generator=gen, requires_grad=True)
    out = _experts()(x, _route(37, 4))
    nodes, frontier = set(), [out.grad_fn]
    while frontier:  # every node of the backward graph
        node = frontier.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            frontier.extend(next_node for next_node, _ in node.next_functions)
    names = [type(node).__name__ for node in nodes]
    assert names.count("StackSlicesBackward") == 3  # gate, up, down: one node each, whatever the number of groups
    assert not any(name.startswith("SliceBackward") for name in names)


def test_stack_slices_run_only_where_a_gradient_may_flow_into_the_stacks(monkeypatch):
    """Without a gradient to route into the stacks (no_grad, or the stacks frozen), the groups read plain views and
    skip the autograd Function: the same outputs bit for bit, and the input's gradient unchanged."""
    calls = []
    forward = StackSlices.forward
    monkeypatch.setattr(StackSlices, "forward", staticmethod(lambda ctx, *a: calls.append(1) or forward(ctx, *a)))
    experts, idx = _experts(), _route(11, 4)
    x = torch.randn(11, TINY.hidden_size, generator=torch.Generator().manual_seed(3), requires_grad=True)
    trained = experts(x, idx)
    (x_grad,) = torch.autograd.grad(trained.square().sum(), x)
    assert len(calls) == 3  # gate, up, down
    with torch.no_grad():
        assert torch.equal(experts(x, idx), trained)
    experts.requires_grad_(False)
    frozen = experts(x, idx)
    assert torch.equal(frozen, trained)
    assert torch.equal(torch.autograd.grad(frozen.square().sum(), x)[0], x_grad)
    assert len(calls) == 3  # neither call went through StackSlices
