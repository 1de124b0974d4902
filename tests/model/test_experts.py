"""The routed experts, three ways: MoE's reference loop, the grouped dispatch (model/speed/grouped_experts.py: tokens
sorted by expert, experts of similar load in pairs of batched products over strided views of the stacks) and the experts
read by index (model/speed/indexed_experts.py); and the one rule that chooses among them (choose_experts). Each is
checked against every slot run through its expert on its own in float64, at one thread and two (a batched product splits
its pair over threads), and so are their gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_oracle import relative_error
from tiny import TINY, UnstackedExperts, backward_node_names

from k2lab.model.moe import DECODE_BATCH, MoE, RoutedExperts, choose_experts
from k2lab.model.speed.grouped_experts import StackSlices, expert_groups, group_span, paired_experts
from k2lab.model.speed.indexed_experts import indexed_experts

E, D = TINY.n_routed_experts, TINY.hidden_size


def _experts(seed: int = 0) -> RoutedExperts:
    experts = RoutedExperts(TINY)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return experts


def _route(tokens: int, k: int, seed: int = 1) -> torch.Tensor:
    """[1, tokens, k] distinct experts per token, drawn with skewed odds so that loads are uneven and some experts
    get no token."""
    odds = torch.linspace(1, 12, E) ** 2
    odds[E // 2] = 0  # never chosen
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(odds, k, generator=gen) for _ in range(tokens)])[None]


def _each_slot_alone(experts: RoutedExperts, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[1, N, k, D]: slot (t, j) is token t through expert idx[0, t, j], one row at a time, in float64."""
    gate, up, down = (w.double() for w in (experts.gate_proj, experts.up_proj, experts.down_proj))
    rows = [[F.silu(gate[e] @ x[0, t].double()) * (up[e] @ x[0, t].double()) @ down[e].T for e in route.tolist()]
            for t, route in enumerate(idx[0])]
    return torch.stack([torch.stack(row) for row in rows])[None]


class _FixedRoute(torch.nn.Module):
    """A router that always returns the given route (and weights of one), so that MoE runs its experts on it."""

    def __init__(self, idx: torch.Tensor):
        super().__init__()
        self.idx = idx

    def forward(self, x):
        return self.idx, torch.ones(self.idx.shape)


def _loop(experts: RoutedExperts, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """MoE's reference loop on a given route: what its hook_expert_out shows."""
    moe = MoE(TINY.replace(n_shared_experts=0))
    moe.experts, moe.gate, moe.experts_impl = experts, _FixedRoute(idx), "loop"
    seen = []
    moe.hook_expert_out.fns.append(lambda t, hook: seen.append(t))
    moe(x)
    return seen[0]


def _one_at_a_time(experts: RoutedExperts) -> RoutedExperts:
    return UnstackedExperts.of(experts, TINY)


RUNS = {
    "loop": _loop,
    "grouped in pairs": paired_experts,
    "grouped one at a time": lambda experts, x, idx: paired_experts(_one_at_a_time(experts), x, idx),
    "indexed": indexed_experts,
}


@pytest.mark.parametrize(("tokens", "k"), [(1, 4), (1, 3), (2, 4), (37, 4), (37, 3)])
@pytest.mark.parametrize("run", RUNS)
def test_every_way_of_running_the_experts_equals_each_slot_through_its_expert(threads, tokens, k, run):
    experts = _experts()
    x = torch.randn(1, tokens, D, generator=torch.Generator().manual_seed(2))
    idx = _route(tokens, k)
    with torch.no_grad():
        out = RUNS[run](experts, x, idx)
    assert out.shape == (1, tokens, k, D)
    assert relative_error(out, _each_slot_alone(experts, x, idx)) < 1e-6


@pytest.mark.parametrize("run", ["loop", "grouped in pairs", "indexed"])
def test_gradients_equal_each_slot_through_its_expert(threads, run):
    experts = _experts()
    x = torch.randn(1, 37, D, generator=torch.Generator().manual_seed(2), requires_grad=True)
    idx = _route(37, 4)
    upstream = torch.randn(1, 37, 4, D, generator=torch.Generator().manual_seed(3))
    (RUNS[run](experts, x, idx) * upstream).sum().backward()
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
    # By load: expert 2 (1), 4 (2), 7 (3), 8 (4), 0 (5), 5 (8), 3 (9): pairs of neighbours, the last one alone.
    assert expert_groups(counts, pairs=True) == [(2, 4), (7, 8), (0, 5), (3,)]
    assert expert_groups(counts, pairs=False) == [(0,), (2,), (3,), (4,), (5,), (7,), (8,)]


def test_a_pair_reads_a_strided_view_of_the_stack():
    stack = _experts().gate_proj
    pair = stack[group_span((3, 11))]
    assert pair.data_ptr() == stack[3].data_ptr() and torch.equal(pair, stack[[3, 11]])
    assert torch.equal(stack[group_span((5,))], stack[[5]])


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

    x = torch.randn(1, 37, D, generator=gen, requires_grad=True)
    names = backward_node_names(paired_experts(_experts(), x, _route(37, 4)))
    assert names.count("StackSlicesBackward") == 3  # gate, up, down: one node each, whatever the number of groups
    assert not any(name.startswith("SliceBackward") for name in names)


def test_stack_slices_run_only_where_a_gradient_may_flow_into_the_stacks(monkeypatch):
    """Without a gradient to route into the stacks (no_grad, or the stacks frozen), the groups read plain views and
    skip the autograd Function: the same outputs bit for bit, and the input's gradient unchanged."""
    calls = []
    forward = StackSlices.forward
    monkeypatch.setattr(StackSlices, "forward", staticmethod(lambda ctx, *a: calls.append(1) or forward(ctx, *a)))
    experts, idx = _experts(), _route(11, 4)
    x = torch.randn(1, 11, D, generator=torch.Generator().manual_seed(3), requires_grad=True)
    trained = paired_experts(experts, x, idx)
    (x_grad,) = torch.autograd.grad(trained.square().sum(), x)
    assert len(calls) == 3  # gate, up, down
    with torch.no_grad():
        assert torch.equal(paired_experts(experts, x, idx), trained)
    experts.requires_grad_(False)
    frozen = paired_experts(experts, x, idx)
    assert torch.equal(frozen, trained)
    assert torch.equal(torch.autograd.grad(frozen.square().sum(), x)[0], x_grad)
    assert len(calls) == 3  # neither call went through StackSlices


@pytest.mark.parametrize(("shape", "setting", "speed", "expected"), [
    ((1, 1), "auto", True, "paired"), ((DECODE_BATCH, 1), "auto", True, "paired"),
    ((DECODE_BATCH + 1, 1), "auto", True, "loop"), ((1, 2), "auto", True, "loop"), ((1, 16), "auto", True, "loop"),
    ((1, 40), "grouped", True, "paired"), ((1, 1), "loop", True, "loop"), ((1, 1), "auto", False, "loop"),
    ((1, 40), "grouped", False, "loop")])
def test_one_rule_chooses_how_the_experts_run(shape, setting, speed, expected):
    """choose_experts: the reference loop but for a decode step (one new token per sequence [B, 1], at most
    DECODE_BATCH sequences) or experts_impl="grouped", which run grouped (on the CPU: in pairs); a short prompt is no
    decode step; with the speed rooms off, always the loop."""
    idx = torch.zeros(*shape, 4, dtype=torch.long)
    assert choose_experts(setting, _experts(), torch.zeros(*shape, D), idx, speed) == expected


def test_the_rule_reads_by_index_inside_a_compiled_step_and_only_shapes_on_meta(monkeypatch):
    experts, x, idx = _experts(), torch.zeros(1, 1, D), torch.zeros(1, 1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"MoE.experts_impl must be one of \('auto', 'loop', 'grouped'\), got 'pairs'"):
        choose_experts("pairs", experts, x, idx)
    assert choose_experts("auto", experts, x.to("meta"), idx.to("meta")) == "shapes"
    assert choose_experts("auto", experts, x.to("meta"), idx.to("meta"), speed=False) == "shapes"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert choose_experts("auto", experts, x, idx) == "indexed"
    assert choose_experts("auto", _one_at_a_time(experts), x, idx) == "indexed"  # gathered through chosen_weights
    streamed = _one_at_a_time(experts)
    streamed.indexable = False  # as streamed experts: read from files per expert, nothing to gather by index
    assert choose_experts("auto", streamed, x, idx) == "paired"
    many = torch.zeros(1, E, 4, dtype=torch.long)  # more (token, slot) pairs than experts: not a decode step's
    assert choose_experts("auto", experts, torch.zeros(1, E, D), many) == "loop"


@pytest.mark.parametrize(("setting", "expected"), [("auto", "loop"), ("grouped", "grouped"), ("loop", "loop")])
def test_moe_runs_what_the_rule_names(monkeypatch, setting, expected):
    """MoE.forward calls the chooser once and runs what it names: the loop in place, anything else through run_experts
    (speed/grouped_experts.py)."""
    import k2lab.model.moe as moe_module
    from k2lab.model.speed.grouped_experts import run_experts

    calls = []
    monkeypatch.setattr(moe_module, "run_experts", lambda *a: calls.append(a[0]) or run_experts(*a))
    moe = MoE(TINY)
    moe.experts_impl = setting
    with torch.no_grad():
        moe(torch.randn(1, 5, D))
    assert ("grouped" if calls else "loop") == expected
