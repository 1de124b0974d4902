"""Autograd modes: generate runs its forwards under no_grad (inference mode's gain was inside the noise, docs/speed.md),
so what a hook keeps during generation can enter autograd later. A plain call never switches by itself: it runs in
its caller's mode, inference mode included, and what such a call leaves behind (the latent cache, the rotary table)
goes on working outside it."""

from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch
from tiny import blocks_modes, random_model

import k2lab

generate_module = importlib.import_module("k2lab.model.generate")  # the module (k2lab.model.generate is the function)


@pytest.fixture(scope="module")
def model():
    return random_model()


@pytest.fixture()
def ids():
    return torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(3))


def test_generation_runs_under_no_grad_and_returns_an_ordinary_tensor(model, ids):
    seen = []
    sample_next = generate_module.sample_next

    def spy(logits, *args, **kw):
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(), logits.is_inference()))
        return sample_next(logits, *args, **kw)

    with torch.enable_grad(), mock.patch.object(generate_module, "sample_next", spy):
        out = k2lab.generate(model, ids, 4)
    assert seen == [(False, False, False)] * 4
    assert not out.is_inference() and not out.requires_grad
    with torch.enable_grad():  # the ids can feed a forward that trains: the embedding saves them for its backward
        model(out, return_type="loss").backward()
    assert model.embed_tokens.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_what_a_probe_keeps_during_generation_can_enter_autograd(model, ids):
    kept = []
    with model.hooks(fwd_hooks=[("layers.1.hook_resid_post", lambda t, hook: kept.append(t))]):
        k2lab.generate(model, ids, 3)
    assert len(kept) == 3 and not any(t.is_inference() for t in kept)
    w = torch.ones(kept[0].shape[-1], requires_grad=True)
    (kept[-1] * w).sum().backward()  # an inference tensor cannot be saved for backward: this would raise
    assert w.grad is not None


def test_a_cache_filled_in_inference_mode_works_outside_it(model):
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = model(ids)  # [1, 9, V]
    with torch.inference_mode():
        cache = model.new_cache(1)
        prefill = model(ids[:, :5], cache=cache)  # the buffers are made here and grow (5 -> 10 positions) here
        step = model(ids[:, 5:6], cache=cache)
    with torch.no_grad():
        second = model(ids[:, 6:8], cache=cache)  # written into those buffers outside inference mode
    third = model(ids[:, 8:], cache=cache).detach()  # and with autograd on
    torch.testing.assert_close(torch.cat([prefill, step, second, third], dim=1), whole, atol=1e-4, rtol=0)


def test_a_rotary_table_first_made_in_inference_mode_stays_ordinary():
    """A device's rotary table is kept for every later call: made in inference mode, it would break a training step
    there, which saves the rows it reads for backward."""
    model = random_model()
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 2, 3]]))  # the table is made here, for this device
    assert logits.is_inference()  # what the call returns belongs to the call's mode
    assert not any(t.is_inference() for table in model.rotary.tables.values() for t in table)
    model(torch.tensor([[1, 2, 3]]), return_type="loss").backward()  # rows of that table, saved for backward
    assert model.lm_head.weight.grad is not None


def test_a_plain_call_runs_in_its_callers_mode_with_the_same_logits(model, ids):
    with torch.no_grad():
        plain, seen_no_grad = blocks_modes(lambda: model(ids))
    with torch.inference_mode():
        fast, seen_inference = blocks_modes(lambda: model(ids))
    trained, seen_training = blocks_modes(lambda: model(ids))
    assert (seen_no_grad, seen_inference, seen_training) == ([False], [True], [False])
    assert not plain.is_inference() and fast.is_inference() and trained.requires_grad
    assert torch.equal(plain, fast) and torch.equal(plain, trained.detach())


def test_what_a_call_in_inference_mode_leaves_in_the_cache_stays_ordinary(model):
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # row 0 left-padded
    cache = model.new_cache(2, capacity=2)
    with torch.inference_mode():
        model(ids, cache=cache, attention_mask=mask)  # grows the buffers: 2 -> 6
    assert not cache.token_mask.is_inference() and not any(b.is_inference() for b in cache.storage)
    cache.token_mask[1, 0] = False  # hide a cached position by hand: in place, which an inference tensor refuses
    logits = model(ids[:, -1:], cache=cache)  # a decode step with autograd on, through what the call left
    logits.sum().backward()
    assert model.lm_head.weight.grad is not None
    model.zero_grad(set_to_none=True)


class UsersMLP(torch.nn.Module):
    """A module of the user's spliced into the model, which could keep what it sees (as an SAE wrapper might)."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x)


@pytest.mark.parametrize("where", ["probe hook", "submodule", "pre-hook", "every module", "wrapped forward",
                                   "spliced module"])
def test_hooks_wrappers_and_foreign_modules_count_as_observers(model, where):
    """What a compiled decode step could not run (generate(compile=True) then runs eagerly, with a warning)."""
    handles = []
    if where == "probe hook":
        model.add_hook("layers.1.hook_resid_post", lambda t, hook: None)
        handles.append(mock.Mock(remove=model.reset_hooks))
    elif where == "submodule":
        handles.append(model.layers[2].mlp.register_forward_hook(lambda *a: None))
    elif where == "pre-hook":
        handles.append(model.norm.register_forward_pre_hook(lambda *a: None))
    elif where == "spliced module":
        layer = model.layers[2]
        original, layer.mlp = layer.mlp, UsersMLP(layer.mlp)
        handles.append(mock.Mock(remove=lambda: setattr(layer, "mlp", original)))
    elif where == "wrapped forward":  # as nnsight wraps a module
        mlp = model.layers[2].mlp
        mlp.forward = lambda x, forward=mlp.forward: forward(x)
        handles.append(mock.Mock(remove=lambda: mlp.__dict__.pop("forward")))
    else:
        handles.append(torch.nn.modules.module.register_module_forward_hook(lambda *a: None))
    try:
        assert model.is_observed()
    finally:
        for handle in handles:
            handle.remove()
    assert not model.is_observed()
