"""nnsight and PyTorch hooks on every named probe: ``NNsight(model).layers[i]....hook_x.output`` reads what
run_with_cache records and sets what ``model.hooks`` replacements set; ``register_forward_hook`` on a probe fires.
(nnsight compiles a trace's body from this file's source, so these checks must live in a file.)"""

from __future__ import annotations

import pytest
import torch

nnsight = pytest.importorskip("nnsight", reason="nnsight is an optional test dependency (pip install nnsight)")



def envoy_of(wrapped, name: str):
    """The nnsight envoy of a probe name: ``layers.1.mlp.gate.hook_topk_idx`` -> wrapped.layers[1].mlp.gate...."""
    envoy = wrapped
    for part in name.split("."):
        envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
    return envoy


@pytest.mark.parametrize("attn_impl", ["naive", "absorbed"])
def test_nnsight_reads_every_probe_as_run_with_cache(model, ids, attn_impl):
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, attn_impl=attn_impl)
        wrapped = nnsight.NNsight(model)
        saved = {}
        with wrapped.trace(ids, attn_impl=attn_impl):
            for name in cache:  # in firing order, as nnsight requires
                saved[name] = envoy_of(wrapped, name).output.save()
    assert list(saved) == list(cache) and len(saved) == len(model.hook_names())
    for name, tensor in saved.items():
        assert torch.equal(tensor, cache[name]), name


def test_nnsight_edits_equal_hook_edits(model, ids):
    forced = torch.tensor([3, 5, 7, 11])

    def route(idx, hook):
        return forced.expand_as(idx).clone()

    with torch.no_grad():
        with model.hooks(fwd_hooks=[("layers.1.hook_attn_out", lambda t, hook: torch.zeros_like(t)),
                                    ("layers.2.mlp.gate.hook_topk_idx", route)]):
            expected, cache = model.run_with_cache(ids, names="layers.2.mlp.gate.hook_topk_weights")
        plain = model(ids)
        wrapped = nnsight.NNsight(model)
        with wrapped.trace(ids):
            wrapped.layers[1].hook_attn_out.output[:] = 0
            wrapped.layers[2].mlp.gate.hook_topk_idx.output[:] = forced
            weights = wrapped.layers[2].mlp.gate.hook_topk_weights.output.save()
            edited = wrapped.output.save()
    # To float32 rounding: inside a trace every probe is live, so attention takes the explicit scores where the
    # plain prefill takes the fused kernel.
    torch.testing.assert_close(edited, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights, cache["layers.2.mlp.gate.hook_topk_weights"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(edited, plain)


def test_pytorch_forward_hooks_fire_on_probes(ids):
    """On a model nnsight never wrapped: a wrapped one keeps every probe active (test_workbench.py)."""
    from tiny import random_model

    model, seen = random_model(), []
    point = model.layers[1].self_attn.hook_pattern
    handles = [point.register_forward_hook(lambda module, args, out: seen.append(out.shape)),
               model.layers[1].hook_attn_out.register_forward_hook(lambda module, args, out: out * 0)]
    try:
        assert point.active  # a forward hook alone makes the naive path compute the pattern for it
        with torch.no_grad():
            edited = model(ids, attn_impl="naive")
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [torch.Size([2, 4, 7, 7])]
    assert not point.active
    with torch.no_grad(), model.hooks(fwd_hooks=[("layers.1.hook_attn_out", lambda t, hook: t * 0)]):
        assert torch.equal(edited, model(ids, attn_impl="naive"))
