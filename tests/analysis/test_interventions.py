"""k2lab.interventions: each context manager does what its docstring states, and undoes it on exit."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hf_oracle import hf_model, relative_error, save_and_load
from tiny import GROUPED, TINY, random_model, token_ids

from k2lab import K2Model
from k2lab.analysis.interventions import ablate_experts, edit_bias, force_route, patch
from k2lab.analysis.routing import allowed_experts

pytestmark = pytest.mark.usefixtures("no_grad")

_ids = partial(token_ids, TINY, length=9)


def _routing(model: K2Model, layer: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gate probes and expert outputs of one layer, under whatever intervention is active."""
    logits, cache = model.run_with_cache(ids, names=f"layers.{layer}.mlp.")
    return {name.rsplit(".", 1)[-1]: tensor for name, tensor in cache.items()} | {"logits": logits}


@pytest.fixture(scope="module")
def plain(model):
    with torch.no_grad():
        return _routing(model, 2, _ids())


def _most_used(idx: torch.Tensor) -> int:
    return torch.bincount(idx.flatten()).argmax().item()


# ---- ablate_experts --------------------------------------------------------------------------------------------------
def test_zero_ablation_equals_hf_with_down_proj_zeroed(tmp_path):
    ref = hf_model(TINY, seed=5)
    ours = save_and_load(ref, tmp_path)
    ids = _ids()
    ablate = {1: [_most_used(_routing(ours, 1, ids)["hook_topk_idx"])], 2: [0, 3]}
    with ablate_experts(ours, ablate, mode="zero"):
        got = ours(ids)
    experts = [ref.model.layers[layer].mlp.experts.down_proj for layer in ablate]  # [E, D, I] each
    for down, ids_ in zip(experts, ablate.values(), strict=True):
        down[ids_] = 0
    expected = ref(ids).logits
    assert relative_error(got, expected) < 1e-4
    assert relative_error(ours(ids), expected) > 1e-3  # restored on exit, and the ablation mattered


def test_zero_keeps_the_route_and_zeroes_the_slot(model, plain):
    expert = _most_used(plain["hook_topk_idx"])
    with ablate_experts(model, {2: expert}):
        got = _routing(model, 2, _ids())
    hit = plain["hook_topk_idx"] == expert  # [B, T, k]
    assert torch.equal(got["hook_topk_idx"], plain["hook_topk_idx"])
    assert torch.equal(got["hook_topk_weights"], plain["hook_topk_weights"])
    assert (got["hook_expert_out"][hit] == 0).all()
    assert torch.equal(got["hook_expert_out"][~hit], plain["hook_expert_out"][~hit])


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_renormalize_drops_the_slot_and_renormalises_like_the_router(norm_topk_prob):
    cfg = TINY.replace(norm_topk_prob=norm_topk_prob)
    model = random_model(cfg)
    ids = _ids()
    before = _routing(model, 2, ids)
    ablated = [_most_used(before["hook_topk_idx"]), 1]
    with ablate_experts(model, {2: ablated}, mode="renormalize"):
        got = _routing(model, 2, ids)
    idx = before["hook_topk_idx"]
    assert torch.equal(got["hook_topk_idx"], idx)  # nobody takes the slot
    kept = ~torch.isin(idx, torch.tensor(ablated))
    s = before["hook_scores"].gather(-1, idx) * kept
    expected = s / s.sum(-1, keepdim=True) if norm_topk_prob else s
    assert torch.allclose(got["hook_topk_weights"], expected * cfg.routed_scaling_factor, atol=1e-6)
    assert (got["hook_topk_weights"][~kept] == 0).all()
    if norm_topk_prob:  # the remaining weights again sum to the scaling factor
        assert torch.allclose(got["hook_topk_weights"].sum(-1), torch.tensor(cfg.routed_scaling_factor))
    else:  # without renormalisation in the router, dropping a slot is zeroing it
        with ablate_experts(model, {2: ablated}, mode="zero"):
            zeroed = model(ids)
        assert relative_error(got["logits"], zeroed) < 1e-5


@pytest.mark.parametrize("cfg", [TINY, GROUPED], ids=["one_group", "grouped"])
def test_reroute_hands_the_slot_to_the_next_best_expert(cfg):
    model = random_model(cfg, seed=1)
    ids = _ids()
    before = _routing(model, 2, ids)
    idx, choice, scores = before["hook_topk_idx"], before["hook_choice_scores"], before["hook_scores"]
    ablated = [_most_used(idx), idx[0, 0, 1].item()]
    with ablate_experts(model, {2: ablated}, mode="reroute"):
        got = _routing(model, 2, ids)
    new = got["hook_topk_idx"]
    allowed = allowed_experts(choice, cfg.n_group, cfg.topk_group)  # the groups the router kept
    for b in range(idx.shape[0]):
        for t in range(idx.shape[1]):
            slots = idx[b, t].tolist()
            candidates = [e for e in choice[b, t].argsort(descending=True).tolist()
                          if e not in slots and e not in ablated and allowed[b, t, e]]
            expected = [candidates.pop(0) if e in ablated else e for e in slots]
            assert new[b, t].tolist() == expected, (b, t)
    assert torch.isin(idx, torch.tensor(ablated)).any()
    s = scores.gather(-1, new)  # the router weighs the new set from the unbiased scores
    assert torch.allclose(got["hook_topk_weights"], s / s.sum(-1, keepdim=True) * cfg.routed_scaling_factor)


def test_ablation_checks_its_arguments(model):
    with pytest.raises(ValueError, match=r"dense MLP.*MoE layers: \[1, 2\]"):
        with ablate_experts(model, {0: [1]}):
            pass
    with pytest.raises(ValueError, match="out of range 0..15"):
        with ablate_experts(model, {1: [16]}):
            pass
    with pytest.raises(ValueError, match="mode must be one of"):
        with ablate_experts(model, {1: [1]}, mode="drop"):
            pass
    with pytest.raises(ValueError, match="too few experts left"):
        with ablate_experts(model, {-1: range(13)}, mode="reroute"):  # 16 - 13 < k = 4
            model(_ids())
    assert not any(model.hook_point(n).active for n in model.hook_names())


# ---- force_route -----------------------------------------------------------------------------------------------------
def test_force_route_puts_experts_first_and_keeps_the_routers_best_others(model, plain):
    idx = plain["hook_topk_idx"]
    with force_route(model, {2: [9, int(idx[0, 0, 2])]}):
        got = _routing(model, 2, _ids())
    new = got["hook_topk_idx"]
    assert (new[..., 0] == 9).all() and (new[..., 1] == idx[0, 0, 2]).all()
    for b, t in [(0, 0), (1, 4), (1, 8)]:
        others = [e for e in idx[b, t].tolist() if e not in (9, int(idx[0, 0, 2]))]
        assert new[b, t, 2:].tolist() == others[:2]
    s = plain["hook_scores"].gather(-1, new)
    assert torch.allclose(got["hook_topk_weights"], s / s.sum(-1, keepdim=True) * TINY.routed_scaling_factor)


def test_force_route_at_positions_and_by_tensor_or_function(model, plain):
    idx = plain["hook_topk_idx"]
    full = torch.tensor([1, 2, 3, 4])
    with force_route(model, {2: full}, positions=[0, -1]):
        got = _routing(model, 2, _ids())["hook_topk_idx"]
    assert (got[:, [0, -1]] == full).all() and torch.equal(got[:, 1:-1], idx[:, 1:-1])
    table = torch.arange(9)[:, None].expand(9, 4) + torch.arange(4)  # [T, k] broadcast over the batch
    mask = torch.tensor([[True] * 9, [False] * 9])
    with force_route(model, {2: table}, positions=mask):
        got = _routing(model, 2, _ids())["hook_topk_idx"]
    assert torch.equal(got[0], table) and torch.equal(got[1], idx[1])
    worst = lambda idx, choice: choice.topk(4, largest=False).indices
    with force_route(model, {2: worst}):
        got = _routing(model, 2, _ids())["hook_topk_idx"]
    assert torch.equal(got, plain["hook_choice_scores"].topk(4, largest=False).indices)
    with pytest.raises(ValueError, match="at most k=4 distinct"):
        with force_route(model, {2: [1, 1]}):
            pass
    with pytest.raises(ValueError, match="expert ids in 0..15"):
        with force_route(model, {2: lambda idx, choice: idx + 100}):
            model(_ids())


# ---- edit_bias -------------------------------------------------------------------------------------------------------
def test_edit_bias_changes_choice_not_weights_and_restores(model, plain):
    bias = model.layers[2].mlp.gate.e_score_correction_bias
    old = bias.clone()
    favoured = torch.zeros(16)
    favoured[[2, 5, 7, 11]] = 10.0
    with edit_bias(model, {2: favoured}):
        got = _routing(model, 2, _ids())
    assert torch.equal(bias, old)
    assert (got["hook_topk_idx"].sort(-1).values == torch.tensor([2, 5, 7, 11])).all()
    assert torch.allclose(got["hook_choice_scores"] - got["hook_scores"], favoured.expand(2, 9, 16), atol=1e-6)
    s = plain["hook_scores"][..., [2, 5, 7, 11]]  # weights still from the unbiased scores
    assert torch.allclose(got["hook_topk_weights"].sort(-1).values,
                          (s / s.sum(-1, keepdim=True) * TINY.routed_scaling_factor).sort(-1).values)
    with pytest.raises(RuntimeError, match="inside"):
        with edit_bias(model, {2: lambda b: b * 0, 1: 0.0}):
            assert (bias == 0).all()
            raise RuntimeError("inside")
    assert torch.equal(bias, old)
    with pytest.raises(ValueError, match=r"shape \(16,\)"):
        with edit_bias(model, {2: torch.zeros(3)}):
            pass
    assert torch.equal(bias, old)


# ---- patch -----------------------------------------------------------------------------------------------------------
def test_patching_the_last_residual_gives_the_clean_logits(model):
    clean_ids, corrupt_ids = _ids(seed=0), _ids(seed=1)
    clean_logits, clean = model.run_with_cache(clean_ids)
    with patch(model, clean, "layers.2.hook_resid_post"):
        assert torch.equal(model(corrupt_ids), clean_logits)
    assert relative_error(model(corrupt_ids), clean_logits) > 1e-2


def test_patching_positions(model):
    clean_ids, corrupt_ids = _ids(seed=0), _ids(seed=1)
    _, clean = model.run_with_cache(clean_ids)
    _, corrupt = model.run_with_cache(corrupt_ids)
    names = ["layers.1.hook_resid_mid", "layers.2.self_attn.hook_pattern"]
    with patch(model, clean, names, positions=[3]):
        _, got = model.run_with_cache(corrupt_ids, names=names + ["layers.1.hook_resid_post"])
    resid, pattern = got[names[0]], got[names[1]]  # [B, T, D], [B, H, T, S]
    assert torch.equal(resid[:, 3], clean[names[0]][:, 3])
    # Earlier positions are untouched, to float32 rounding: probing every pattern (the first run) takes the explicit
    # attention scores, probing one takes the fused kernel elsewhere.
    torch.testing.assert_close(resid[:, :3], corrupt[names[0]][:, :3], rtol=1e-5, atol=1e-5)
    assert torch.equal(pattern[:, :, 3], clean[names[1]][:, :, 3])  # positions index the query axis
    assert not torch.equal(pattern[:, :, 5], corrupt[names[1]][:, :, 5])  # later rows saw the patched residual
    with pytest.raises(KeyError, match="the source lacks"):
        with patch(model, got, "hook_resid_pre"):
            pass
    _, short = model.run_with_cache(corrupt_ids[:, :5], names="layers.1.hook_resid_mid")
    with pytest.raises(ValueError, match=r"layers.1.hook_resid_mid is \(2, 9, 256\) here but \(2, 5, 256\)"):
        with patch(model, short, "layers.1.hook_resid_mid"):
            model(corrupt_ids)


def test_patch_takes_names_filter_as_names_and_exactly_one_of_them(model):
    clean_ids, corrupt_ids = _ids(seed=0), _ids(seed=1)
    _, clean = model.run_with_cache(clean_ids)
    with patch(model, clean, names="layers.1.hook_resid_post"):
        by_names = model(corrupt_ids)
    with patch(model, clean, names_filter=lambda name: name == "layers.1.hook_resid_post"):
        by_filter = model(corrupt_ids)
    assert torch.equal(by_names, by_filter)
    assert not torch.equal(by_names, model(corrupt_ids))  # the patch did change the run
    for kwargs in ({}, {"names": "hook_resid_post", "names_filter": "hook_resid_post"}):
        with pytest.raises(ValueError, match="give exactly one"), patch(model, clean, **kwargs):
            pass
