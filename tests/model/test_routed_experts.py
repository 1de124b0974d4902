"""RoutedExperts' dispatch: experts run in pairs of similar load as one batched product over a strided view of the
stacks, rows padded to the pair's larger load. Checked against each slot run through its expert on its own, in
float64, and at one thread and two (a batched product splits its pair over threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_oracle import relative_error
from tiny import TINY

from k2lab.model.moe import RoutedExperts

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


def _count_pairs(experts: RoutedExperts) -> list[tuple[int, int]]:
    calls = []
    run_pair = experts.pair

    def counting(first, second, h):
        calls.append((first, second))
        return run_pair(first, second, h)

    experts.pair = counting
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


def test_pair_weights_are_views_of_the_stacks():
    experts = _experts()
    gate, up, down = experts.pair_weights(3, 11)
    assert gate.data_ptr() == experts.gate_proj[3].data_ptr() and torch.equal(gate[1], experts.gate_proj[11])
    assert torch.equal(up, experts.up_proj[[3, 11]]) and torch.equal(down, experts.down_proj[[3, 11]])
