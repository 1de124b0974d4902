"""Hooks that misbehave get a clear error naming the probe; the hooks block survives reset_hooks; a hook that runs
the model again is stopped; every place that takes a probe selector applies the same rules."""

from __future__ import annotations

import pytest
import torch
from tiny import TINY, attached

import k2lab


@pytest.mark.parametrize(("name", "fn", "message"), [
    ("layers.1.hook_attn_out", lambda t, hook: t.double(),
     r"hook on layers.1.hook_attn_out returned \(2, 7, 256\) torch.float64 .*expected \(2, 7, 256\) torch.float32"),
    ("layers.1.hook_attn_out", lambda t, hook: t[:, :3], r"layers.1.hook_attn_out returned \(2, 3, 256\)"),
    ("layers.1.hook_attn_out", lambda t, hook: t.tolist(), "returned list; expected a tensor"),
    ("layers.2.mlp.gate.hook_topk_idx", lambda t, hook: t + 12, r"hook_topk_idx returned index 1\d; valid: 0..15"),
    ("layers.2.mlp.gate.hook_topk_idx", lambda t, hook: -t - 1, r"hook_topk_idx returned index -\d+; valid: 0..15"),
    ("layers.2.mlp.gate.hook_topk_idx", lambda t, hook: t.float(), r"hook_topk_idx returned .*torch.float32"),
])
def test_bad_replacements_are_refused_by_name(model, ids, name, fn, message):
    with pytest.raises(ValueError, match=message), torch.no_grad(), model.hooks(fwd_hooks=[(name, fn)]):
        model(ids)
    assert attached(model) == 0


def test_bad_backward_replacement_is_refused_by_name(model, ids):
    with pytest.raises(ValueError, match=r"backward hook on norm.hook_out returned \(2, 7\)"):
        with model.hooks(bwd_hooks=[("norm.hook_out", lambda g, hook: g.sum(-1))]):
            model(ids, return_type="loss").backward()
    model.zero_grad(set_to_none=True)


def test_reset_hooks_inside_a_hooks_block_keeps_the_blocks_hooks_and_detaches_the_rest(model, ids):
    """A block's hooks hold until the block exits (issue 49, A); reset_hooks() takes add_hook's and stray ones."""
    def outer(t, hook):
        return t * 0

    blocks = 2 * TINY.num_hidden_layers  # hook_attn_out and hook_z of every layer
    with torch.no_grad(), model.hooks(fwd_hooks=[("hook_attn_out", outer)], bwd_hooks=[("hook_z", outer)]):
        edited = model(ids)
        model.add_hook("layers.1.hook_mlp_out", outer)
        model.hook_point("layers.0.hook_mlp_out").fns.append(outer)  # attached by hand: a stray hook
        assert attached(model) == blocks + 2
        model.reset_hooks()
        assert attached(model) == blocks
        with model.hooks(fwd_hooks=[("layers.1.hook_mlp_out", outer)]):
            model.reset_hooks()  # inside two open blocks: both keep theirs
            assert attached(model) == blocks + 1
        assert attached(model) == blocks
        assert torch.equal(model(ids), edited)
    assert attached(model) == 0
    with torch.no_grad():
        assert not torch.equal(model(ids), edited)


def test_a_hook_that_runs_the_model_again_is_stopped(model, ids):
    def recursive(t, hook):
        model.run_with_cache(ids, names="hook_resid_post")

    with pytest.raises(RuntimeError, match="called from a hook while its own forward is running") as err:
        with torch.no_grad(), model.hooks(fwd_hooks=[("layers.0.hook_resid_post", recursive)]):
            model(ids)
    assert "raised by a hook on layers.0.hook_resid_post" in "".join(err.value.__notes__)
    assert attached(model) == 0
    with torch.no_grad():
        assert model(ids).shape == (2, 7, 512)  # the model is usable again


@pytest.mark.parametrize("selector", [
    "layers.1.hook_attn_out", "hook_resid_post", ".mlp.gate.", ["hook_resid_pre", "layers.2.self_attn.hook_z"],
    lambda name: name.endswith("hook_mlp_out"), [lambda name: "layers.0" in name, "hook_logits"],
])
def test_hooks_and_run_with_cache_select_the_same_probes(model, ids, selector):
    fired = []
    with torch.no_grad():
        with model.hooks(fwd_hooks=[(selector, lambda t, hook: fired.append(hook.name))]):
            model(ids)
        _, cache = model.run_with_cache(ids, names_filter=selector)
    assert fired == list(cache)  # both in firing order
    assert sorted(fired) == sorted(model.select_hook_names(selector))  # which is not module order


def test_selectors_that_match_nothing_raise(model):
    with pytest.raises(KeyError, match=r"no probe named 'hook_nowhere'"):
        model.select_hook_names("hook_nowhere")
    with pytest.raises(ValueError, match="not both"):
        model.run_with_cache(torch.zeros(1, 2, dtype=torch.long), names="hook_z", names_filter="hook_z")
    with pytest.raises(ValueError, match=r"\(selector, fn\) pairs"):
        with model.hooks(fwd_hooks=[("hook_z",)]):
            pass


def test_get_act_name_covers_every_probe(model):
    names = set(model.hook_names())
    short = {k2lab.get_act_name(s, 1) for s in k2lab.model.hooks.LAYER_PROBES}
    short |= {k2lab.get_act_name(s) for s in k2lab.model.hooks.MODEL_PROBES}
    assert short == {n for n in names if not n.startswith(("layers.0.", "layers.2."))}
    assert k2lab.get_act_name("resid_post", 3) == "layers.3.hook_resid_post"
    assert k2lab.get_act_name("layers.0.hook_z") == "layers.0.hook_z"
    with pytest.raises(ValueError, match="per-layer probe"):
        k2lab.get_act_name("pattern")
    with pytest.raises(KeyError, match=r"closest: \['resid_post'"):
        k2lab.get_act_name("resid_pos", 1)
