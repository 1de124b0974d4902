"""The training command's overrides (``python -m k2lab.training --set key=value ...``) and its compiled step."""

from __future__ import annotations

import pytest
import torch
from tiny import TRAINABLE, backward_node_names

from k2lab import K2Model
from k2lab.training.optim import MuonClip
from k2lab.training.train import (
    StepProbes,
    TrainConfig,
    next_token_loss,
    recipe_step,
    train_config_from,
    training_model,
)


def test_overrides_take_each_fields_type():
    tc = train_config_from(["steps=300", "lr=1e-2", "threads=1", "test_suite_share=0", "compile=False"])
    assert (tc.steps, tc.lr, tc.threads, tc.test_suite_share, tc.compile) == (300, 0.01, 1, 0.0, False)
    assert isinstance(tc.test_suite_share, float)
    assert tc.eval_every == 300  # a short trial still evaluates at its end
    assert TrainConfig().steps != 300  # the defaults are untouched


@pytest.mark.parametrize("pair, named", [("step=300", "'step=300'"), ("steps", "'steps'"),
                                         ("steps=1.5", "steps takes int"), ("lr=fast", "lr takes float"),
                                         ("compile=no", "compile takes bool")])
def test_a_bad_override_is_named(pair, named):
    with pytest.raises(ValueError, match=named):
        train_config_from([pair])


def test_the_run_trains_with_its_experts_grouped_and_the_loop_gives_the_same_gradients():
    """The run's model sends each expert stack one gradient (model/dispatch.py's StackSlices); the reference loop's
    gradients agree to float32 rounding."""
    batch = torch.randint(0, TRAINABLE.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    grouped, loop = training_model(TRAINABLE, seed=1), K2Model(TRAINABLE)
    loop.load_state_dict(grouped.state_dict())
    grads = {}
    for name, model in (("grouped", grouped), ("loop", loop)):
        loss = next_token_loss(model, batch)
        stacks = backward_node_names(loss).count("StackSlicesBackward")
        assert stacks == (3 * (TRAINABLE.num_hidden_layers - TRAINABLE.first_k_dense_replace) if name == "grouped"
                          else 0), name
        grads[name] = torch.autograd.grad(loss, list(model.parameters()))
    for got, want in zip(grads["grouped"], grads["loop"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def _loss_grads_probes(model, batch, loss_fn):
    probes = StepProbes()
    with model.hooks(probes.hooks(model)):
        loss = loss_fn(model, batch)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return loss.detach(), grads, probes


@pytest.mark.slow  # compiles a whole training step (the longest test in the suite)
def test_a_compiled_step_matches_the_eager_step():
    """The run trains through torch.compile(next_token_loss). From the same weights it gives the eager loss,
    gradients and probes (traced into the graph), and batches with other routing run without recompiling."""
    cfg = TRAINABLE
    model = K2Model(cfg)
    model.init_weights(std=0.1, seed=0)
    opt = MuonClip.for_model(model, lr=1e-2)
    compiled = torch.compile(next_token_loss)
    batches = torch.randint(0, cfg.vocab_size, (3, 4, 33), generator=torch.Generator().manual_seed(0))
    for i, batch in enumerate(batches):
        with torch.compiler.set_stance("fail_on_recompile" if i > 0 else "default"):
            got_loss, got_grads, got = _loss_grads_probes(model, batch, compiled)
        want_loss, want_grads, want = _loss_grads_probes(model, batch, next_token_loss)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        for (name, _), g, w in zip(model.named_parameters(), got_grads, want_grads, strict=True):
            assert (g is None) == (w is None), name
            if w is not None:
                torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-6, msg=name)
        torch.testing.assert_close(torch.stack(got.max_logits), torch.stack(want.max_logits))  # [L, H]
        assert [c.tolist() for c in got.expert_counts] == [c.tolist() for c in want.expert_counts]
        recipe_step(model, opt, batch, qk_clip_tau=30.0, bias_step=1e-2, loss_fn=compiled)  # on to new weights
