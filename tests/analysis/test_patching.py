"""k2lab.patching: every sweep equals a loop of ``interventions.patch``, one forward per cell; and
``attribution_patch(per="head" | "expert")`` splits the estimate into parts that sum to it, each the directional
derivative of the metric along that part of the clean - corrupt difference."""

from __future__ import annotations

import pytest
import torch
from tiny import MICRO, random_model, token_ids

import k2lab
from k2lab import K2Model, patching
from k2lab.analysis.interventions import attribution_patch, patch

# The smallest K2 with a dense layer and two MoE layers (2 heads, 4 experts, top-2): a sweep is a forward per cell.
SMALL = MICRO.replace(num_hidden_layers=3)
L, H, E = SMALL.num_hidden_layers, SMALL.num_attention_heads, SMALL.n_routed_experts
GOOD, BAD = 7, 11  # the metric's two tokens


def metric(logits: torch.Tensor) -> torch.Tensor:
    """The logit difference at the last position, summed over the batch: a scalar."""
    return (logits[:, -1, GOOD] - logits[:, -1, BAD]).sum()


@pytest.fixture(scope="module")
def model() -> K2Model:
    return random_model(SMALL, seed=0)


@pytest.fixture(scope="module")
def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """(clean, corrupted) ids [2, 5]: equal at positions 0 and 1, different from position 2 on."""
    clean = token_ids(SMALL, batch=2, length=5, seed=0)
    corrupted = clean.clone()
    corrupted[:, 2:] = token_ids(SMALL, batch=2, length=3, seed=1)
    assert (corrupted[:, 2:] != clean[:, 2:]).any(-1).all()
    return clean, corrupted


@pytest.fixture(scope="module")
def clean_cache(model, prompts):
    with torch.no_grad():
        return model.run_with_cache(prompts[0])[1]


def _patched_metric(model: K2Model, source, name: str, corrupted: torch.Tensor, positions=None, **kwargs) -> float:
    with torch.no_grad(), patch(model, source, name, positions=positions):
        return metric(model(corrupted, **kwargs)).item()


# ---- sweeps by layer and position ------------------------------------------------------------------------------------
LAYER_POSITION_SWEEPS = {
    "hook_resid_pre": patching.get_act_patch_resid_pre,
    "hook_resid_mid": patching.get_act_patch_resid_mid,
    "hook_attn_out": patching.get_act_patch_attn_out,
    "hook_mlp_out": patching.get_act_patch_mlp_out,
    "mlp.hook_routed_out": patching.get_act_patch_routed_out,
    "mlp.gate.hook_topk_idx": patching.get_act_patch_expert_choice,
}


@pytest.mark.parametrize("probe", list(LAYER_POSITION_SWEEPS))
def test_layer_position_sweeps_equal_a_loop_of_patch(model, prompts, clean_cache, probe):
    corrupted = prompts[1]
    got = LAYER_POSITION_SWEEPS[probe](model, corrupted, clean_cache, metric)
    T = corrupted.shape[1]
    expected = torch.full((L, T), float("nan"))
    for layer in range(L):
        name = f"layers.{layer}.{probe}"
        if name not in model.hook_names():  # a dense layer has no router or routed experts: its row stays NaN
            continue
        for t in range(T):
            expected[layer, t] = _patched_metric(model, clean_cache, name, corrupted, positions=[t])
    assert got.shape == (L, T) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert got.isnan().any(-1).tolist() == [layer == 0 for layer in range(L)] if "mlp." in probe else \
        not got.isnan().any()
    # Positions before the first difference hold the same activations in both runs: patching them changes nothing.
    with torch.no_grad():
        unpatched = metric(model(corrupted)).item()
    swept = got[~got.isnan().all(-1)]  # the layers this sweep patched
    torch.testing.assert_close(swept[:, :2], torch.full_like(swept[:, :2], unpatched), rtol=1e-5, atol=1e-5)
    assert (swept[:, 2:] - unpatched).abs().max() > 1e-3  # and later ones do change it


def test_patching_every_position_of_the_first_residual_restores_the_clean_metric(model, prompts, clean_cache):
    """A cross-check on the sweep's meaning: the clean resid_pre of layer 0 at every position is the clean run."""
    clean, corrupted = prompts
    every = _patched_metric(model, clean_cache, "layers.0.hook_resid_pre", corrupted)
    with torch.no_grad():
        assert every == pytest.approx(metric(model(clean)).item(), abs=1e-5)


def test_block_every_stacks_resid_pre_attn_out_and_mlp_out(model, prompts, clean_cache):
    corrupted = prompts[1]
    got = patching.get_act_patch_block_every(model, corrupted, clean_cache, metric)
    expected = [sweep(model, corrupted, clean_cache, metric) for sweep in
                (patching.get_act_patch_resid_pre, patching.get_act_patch_attn_out, patching.get_act_patch_mlp_out)]
    torch.testing.assert_close(got, torch.stack(expected), rtol=0, atol=0)


def test_the_expert_choice_sweep_patches_only_who_is_chosen(model, prompts, clean_cache):
    """Where the clean and corrupted runs chose the same experts, copying the choice changes nothing."""
    corrupted = prompts[1]
    got = patching.get_act_patch_expert_choice(model, corrupted, clean_cache, metric)
    with torch.no_grad():
        _, corrupt_cache = model.run_with_cache(corrupted, names="hook_topk_idx")
        unpatched = metric(model(corrupted)).item()
    for layer in (1, 2):
        name = f"layers.{layer}.mlp.gate.hook_topk_idx"
        same = (clean_cache[name].sort(-1).values == corrupt_cache[name].sort(-1).values).all(-1).all(0)  # [T]
        assert same[:2].all() and not same.all()
        torch.testing.assert_close(got[layer, same], torch.full_like(got[layer, same], unpatched), rtol=0, atol=1e-5)


# ---- sweeps by head --------------------------------------------------------------------------------------------------
def test_head_sweeps_equal_a_loop_of_patch_with_one_head_clean(model, prompts, clean_cache):
    """The expected cell patches all of hook_z, from a source that is the corrupted run's z except for the one head
    (and position) taken from the clean run."""
    corrupted = prompts[1]
    all_pos = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, metric)
    by_pos = patching.get_act_patch_attn_head_out_by_pos(model, corrupted, clean_cache, metric)
    with torch.no_grad():
        _, corrupt_cache = model.run_with_cache(corrupted, names="self_attn.hook_z")
    T = corrupted.shape[1]
    expected_all, expected_by = torch.empty(L, H), torch.empty(L, T, H)
    for layer in range(L):
        name = f"layers.{layer}.self_attn.hook_z"  # [B, T, H, V]
        for head in range(H):
            source = corrupt_cache[name].clone()
            source[:, :, head] = clean_cache[name][:, :, head]
            expected_all[layer, head] = _patched_metric(model, {name: source}, name, corrupted)
            for t in range(T):
                source = corrupt_cache[name].clone()
                source[:, t, head] = clean_cache[name][:, t, head]
                expected_by[layer, t, head] = _patched_metric(model, {name: source}, name, corrupted)
    torch.testing.assert_close(all_pos, expected_all, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_pos, expected_by, rtol=1e-5, atol=1e-5)
    assert all_pos.std() > 1e-3  # the heads differ


# ---- padded batches, progress, no_grad -------------------------------------------------------------------------------
def test_sweeps_pass_the_attention_mask(model):
    clean, corrupted = token_ids(SMALL, batch=2, length=4, seed=2), token_ids(SMALL, batch=2, length=4, seed=3)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])  # row 0 left-padded
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names="hook_attn_out", attention_mask=mask)
    got = patching.get_act_patch_attn_out(model, corrupted, cache, metric, attention_mask=mask)
    expected = torch.tensor([[_patched_metric(model, cache, f"layers.{layer}.hook_attn_out", corrupted, [t],
                                              attention_mask=mask) for t in range(4)] for layer in range(L)])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, patching.get_act_patch_attn_out(model, corrupted, cache, metric))


def test_progress_bar_on_request_and_for_long_sweeps(model, prompts, clean_cache, capsys, monkeypatch):
    corrupted = prompts[1]
    patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)  # 15 forwards: no bar
    assert "patching" not in capsys.readouterr().err
    patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric, progress=True)
    assert "patching hook_resid_pre" in capsys.readouterr().err
    monkeypatch.setattr(patching, "LONG_SWEEP", 14)  # now 15 forwards are a long sweep
    patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)
    assert "15/15" in capsys.readouterr().err
    patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric, progress=False)
    assert "patching" not in capsys.readouterr().err


def test_sweeps_run_without_gradient(model, prompts, clean_cache):
    seen = []

    def watching_metric(logits):
        seen.append(torch.is_grad_enabled() or logits.requires_grad)
        return metric(logits)

    got = patching.get_act_patch_mlp_out(model, prompts[1], clean_cache, watching_metric)
    assert not got.requires_grad and len(seen) == got.numel() and not any(seen)


def test_patching_is_a_lazy_name_of_k2lab():
    assert k2lab.patching is patching and "patching" in k2lab.__all__ and "patching" in dir(k2lab)


# ---- refused inputs --------------------------------------------------------------------------------------------------
def test_sweeps_check_their_inputs_before_running(model, prompts, clean_cache):
    clean, corrupted = prompts
    with torch.no_grad():
        _, resid_only = model.run_with_cache(clean, names="hook_resid_pre")
        _, short = model.run_with_cache(clean[:, :4], names="self_attn.hook_z")
    with pytest.raises(KeyError, match=r"lacks 3 of the 3 .*layers.0.self_attn.hook_z.*names='self_attn.hook_z'"):
        patching.get_act_patch_attn_head_out_all_pos(model, corrupted, resid_only, metric)
    with pytest.raises(KeyError, match=r"lacks 2 of the 2 .*names='mlp.gate.hook_topk_idx'"):
        patching.get_act_patch_expert_choice(model, corrupted, resid_only, metric)
    with pytest.raises(ValueError, match=r"layers.0.self_attn.hook_z'\] is \(2, 4, 2, 8\).*corrupted_tokens is "
                                         r"\(2, 5\)"):
        patching.get_act_patch_attn_head_out_by_pos(model, corrupted, short, metric)
    with pytest.raises(TypeError, match=r"corrupted_tokens must be token ids.*torch.float32"):
        patching.get_act_patch_resid_pre(model, corrupted.float(), clean_cache, metric)
    with pytest.raises(TypeError, match="clean_cache must be an ActivationCache"):
        patching.get_act_patch_resid_pre(model, corrupted, [clean_cache], metric)
    with pytest.raises(TypeError, match="metric must be a function"):
        patching.get_act_patch_resid_pre(model, corrupted, clean_cache, "logit_diff")
    with pytest.raises(ValueError, match=r"progress must be None .*got 'yes'"):
        patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric, progress="yes")
    with pytest.raises(ValueError, match=r"metric must return a scalar tensor.*shape \(2,\)"):
        patching.get_act_patch_resid_pre(model, corrupted, clean_cache, lambda logits: logits[:, -1, GOOD])


def test_a_clean_tensor_of_another_shape_is_named_at_the_patch(model, prompts, clean_cache):
    """(B, T) agree but the rest does not (a cache of another model's width): the hook names the probe."""
    name = "layers.1.hook_resid_pre"
    wrong = {name: clean_cache[name][..., :8]}
    with pytest.raises(ValueError, match=r"clean_cache\['layers.1.hook_resid_pre'\] is \(2, 5, 8\) but the "
                                         r"corrupted run's is \(2, 5, 32\)"):
        patching.get_act_patch_resid_pre(model, prompts[1], {**clean_cache, **wrong}, metric)


# ---- attribution patching per head and per expert --------------------------------------------------------------------
def _scaled_difference_gradient(model: K2Model, corrupted: torch.Tensor, name: str,
                                difference: torch.Tensor) -> torch.Tensor:
    """d metric / d s at s = 0 for s [B, T, C], where the probe's activation a becomes a + s[..., None] * difference
    (``difference`` [B, T, C, F]: one part per head of hook_z [B, T, H, V]; or, summed over C, one part per expert of
    routed_out [B, T, D]). Each entry is the directional derivative along that cell's part of the difference, by
    autograd on s, without attribution_patch or run_with_cache."""
    s = torch.zeros(difference.shape[:3], requires_grad=True)

    def shift(activation, hook):
        moved = s[..., None] * difference  # [B, T, C, F]
        return activation + (moved if moved.shape == activation.shape else moved.sum(2))

    with model.hooks(fwd_hooks=[(name, shift)]):
        (grad,) = torch.autograd.grad(metric(model(corrupted)), s)
    return grad


def _directional_derivative(model: K2Model, corrupted: torch.Tensor, name: str, direction: torch.Tensor) -> float:
    """d/d alpha metric(run with the probe's activation + alpha * direction) at alpha = 0, in forward mode (dual
    numbers, ``torch.autograd.forward_ad``). The explicit attention softmax (a pattern probe watched) has a
    forward-mode derivative, the fused kernel has none."""

    def along(alpha):
        with model.hooks(fwd_hooks=[(name, lambda a, hook: a + alpha * direction),
                                    ("self_attn.hook_pattern", lambda pattern, hook: None)]):
            return metric(model(corrupted))

    import torch.autograd.forward_ad as forward_ad

    with forward_ad.dual_level():
        alpha = forward_ad.make_dual(torch.tensor(0.0), torch.tensor(1.0))
        return forward_ad.unpack_dual(along(alpha)).tangent.item()


def test_per_head_estimates_sum_to_hook_z_and_are_directional_derivatives(model, prompts):
    clean, corrupted = prompts
    per_head = attribution_patch(model, clean, corrupted, metric, per="head")
    whole = attribution_patch(model, clean, corrupted, metric, names="self_attn.hook_z")
    assert sorted(per_head) == sorted(whole) == [f"layers.{i}.self_attn.hook_z" for i in range(L)]
    with torch.no_grad():
        _, clean_z = model.run_with_cache(clean, names="self_attn.hook_z")
        _, corrupt_z = model.run_with_cache(corrupted, names="self_attn.hook_z")
    for name, estimate in per_head.items():
        assert estimate.shape == (2, 5, H)
        torch.testing.assert_close(estimate.sum(-1), whole[name], rtol=1e-5, atol=1e-6)
        difference = clean_z[name] - corrupt_z[name]  # [B, T, H, V]
        expected = _scaled_difference_gradient(model, corrupted, name, difference)  # [B, T, H]
        torch.testing.assert_close(estimate, expected, rtol=1e-4, atol=1e-6)
    for b, t, head in [(0, 4, 1), (1, 3, 0)]:  # forward mode, one cell at a time
        direction = torch.zeros_like(difference)
        direction[b, t, head] = (clean_z["layers.1.self_attn.hook_z"] - corrupt_z["layers.1.self_attn.hook_z"])[
            b, t, head]
        jvp = _directional_derivative(model, corrupted, "layers.1.self_attn.hook_z", direction)
        assert per_head["layers.1.self_attn.hook_z"][b, t, head].item() == pytest.approx(jvp, rel=1e-3, abs=1e-5)
    assert per_head["layers.1.self_attn.hook_z"][:, 2:].abs().max() > 1e-4


def _expert_contributions(cache, layer: int) -> torch.Tensor:
    """[B, T, E, D]: weight * expert output of the slot that chose each expert, zero for experts not chosen, built
    from the recorded slots; summed over E it is routed_out."""
    prefix = f"layers.{layer}.mlp."
    idx, weights = cache[prefix + "gate.hook_topk_idx"], cache[prefix + "gate.hook_topk_weights"]  # [B, T, k]
    expert_out = cache[prefix + "hook_expert_out"]  # [B, T, k, D]
    B, T, k, D = expert_out.shape
    contributions = torch.zeros(B, T, E, D)
    for b in range(B):
        for t in range(T):
            for slot in range(k):
                contributions[b, t, idx[b, t, slot]] += weights[b, t, slot] * expert_out[b, t, slot]
    return contributions


def test_per_expert_estimates_sum_to_routed_out_and_match_a_hand_computation(model, prompts):
    clean, corrupted = prompts
    per_expert = attribution_patch(model, clean, corrupted, metric, per="expert")
    whole = attribution_patch(model, clean, corrupted, metric, names="mlp.hook_routed_out")
    assert sorted(per_expert) == sorted(whole) == ["layers.1.mlp.hook_routed_out", "layers.2.mlp.hook_routed_out"]
    with torch.no_grad():
        _, clean_run = model.run_with_cache(clean, names="layers.")
        _, corrupt_run = model.run_with_cache(corrupted, names="layers.")
    for layer in (1, 2):
        name = f"layers.{layer}.mlp.hook_routed_out"
        estimate = per_expert[name]
        assert estimate.shape == (2, 5, E) and estimate.dtype == torch.float32
        torch.testing.assert_close(estimate.sum(-1), whole[name], rtol=1e-5, atol=1e-6)
        clean_parts, corrupt_parts = _expert_contributions(clean_run, layer), _expert_contributions(corrupt_run, layer)
        torch.testing.assert_close(clean_parts.sum(2), clean_run[name], rtol=1e-5, atol=1e-6)
        difference = clean_parts - corrupt_parts  # [B, T, E, D]
        # d metric / d routed_out, by autograd through a hook on routed_out, then dotted with each expert's part
        expected = _scaled_difference_gradient(model, corrupted, name, difference)  # [B, T, E]
        torch.testing.assert_close(estimate, expected, rtol=1e-4, atol=1e-6)
        # At the last position (where every layer's routed_out reaches the metric), an expert that only one run chose
        # counts; an expert with the same part in both runs never does.
        chosen_by_one_run_only = (clean_parts.abs().sum(-1) > 0) != (corrupt_parts.abs().sum(-1) > 0)  # [B, T, E]
        assert chosen_by_one_run_only[:, -1].any() and (estimate[:, -1][chosen_by_one_run_only[:, -1]] != 0).all()
        assert (estimate[difference.abs().sum(-1) == 0] == 0).all()
    b, t = 1, 4
    e = int(per_expert["layers.2.mlp.hook_routed_out"][b, t].abs().argmax())
    direction = torch.zeros(2, 5, SMALL.hidden_size)
    direction[b, t] = (_expert_contributions(clean_run, 2) - _expert_contributions(corrupt_run, 2))[b, t, e]
    jvp = _directional_derivative(model, corrupted, "layers.2.mlp.hook_routed_out", direction)
    assert per_expert["layers.2.mlp.hook_routed_out"][b, t, e].item() == pytest.approx(jvp, rel=1e-3, abs=1e-5)


def test_attribution_per_checks_its_argument(model, prompts):
    clean, corrupted = prompts
    with pytest.raises(ValueError, match=r"per must be one of \['expert', 'head', 'position'\], got 'neuron'"):
        attribution_patch(model, clean, corrupted, metric, per="neuron")
    with pytest.raises(ValueError, match=r"per='head' splits self_attn.hook_z probes.*hold none"):
        attribution_patch(model, clean, corrupted, metric, names="hook_resid_pre", per="head")
    only_layer_2 = attribution_patch(model, clean, corrupted, metric, names="layers.2.", per="expert")
    assert list(only_layer_2) == ["layers.2.mlp.hook_routed_out"]
