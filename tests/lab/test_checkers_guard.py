"""The checkers run the learner's code safely (issue #49): an endless function is stopped and named; torch's global
settings and the model it is handed come back as they were, with what changed said; a checker given something that
is not a function names its argument."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from learner import fails_with, passes

from k2lab.lab import exercises as ex


def rms_norm(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# --- a time limit -------------------------------------------------------------------------------------------------


def forever(x, w, eps):
    while True:
        pass


def forever_swallowing_errors(x, w, eps):
    while True:
        try:
            time.sleep(0.01)
        except Exception:  # noqa: BLE001 - the learner's habit; the time limit is not an Exception
            pass


def asleep(x, w, eps):
    time.sleep(3600)


@pytest.mark.parametrize("endless", [forever, forever_swallowing_errors, asleep])
def test_an_endless_function_is_stopped_and_named(endless):
    with ex.time_limit(0.3):
        verdict = ex.check_rms_norm(endless)
    fails_with(verdict, "your function ran for 0.3 s without returning: an infinite loop?")
    passes(ex.check_rms_norm(rms_norm))  # the next check runs as usual (no alarm left behind)


def test_the_time_limit_works_off_the_main_thread_and_defaults_to_a_minute():
    verdicts = []

    def run():
        with ex.time_limit(0.3):
            verdicts.append(ex.check_rms_norm(forever))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    fails_with(verdicts[0], "ran for 0.3 s")
    from k2lab.lab.exercises.checking import _TIME_LIMIT_S

    assert _TIME_LIMIT_S.get() == 60.0
    with pytest.raises(ValueError, match="seconds must be a number > 0"):
        with ex.time_limit(0):
            pass


# --- torch's global settings --------------------------------------------------------------------------------------


def changing(setting):
    def answer(x, w, eps):
        setting()
        return rms_norm(x, w, eps)
    return answer


@pytest.mark.parametrize(("change", "said"), [
    (lambda: torch.set_grad_enabled(not torch.is_grad_enabled()), "turned autograd"),
    (lambda: torch.set_default_dtype(torch.float64), "set the default dtype to torch.float64"),
    (lambda: torch.set_default_device("meta"), "set the default device to meta"),
    (lambda: torch.autograd.set_detect_anomaly(True), "turned anomaly detection on"),
    (lambda: torch.use_deterministic_algorithms(True), "turned deterministic algorithms on"),
    (lambda: torch.set_num_threads(max(torch.get_num_threads() + 1, 2)), "set the number of threads"),
])
def test_a_setting_changed_by_the_learner_is_put_back_and_said(change, said):
    before = (torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_default_device(),
              torch.is_anomaly_enabled(), torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())
    verdict = ex.check_rms_norm(changing(change))
    after = (torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_default_device(),
             torch.is_anomaly_enabled(), torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())
    assert after == before
    passes(verdict)
    assert said in verdict.message and "the check set it back" in verdict.message


def test_a_setting_is_put_back_when_the_function_raises_too():
    def changes_then_fails(x, w, eps):
        torch.set_default_dtype(torch.float64)
        raise ValueError("boom")

    fails_with(ex.check_rms_norm(changes_then_fails), "raised ValueError: boom")
    assert torch.get_default_dtype() == torch.float32


# --- the model check_greedy hands over ----------------------------------------------------------------------------


def greedy(model, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_greedy_leaves_the_model_as_it_was():
    model, ids = ex.small_k2(), torch.tensor([[1, 2, 3]])
    weights = {name: t.clone() for name, t in model.state_dict().items()}

    def trains(m, i, n):
        m.train()
        return greedy(m, i, n)

    def hooks(m, i, n):
        m.add_hook("layers.0.hook_resid_post", lambda t, hook: None)
        m.layers[1].register_forward_hook(lambda *a: None)
        return greedy(m, i, n)

    def zeroes(m, i, n):
        out = greedy(m, i, n)
        m.layers[0].self_attn.o_proj.weight.data.zero_()  # bypasses the version counter
        return out

    for wrong, reason in ((trains, "switched"), (hooks, "left hooks attached"), (zeroes, "changed 1 weights")):
        fails_with(ex.check_greedy(wrong, model, ids), reason)
        assert not model.training and not any(m.training for m in model.modules())
        assert not model.layers[1]._forward_hooks and not model.layers[0].hook_resid_post.fns
        assert all(torch.equal(t, weights[name]) for name, t in model.state_dict().items())
    passes(ex.check_greedy(greedy, model, ids))


def test_greedy_through_k2lab_generate_is_named():
    from k2lab import generate

    fails_with(ex.check_greedy(lambda m, i, n: generate(m, i, max_new_tokens=n), ex.small_k2(),
                               torch.tensor([[1, 2, 3]])), "calls k2lab's own generate")


# --- what the checker is given ------------------------------------------------------------------------------------


@pytest.mark.parametrize("given", [[1, 2], torch.ones(3), {"fn": 1}, None])
def test_a_checker_given_no_function_names_its_argument(given):
    fails_with(ex.check_kv_cache_bytes(given), "check_kv_cache_bytes(fn, ...): fn must be your function")


@pytest.mark.parametrize(("returned", "said"), [([1, 2], "got a list"), (torch.ones(3), "got a Tensor of shape [3]"),
                                                ({"bytes": 1}, "got a dict"), (2.5, "got a float (2.5)")])
def test_kv_cache_bytes_names_what_came_back_instead_of_an_int(returned, said):
    fails_with(ex.check_kv_cache_bytes(lambda cfg, n: returned), f"return the number of bytes as one int, {said}")
