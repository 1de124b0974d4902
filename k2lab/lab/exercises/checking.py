"""The machinery every checker shares: the ``Verdict``, running the learner's function safely, one comparison engine
that names known mistakes, and a ``Watch`` that sees HOW an answer was computed (for exercises that forbid a step)."""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Mistake = tuple[str, Any]  # (what the learner did wrong, the output that mistake gives)


@dataclass(frozen=True)
class Verdict:
    """The outcome of a check: ``ok`` and a sentence. Shown as ``✓ sentence`` or ``✗ sentence``; true when ok.
    ``mistake`` is the known mistake the answer was recognised as (None when it passed or matched none)."""

    ok: bool
    message: str
    mistake: str | None = None

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"{'✓' if self.ok else '✗'} {self.message}"


def checker(check: Callable[..., Verdict]) -> Callable[..., Verdict]:
    """Decorate a ``check_*`` function: library warnings raised while it runs (the learner's code included) stay
    out of the notebook cell, which shows only the verdict."""

    @functools.wraps(check)
    def quiet(*args: Any, **kwargs: Any) -> Verdict:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return check(*args, **kwargs)

    return quiet


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``: a check's inputs are the same on every run and machine."""
    return torch.Generator().manual_seed(seed)


def call(fn: Callable, *args: Any) -> tuple[Any, Verdict | None]:
    """Run the learner's function; an exception becomes a verdict instead of a traceback."""
    try:
        return fn(*args), None
    except NotImplementedError:
        return None, Verdict(False, "not written yet: replace `raise NotImplementedError` with your code")
    except Exception as err:  # the learner's code may raise anything; say what and keep the notebook running
        return None, Verdict(False, f"your function raised {type(err).__name__}: {err}")


def same(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    """Whether ``a`` and ``b`` have one shape and agree to ``atol``/``rtol`` (compared in float64)."""
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol)


def compare(what: str, out: Any, expected: torch.Tensor, mistakes: Sequence[Mistake] = (), *,
            atol: float = 1e-5, rtol: float = 1e-4) -> Verdict:
    """Compare the learner's tensor with the expected one; name the mistake it matches, else say how it differs.
    All of them are compared on the CPU, wherever each was computed: in float64, which not every device has."""
    if out is None:
        return Verdict(False, f"{what}: your function returned None; did you forget `return`?")
    if not isinstance(out, torch.Tensor):
        try:
            out = torch.as_tensor(out)
        except (TypeError, ValueError, RuntimeError):
            return Verdict(False, f"{what}: expected a tensor of shape {list(expected.shape)}, got a "
                                  f"{type(out).__name__}")
    out, expected = out.detach().cpu(), torch.as_tensor(expected).detach().cpu()
    for message, candidate in mistakes:
        candidate = torch.as_tensor(candidate).detach().cpu()
        # A mistake is recognised up to rounding at the scale of its whole answer: computed in another order (or
        # in float64), its small entries may differ by more than their own size allows.
        loose = atol + rtol * candidate.double().abs().max().item() if candidate.numel() else atol
        if not same(out, expected, atol, rtol) and same(out, candidate, loose, rtol):
            return Verdict(False, f"{what}: {message}", mistake=message)
    if out.shape != expected.shape:
        return Verdict(False, f"{what}: wrong shape: got {list(out.shape)}, expected {list(expected.shape)}")
    if same(out, expected, atol, rtol):
        gap = (out.double() - expected.double()).abs().max().item() if out.numel() else 0.0
        return Verdict(True, f"{what}: matches k2lab (max |difference| {gap:.1e})")
    if not torch.isfinite(out).all():
        return Verdict(False, f"{what}: your output has NaN or infinite values")
    big = expected.double().abs() > 1e-3 * expected.double().abs().max()
    if big.any():
        ratio = out.double()[big] / expected.double()[big]
        # A constant ratio away from 1 (an answer equal on its large entries and off on small ones has ratio ~1).
        if ratio.numel() > 1 and ratio.std() < 1e-4 * ratio.abs().mean() and abs(ratio.mean() - 1) > 1e-3:
            return Verdict(False, f"{what}: wrong scale: yours is {ratio.mean().item():.4g} times the right answer")
    gap = (out.double() - expected.double()).abs().max().item()
    return Verdict(False, f"{what}: differs from k2lab by up to {gap:.3g} (and matches no common mistake we know)")


def slices(t: torch.Tensor, loop_dims: Sequence[int]) -> Iterator[torch.Tensor]:
    """``t`` and every slice of it that a loop over some of ``loop_dims`` would make (per head, per row, both):
    the pieces a learner who builds a forbidden tensor one head at a time makes instead of the whole."""
    for r in range(len(loop_dims) + 1):
        for dims in itertools.combinations(loop_dims, r):
            for index in itertools.product(*(range(t.shape[d]) for d in dims)):
                piece = t
                for d, i in sorted(zip(dims, index, strict=True), reverse=True):  # the last dim first keeps indices
                    piece = piece.select(d, i)
                yield piece


class Watch(TorchDispatchMode):
    """Sees every tensor that an operation makes while the learner's code runs under ``with watch:``, to check HOW
    an answer was computed, not only what it is.

    ``shapes`` records the shape of every result. ``found`` lists the names of the ``forbidden`` tensors whose values
    turned up, in any layout: a result holding the same numbers (sorted, to float tolerance) as one of the tensors
    given under that name. So building each head's keys is caught however they were spelled (einsum, matmul, a loop
    over heads), and the legitimate tensors of the same shape (the queries) are not mistaken for them."""

    def __init__(self, forbidden: dict[str, Sequence[torch.Tensor]] | None = None, atol: float = 1e-5,
                 rtol: float = 1e-4):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.found: list[str] = []
        self.atol, self.rtol = atol, rtol
        self._targets: dict[int, list[tuple[str, torch.Tensor]]] = {}  # numel -> (name, its values sorted)
        for name, tensors in (forbidden or {}).items():
            for t in tensors:
                values = t.detach().double().cpu().flatten().sort().values
                self._targets.setdefault(values.numel(), []).append((name, values))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for result in tree_leaves(out):
            if isinstance(result, torch.Tensor):
                self.shapes.append(tuple(result.shape))
                self._look_for_forbidden(result)
        return out

    def _look_for_forbidden(self, result: torch.Tensor) -> None:
        targets = self._targets.get(result.numel(), ())
        if not targets or not result.is_floating_point() or result.device.type == "meta":
            return
        values = result.detach().double().cpu().flatten().sort().values
        for name, target in targets:
            if name not in self.found and torch.allclose(values, target, atol=self.atol, rtol=self.rtol):
                self.found.append(name)
