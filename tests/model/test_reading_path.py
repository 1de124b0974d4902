"""The reading path: a plain forward of K2-nano runs through few, short k2lab functions in few files, as DeepSeek-V3's
reference does, so that a learner can read the whole computation; speed lives in rooms of its own (docs/speed.md).
Measured with sys.setprofile (comprehensions and other <...> code objects not counted)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

import k2lab
from k2lab.lab import PROMPT

PACKAGE = Path(k2lab.__file__).parent


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


@pytest.fixture(scope="module")
def nano():
    model, tok = k2lab.load_nano()
    return model, torch.tensor([tok.encode(PROMPT)])


@pytest.mark.parametrize("length", [2, 16, 17, None], ids=["2 tokens", "16 tokens", "17 tokens", "the lab's prompt"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad on"])
def test_a_plain_forward_of_k2_nano_reads_in_few_short_functions_and_files(nano, threads, length, grad):
    """Any prompt of two tokens or more: a forward of one new token per sequence is a decode step, whose speed rooms
    are in the next test."""
    model, ids = nano
    ids = ids if length is None else ids[:, :length]
    with torch.set_grad_enabled(grad):
        called = functions_called(lambda: model(ids))
    files = {file for file, _ in called}
    assert files <= {f"model/{name}.py" for name in ("transformer", "attention", "moe", "layers", "hooks",
                                                      "fused_attention")}, files
    assert len(called) <= 20 and len(files) <= 6, sorted(called)
    for (file, name), code in called.items():
        lines = len(inspect.getsourcelines(code)[0])
        assert lines <= 60, f"{file} {name}: {lines} lines"
    # The path states the computation: the embedding, every block, the router, the experts, the head.
    for step in ("K2Model.embed", "K2Model.run_blocks", "DecoderLayer.forward", "MultiHeadLatentAttention.forward",
                 "Router.forward", "MoE.forward", "K2Model.head"):
        assert any(name == step for _, name in called), step


def test_the_speed_rooms_are_where_their_work_is(nano):
    """A decode step (one new token per sequence) at two threads runs the few-row thread split and the grouped experts;
    a prefill runs neither."""
    model, ids = nano
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            cache = model.new_cache(1)
            prefill = functions_called(lambda: model(ids, cache=cache))
            step = functions_called(lambda: model(ids[:, :1], cache=cache))
    finally:
        torch.set_num_threads(threads)
    assert not {"model/linear.py", "model/dispatch.py"} & {file for file, _ in prefill}
    assert {"model/linear.py", "model/dispatch.py"} <= {file for file, _ in step}
    assert ("model/attention.py", "MultiHeadLatentAttention.absorbed") in step
