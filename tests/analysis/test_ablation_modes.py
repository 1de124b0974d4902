"""ablate_experts' reference modes ("mean", "resample") against a hand computation of the experts on the reference
tokens, through the same probes; and force_route's refusal of degenerate routes at entry."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny import TINY, assert_refused_unchanged, attached, token_ids

from k2lab import K2Model
from k2lab.analysis.interventions import ablate_experts, force_route

pytestmark = pytest.mark.usefixtures("no_grad")

LAYER = 2
MOE_INPUT = f"layers.{LAYER}.post_attention_layernorm.hook_out"


@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ids [2, 6] and their mask: row 0 has two pads on the left."""
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    return token_ids(TINY, batch=2, length=6, seed=4), mask


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return token_ids(TINY, batch=2, length=9, seed=0)


def _layer_run(model: K2Model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The slots of layer LAYER and the logits, under whatever intervention is active."""
    logits, cache = model.run_with_cache(ids, names=f"layers.{LAYER}.mlp.")
    return {name.rsplit(".", 1)[-1]: tensor for name, tensor in cache.items()} | {"logits": logits}


def _hand_expert(model: K2Model, expert: int, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of one expert of layer LAYER from its stacked matrices, in float64: x [N, D] -> [N, D] float32."""
    experts = model.layers[LAYER].mlp.experts
    gate, up, down = (w[expert].double() for w in (experts.gate_proj, experts.up_proj, experts.down_proj))
    x = x.double()
    return ((F.silu(x @ gate.T) * (x @ up.T)) @ down.T).float()


def _real_moe_inputs(model: K2Model, reference) -> torch.Tensor:
    """[N, D]: the MoE input of layer LAYER at every real reference token (pads left out)."""
    ref_ids, mask = reference
    _, cache = model.run_with_cache(ref_ids, names=MOE_INPUT, attention_mask=mask)
    return cache[MOE_INPUT][mask.bool()]


def _two_used_experts(run: dict[str, torch.Tensor]) -> list[int]:
    return torch.bincount(run["hook_topk_idx"].flatten()).topk(2).indices.tolist()


# ---- mean ------------------------------------------------------------------------------------------------------------
def test_mean_puts_the_experts_mean_over_real_reference_tokens_in_their_slots(model, ids, reference):
    plain = _layer_run(model, ids)
    ablated = _two_used_experts(plain)
    inputs = _real_moe_inputs(model, reference)  # [10, D]
    means = {e: _hand_expert(model, e, inputs).mean(0) for e in ablated}  # [D] each
    with ablate_experts(model, {LAYER: ablated}, mode="mean", reference=reference[0], reference_mask=reference[1]):
        got = _layer_run(model, ids)
    idx = plain["hook_topk_idx"]
    assert torch.equal(got["hook_topk_idx"], idx) and torch.equal(got["hook_topk_weights"], plain["hook_topk_weights"])
    for e in ablated:
        hit = idx == e  # [B, T, k]
        torch.testing.assert_close(got["hook_expert_out"][hit], means[e].expand(int(hit.sum()), -1),
                                   rtol=1e-5, atol=1e-6)
    kept = ~torch.isin(idx, torch.tensor(ablated))
    assert torch.equal(got["hook_expert_out"][kept], plain["hook_expert_out"][kept])

    def put_means(expert_out, hook):  # the same replacement by hand, through model.hooks
        for e in ablated:
            expert_out = torch.where((idx == e)[..., None], means[e], expert_out)
        return expert_out

    with model.hooks(fwd_hooks=[(f"layers.{LAYER}.mlp.hook_expert_out", put_means)]):
        expected = model(ids)
    torch.testing.assert_close(got["logits"], expected, rtol=1e-5, atol=1e-5)
    assert (got["logits"] - plain["logits"]).abs().max() > 1e-3
    # The mask mattered: pads' rows would move the mean.
    all_rows = model.run_with_cache(reference[0], names=MOE_INPUT, attention_mask=reference[1])[1][MOE_INPUT]
    assert not torch.allclose(_hand_expert(model, ablated[0], all_rows.flatten(0, 1)).mean(0), means[ablated[0]])


def test_a_reference_cache_serves_as_well_as_reference_ids(model, ids, reference):
    ablated = {LAYER: _two_used_experts(_layer_run(model, ids)), 1: [3]}
    with ablate_experts(model, ablated, mode="mean", reference=reference[0], reference_mask=reference[1]):
        by_ids = model(ids)
    _, cache = model.run_with_cache(reference[0], names="post_attention_layernorm", attention_mask=reference[1])
    with ablate_experts(model, ablated, mode="mean", reference=cache, reference_mask=reference[1]):
        by_cache = model(ids)
    assert torch.equal(by_ids, by_cache)
    only_layer_1 = {"layers.1.post_attention_layernorm.hook_out": cache["layers.1.post_attention_layernorm.hook_out"]}
    with pytest.raises(KeyError, match=r"reference lacks \['layers.2.post_attention_layernorm.hook_out'\]"):
        with ablate_experts(model, ablated, mode="mean", reference=only_layer_1):
            pass
    assert attached(model) == 0


# ---- resample --------------------------------------------------------------------------------------------------------
def test_resample_answers_with_the_expert_at_a_drawn_reference_token(model, ids, reference):
    plain = _layer_run(model, ids)
    ablated = _two_used_experts(plain)
    inputs = _real_moe_inputs(model, reference)
    candidates = {e: _hand_expert(model, e, inputs) for e in ablated}  # [N, D]: its answer at every reference token

    def resampled(seed):
        with ablate_experts(model, {LAYER: ablated}, mode="resample", reference=reference[0],
                            reference_mask=reference[1], seed=seed):
            return _layer_run(model, ids)

    got = resampled(0)
    idx = plain["hook_topk_idx"]
    assert torch.equal(got["hook_topk_weights"], plain["hook_topk_weights"])
    drawn = set()
    for e in ablated:
        slots = got["hook_expert_out"][idx == e]  # [n, D]
        distance = (slots[:, None] - candidates[e][None]).abs().amax(-1)  # [n, N]
        assert (distance.min(-1).values < 1e-5).all()  # every slot holds the expert's answer at a reference token
        drawn |= set(distance.argmin(-1).tolist())
    assert len(drawn) > 3  # drawn per slot, not one token for all
    kept = ~torch.isin(idx, torch.tensor(ablated))
    assert torch.equal(got["hook_expert_out"][kept], plain["hook_expert_out"][kept])
    assert torch.equal(resampled(0)["logits"], got["logits"])  # the same seed draws the same tokens
    assert torch.equal(resampled(torch.Generator().manual_seed(0))["logits"], got["logits"])
    assert not torch.equal(resampled(1)["logits"], got["logits"])


def test_with_one_reference_token_resample_and_mean_are_its_answer(model, ids, reference):
    plain = _layer_run(model, ids)
    expert = _two_used_experts(plain)[0]
    _, cache = model.run_with_cache(reference[0], names=MOE_INPUT, attention_mask=reference[1])
    one = torch.zeros_like(reference[1])  # with a cache, the mask only selects the reference tokens
    one[1, 3] = 1
    answer = _hand_expert(model, expert, cache[MOE_INPUT][1, 3][None])[0]
    hit = plain["hook_topk_idx"] == expert
    for mode, extra in (("mean", {}), ("resample", {"seed": 5})):
        with ablate_experts(model, {LAYER: expert}, mode=mode, reference=cache, reference_mask=one, **extra):
            got = _layer_run(model, ids)
        torch.testing.assert_close(got["hook_expert_out"][hit], answer.expand(int(hit.sum()), -1),
                                   rtol=1e-5, atol=1e-6)


# ---- experts without stacks (quantized, streamed) --------------------------------------------------------------------
class _ExpertsByCall(torch.nn.Module):
    """Routed experts that only answer ``expert_weights`` (no stacks to index), as quantized and streamed experts:
    each call makes the expert's matrices."""

    stacked = False

    def __init__(self, stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        super().__init__()
        self.num_experts = stacks[0].shape[0]
        self.stored = [tuple(w[e].clone() for w in stacks) for e in range(self.num_experts)]
        self.calls: list[int] = []

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.calls.append(expert)
        return tuple(w.clone() for w in self.stored[expert])


def test_reference_modes_run_experts_through_their_own_call_path(model, ids, reference):
    ablated = _two_used_experts(_layer_run(model, ids))
    by_call = copy.deepcopy(model)
    experts = model.layers[LAYER].mlp.experts
    by_call.layers[LAYER].mlp.experts = _ExpertsByCall((experts.gate_proj, experts.up_proj, experts.down_proj))
    for mode, extra in (("mean", {}), ("resample", {"seed": 2})):
        with ablate_experts(model, {LAYER: ablated}, mode=mode, reference=reference[0], reference_mask=reference[1],
                            **extra):
            stacked = model(ids)
        calls = by_call.layers[LAYER].mlp.experts.calls
        calls.clear()
        with ablate_experts(by_call, {LAYER: ablated}, mode=mode, reference=reference[0],
                            reference_mask=reference[1], **extra):
            assert sorted(calls[-2:]) == sorted(ablated)  # the reference answers, made on entry
            per_call = by_call(ids)
        torch.testing.assert_close(per_call, stacked, rtol=1e-5, atol=1e-5)


# ---- refused arguments -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "error", "named"), [
    ({"mode": "mean"}, ValueError, r"mode='mean' needs reference="),
    ({"mode": "zero", "reference": "REF"}, ValueError, r"reference= is not used by mode='zero'"),
    ({"mode": "reroute", "reference_mask": "MASK"}, ValueError, r"reference_mask= is not used by mode='reroute'"),
    ({"mode": "mean", "reference": "REF", "seed": 1}, ValueError, r"seed= is not used by mode='mean'"),
    ({"mode": "resample", "reference": "REF", "seed": 1.5}, TypeError, r"seed must be an int, a torch.Generator"),
    ({"mode": "mean", "reference": "some text"}, TypeError, r"reference must be token ids \[B, T\].*got str"),
    ({"mode": "mean", "reference": "CACHE", "reference_mask": torch.ones(2, 5, dtype=torch.long)}, ValueError,
     r"reference_mask is \(2, 5\) but the reference is \(2, 6\)"),
    ({"mode": "resample", "reference": "CACHE", "reference_mask": torch.zeros(2, 6, dtype=torch.long)}, ValueError,
     r"reference_mask selects no reference token"),
    ({"mode": "mean", "reference": "REF", "reference_mask": torch.ones(2, 6)}, TypeError,
     r"reference_mask must be an integer or bool tensor \[B, T\].*got torch.float32"),
])
def test_reference_modes_check_their_arguments(model, ids, reference, kwargs, error, named):
    stand_ins = {"REF": reference[0], "MASK": reference[1],
                 "CACHE": model.run_with_cache(reference[0], names=MOE_INPUT)[1]}
    kwargs = {k: stand_ins.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    assert_refused_unchanged(model, ids, lambda m: ablate_experts(m, {LAYER: [1]}, **kwargs).__enter__(), error,
                             named)


# ---- force_route: degenerate routes are refused at entry, naming the layer -------------------------------------------
@pytest.mark.parametrize(("spec", "error", "named"), [
    ([], ValueError, r"layer 1: the route is empty"),
    (range(0), ValueError, r"layer 1: the route is empty"),
    (torch.tensor([], dtype=torch.long), ValueError, r"layer 1: the route is empty"),
    (torch.zeros(9, 3, dtype=torch.long), ValueError, r"layer 1: a route tensor gives k=4 experts .*\(9, 3\)"),
    (torch.zeros(0, 4, dtype=torch.long), ValueError, r"layer 1: a route tensor must broadcast .*not empty.*\(0, 4\)"),
    (torch.zeros(1, 1, 9, 4, dtype=torch.long), ValueError, r"layer 1: a route tensor must broadcast to \[B, T, k\]"),
    (torch.zeros(9, 4), TypeError, r"layer 1: a route tensor holds integer expert ids, got torch.float32"),
    (torch.tensor([[0, 1, 2, 16]]), ValueError, r"layer 1: route tensor ids \[16\] out of range 0..15"),
    (torch.tensor([[0, 1, 2, 3], [5, 5, 6, 7]]), ValueError, r"layer 1: a route tensor must give k=4 distinct"),
])
def test_force_route_refuses_degenerate_routes_at_entry(model, ids, spec, error, named):
    assert_refused_unchanged(model, ids, lambda m: force_route(m, {1: spec}).__enter__(), error, named)


def test_force_route_names_a_route_tensor_that_does_not_fit_the_run(model, ids):
    with pytest.raises(ValueError, match=r"layer 1: the route tensor \(5, 4\) does not broadcast to this run's "
                                         r"\[B, T, k\] = \(2, 9, 4\)"):
        with force_route(model, {1: torch.arange(20).view(5, 4) % 16}):
            model(ids)
    assert attached(model) == 0


def test_force_route_takes_one_expert_id(model, ids):
    with force_route(model, {1: 5}):
        _, cache = model.run_with_cache(ids, names="layers.1.mlp.gate.hook_topk_idx")
    assert (cache["layers.1.mlp.gate.hook_topk_idx"][..., 0] == 5).all()
