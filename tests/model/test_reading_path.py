"""The reading path: a plain forward of K2-nano runs through few, short k2lab functions in few files, as DeepSeek-V3's
reference does, so that a learner can read the whole computation; every speed trick lives in ``model/speed/``, and
``model.speed = False`` (``with model.reference():``) turns them all off, so that a decode step reads as the prefill's
reference functions plus the latent cache, with the fast path's logits to float32 rounding. Measured with
sys.setprofile (comprehensions and other <...> code objects not counted)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch
from hf_oracle import relative_error

import k2lab
from k2lab.lab import PROMPT

PACKAGE = Path(k2lab.__file__).parent
READING_FILES = {f"model/{name}.py" for name in ("transformer", "inputs", "attention", "moe", "layers")}


def functions_called(call) -> dict[tuple[str, str], object]:
    """{(file relative to the package, qualified name): code object} of every named k2lab function ``call()`` ran."""
    seen = {}

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(str(PACKAGE)) and not code.co_name.startswith("<"):
            seen[(str(Path(code.co_filename).relative_to(PACKAGE)), code.co_qualname)] = code

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def assert_short(called: dict) -> None:
    for (file, name), code in called.items():
        lines = len(inspect.getsourcelines(code)[0])
        assert lines <= 60, f"{file} {name}: {lines} lines"


@pytest.fixture(scope="module")
def nano():
    """K2-nano and the lab's prompt, after one forward: the rotary table of a device is made once, at its first
    forward (rope.py), and read by every forward after."""
    model, tok = k2lab.load_nano()
    ids = torch.tensor([tok.encode(PROMPT)])
    with torch.no_grad():
        model(ids)
    return model, ids


def prefilled(model, ids: torch.Tensor):
    """A cache holding the prompt, with room for one more token (as generate reserves it: no step grows it)."""
    cache = model.new_cache(1, capacity=ids.shape[1] + 1)
    model(ids, cache=cache)
    return cache


@pytest.mark.parametrize("length", [2, 16, 17, None], ids=["2 tokens", "16 tokens", "17 tokens", "the lab's prompt"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad on"])
def test_a_plain_forward_of_k2_nano_reads_in_few_short_functions_and_files(nano, threads, length, grad):
    """Any prompt of two tokens or more: a forward of one new token per sequence is a decode step, whose speed rooms
    are in the next tests."""
    model, ids = nano
    ids = ids if length is None else ids[:, :length]
    with torch.set_grad_enabled(grad):
        called = functions_called(lambda: model(ids))
    files = {file for file, _ in called}
    assert files <= READING_FILES | {"model/speed/fused_attention.py"}, files
    assert len(called) <= 20 and len(files) <= 6, sorted(called)
    assert_short(called)
    # The path states the computation: the inputs, the embedding, every block, the router, the experts, the head.
    for step in ("prepare_inputs", "K2Model.embed", "K2Model.run_blocks", "DecoderLayer.forward",
                 "MultiHeadLatentAttention.forward", "Router.forward", "MoE.forward", "choose_experts",
                 "K2Model.head"):
        assert any(name == step for _, name in called), step


@pytest.mark.parametrize("attn_impl", ["auto", "naive", "absorbed"])
def test_a_reference_decode_step_reads_as_the_prefill_plus_the_latent_cache(nano, threads, attn_impl):
    """With the speed rooms off, a decode step (any thread count) runs the reading files only: the prefill's reference
    functions, the written-out softmax and the latent cache, in at most 24 functions of 7 files, none over 60 lines;
    and its logits are the fast step's to float32 rounding."""
    model, ids = nano
    with torch.no_grad():
        fast = model(ids[:, -1:], cache=prefilled(model, ids[:, :-1]), attn_impl=attn_impl)
        with model.reference():
            cache = prefilled(model, ids[:, :-1])
            called = functions_called(lambda: model(ids[:, -1:], cache=cache, attn_impl=attn_impl))
            reference = model(ids[:, -1:], cache=prefilled(model, ids[:, :-1]), attn_impl=attn_impl)
    assert model.speed  # restored on exit
    files = {file for file, _ in called}
    assert files <= READING_FILES, files
    assert len(called) <= 24 and len(files) <= 7, sorted(called)
    assert_short(called)
    assert ("model/attention.py", "LatentCache.append") in called
    assert ("model/attention.py", "MultiHeadLatentAttention.pattern") in called  # the softmax, written out
    assert relative_error(reference, fast) < 1e-5


def test_every_call_equals_its_reference_with_the_speed_rooms_off(nano):
    """Prefill (fused attention), decode at two threads (thread split, grouped experts), the loss (chunked head) and
    generate: the same results with model.speed off, to float32 rounding."""
    model, ids = nano
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            fast = [model(ids), model(ids[:, -1:], cache=prefilled(model, ids[:, :-1])),
                    model(ids, return_type="loss")]
            tokens = k2lab.generate(model, ids[:, :8], 8)
            model.speed = False
            slow = [model(ids), model(ids[:, -1:], cache=prefilled(model, ids[:, :-1])),
                    model(ids, return_type="loss")]
            assert torch.equal(k2lab.generate(model, ids[:, :8], 8), tokens)
    finally:
        model.speed = True
        torch.set_num_threads(before)
    for got, want in zip(slow, fast, strict=True):
        assert relative_error(got, want) < 1e-5
    assert all(module.speed for module in model.modules() if hasattr(type(module), "speed"))


def test_the_speed_switch_reaches_every_module_and_refuses_a_non_bool(nano):
    model, _ = nano
    rooms = [module for module in model.modules() if hasattr(type(module), "speed")]
    assert {type(m).__name__ for m in rooms} == {"K2Model", "Linear", "MultiHeadLatentAttention", "MoE"}
    with model.reference():
        assert not model.speed and not any(module.speed for module in rooms)
    assert model.speed and all(module.speed for module in rooms)
    with pytest.raises(ValueError, match="model.speed must be True or False, got 0"):
        model.speed = 0
    assert model.speed
    with pytest.warns(UserWarning, match=r"runs eagerly: the speed rooms are off \(model.speed is False\)"):
        with model.reference():
            k2lab.generate(model, "def f(", 2, compile=True)


def test_the_speed_rooms_are_where_their_work_is(nano):
    """A decode step at two threads runs the few-row thread split and the grouped experts; at one thread it asks for
    the thread count but never splits; a prefill runs neither room."""
    model, ids = nano
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(2)
            cache = model.new_cache(1, capacity=ids.shape[1] + 2)
            prefill = functions_called(lambda: model(ids, cache=cache))
            step = functions_called(lambda: model(ids[:, :1], cache=cache))
            torch.set_num_threads(1)
            one_thread = functions_called(lambda: model(ids[:, :1], cache=cache))
    finally:
        torch.set_num_threads(threads)
    rooms = {"model/speed/linear.py", "model/speed/grouped_experts.py"}
    assert not rooms & {file for file, _ in prefill}
    assert rooms <= {file for file, _ in step}
    assert ("model/speed/linear.py", "split_linear") in step and ("model/speed/linear.py", "split_linear") not in (
        one_thread)
    assert ("model/attention.py", "MultiHeadLatentAttention.absorbed") in step
