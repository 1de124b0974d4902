"""The heavy kernels of a call, replayed alone: a floor for what any implementation built on the same kernels
can reach.

``heavy_kernels(fn)`` runs ``fn`` once under a dispatch mode (``AtenOps``) that records every matrix product and fused
attention call (the op, its input tensors and arguments) and returns a function that re-issues exactly those
calls, with the same inputs, and nothing else: no norms, rotations, routing, gathers, copies, module or Python
logic. Timing it beside ``fn`` says how much of ``fn`` those kernels are; timing it against another
implementation's whole call bounds the ratio that trimming everything else could ever give.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
HEAVY_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._grouped_mm.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default}


class AtenOps(TorchDispatchMode):
    """A dispatch mode that sees every aten op a call runs, whichever mode the call runs in. Under no_grad, autograd's
    key splits a composite op (``linear``, ``matmul``, ``scaled_dot_product_attention``) into the ops it runs before a
    mode sees them; inference mode skips that key and hands the composite over whole, so it is split here, with this
    mode watching. ``seen`` is told of each op that runs a kernel of its own."""

    def seen(self, func, args: tuple, kwargs: dict) -> None:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with self:
            parts = func.decompose(*args, **kwargs)  # NotImplemented unless func is a composite
        if parts is not NotImplemented:
            return parts
        self.seen(func, args, kwargs)
        return func(*args, **kwargs)


class _Recorder(AtenOps):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, tuple, dict]] = []

    def seen(self, func, args: tuple, kwargs: dict) -> None:
        if func in HEAVY_OPS:
            self.calls.append((func, args, kwargs))


@torch.no_grad()
def heavy_kernels(fn: Callable[[], object]) -> tuple[Callable[[], object], int]:
    """(replay, number of calls): ``replay()`` re-issues the matrix products and fused attention calls ``fn``
    made, on the same inputs (kept alive by the replay), and nothing else."""
    with _Recorder() as recorder:
        fn()
    calls = recorder.calls
    if not calls:
        raise ValueError("the call made no matrix product or fused attention call to replay")
    return (lambda: [func(*args, **kwargs) for func, args, kwargs in calls]), len(calls)
