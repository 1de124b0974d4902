"""The machinery every checker shares: the ``Verdict``, running the learner's function safely, one comparison engine
that names known mistakes, and a ``Watch`` that sees HOW an answer was computed (for exercises that forbid a step).

Running the learner's function (``call``) is guarded five ways, so that a check never hangs, never changes what the
notebook runs with, and never lets a side effect pass for a right answer:

- a time limit (``time_limit``, a minute by default): "your function ran for 60 s; an infinite loop?";
- torch's global settings (autograd, the default dtype and device, anomaly and deterministic modes, threads, matmul
  precision) are put back after it, and the verdict says what the function had changed;
- its tensor arguments must come back unchanged: a function that writes into its input gets a ✗ naming the argument;
- a call of k2lab's own implementation of the piece being written (``Router`` for the router, ``K2Model`` for the
  model) is named as such;
- an exception becomes a verdict (a stub's ``NotImplementedError``: "not written yet").
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import inspect
import itertools
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import CodeType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Mistake = tuple[str, Any]  # (what the learner did wrong, the output that mistake gives)
Mistakes = Iterable[Mistake] | Callable[[], Iterable[Mistake]]  # a list, or a function that makes them when needed

GREEN, RED, PLAIN = "\x1b[32m", "\x1b[31m", "\x1b[0m"  # ANSI colours: JupyterLab draws them in a printed line


@dataclass(frozen=True)
class Verdict:
    """The outcome of a check: ``ok`` and a sentence. Shown as ``✓ sentence`` or ``✗ sentence``; true when ok.
    ``mistake`` is the known mistake the answer was recognised as (None when it passed or matched none).

    ``repr`` is plain text; ``str`` (what ``print`` shows) colours the mark green or red with ANSI codes, which
    JupyterLab and terminals draw; ``_repr_html_`` colours it when a verdict is a cell's last expression."""

    ok: bool
    message: str
    mistake: str | None = None

    def __bool__(self) -> bool:
        return self.ok

    @property
    def mark(self) -> str:
        """``✓`` or ``✗``."""
        return "✓" if self.ok else "✗"

    def __repr__(self) -> str:
        return f"{self.mark} {self.message}"

    def __str__(self) -> str:
        return f"{GREEN if self.ok else RED}{self.mark}{PLAIN} {self.message}"

    def _repr_html_(self) -> str:
        import html

        colour = "#1a7f37" if self.ok else "#cf222e"
        return (f'<pre style="white-space:pre-wrap"><b style="color:{colour}">{self.mark}</b> '
                f"{html.escape(self.message)}</pre>")


def named(message: str, what: str | None = None) -> Verdict:
    """A failing verdict that names the mistake: ``"what: message"`` with ``mistake=message``."""
    return Verdict(False, f"{what}: {message}" if what else message, mistake=message)


# --- notes: what the learner's code changed, said once in the final verdict -----------------------------------------

_NOTES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("k2lab_check_notes", default=None)


def note(text: str) -> None:
    """Add a sentence to the verdict of the check now running (said once, after the verdict's own message)."""
    notes = _NOTES.get()
    if notes is not None and text not in notes:
        notes.append(text)


def checker(check: Callable[..., Verdict]) -> Callable[..., Verdict]:
    """Decorate a ``check_*`` function: its first argument must be the learner's function (else a ✗ that names the
    argument); library warnings raised while it runs (the learner's code included) stay out of the notebook cell,
    which shows only the verdict; the notes made while it ran (settings the learner's code changed and the check
    put back, k2lab pieces it used) end the verdict's message."""
    name = check.__name__

    @functools.wraps(check)
    def guarded(*args: Any, **kwargs: Any) -> Verdict:
        fn = args[0] if args else kwargs.get("fn")
        if not callable(fn):
            return Verdict(False, f"{name}(fn, ...): fn must be your function (a def or a lambda), as in "
                                  f"{name}(my_function); got a {type(fn).__name__}")
        token = _NOTES.set([])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                verdict = check(*args, **kwargs)
            notes = _NOTES.get()
        finally:
            _NOTES.reset(token)
        if notes:
            verdict = replace(verdict, message=f"{verdict.message}. Note: " + "; ".join(notes))
        return verdict

    return guarded


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``: a check's inputs are the same on every run and machine."""
    return torch.Generator().manual_seed(seed)


# --- the time limit ---------------------------------------------------------------------------------------------

_TIME_LIMIT_S: contextvars.ContextVar[float] = contextvars.ContextVar("k2lab_check_time_limit", default=60.0)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """How long one run of the learner's function may take inside the checks of this block (default 60 s):

        with exercises.time_limit(300):
            print(exercises.check_model_from_weights(my_k2, nano, ids))     # a slow but finite answer
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"time_limit(seconds): seconds must be a number > 0, got {seconds!r}")
    token = _TIME_LIMIT_S.set(float(seconds))
    try:
        yield
    finally:
        _TIME_LIMIT_S.reset(token)


_REFERENCES: contextvars.ContextVar[bool] = contextvars.ContextVar("k2lab_check_references", default=False)


@contextlib.contextmanager
def judging_references() -> Iterator[None]:
    """Inside this block a check judges one of k2lab's own references (what ``lab.mine`` puts in for a skipped piece,
    made of k2lab's functions): what the answer computes is checked as for any answer, but calling k2lab's own
    implementation is not held against it."""
    token = _REFERENCES.set(True)
    try:
        yield
    finally:
        _REFERENCES.reset(token)


class OutOfTime(BaseException):
    """Raised inside the learner's function when its time is up. A BaseException, so that the learner's own
    ``except Exception:`` does not swallow it."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[Callable[[], None]]:
    """Raise ``OutOfTime`` in this thread after ``seconds`` (and every second after, in case the code catches it),
    until the ``stop`` function it yields is called. In the main thread a SIGALRM timer does it (it also interrupts
    a ``time.sleep``); elsewhere, or without SIGALRM, a watchdog thread raises the exception asynchronously."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        def on_alarm(signum: int, frame: Any) -> None:
            raise OutOfTime

        previous_handler = signal.signal(signal.SIGALRM, on_alarm)
        previous_timer = signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
        started = time.monotonic()

        def stop() -> None:
            signal.setitimer(signal.ITIMER_REAL, 0)

        try:
            yield stop
        finally:
            stop()
            signal.signal(signal.SIGALRM, previous_handler)
            if previous_timer[0] > 0:  # someone else's timer was running: let it go on, less the time spent here
                left = max(previous_timer[0] - (time.monotonic() - started), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, left, previous_timer[1])
        return

    target, done, lock = threading.get_ident(), threading.Event(), threading.Lock()
    raise_in = ctypes.pythonapi.PyThreadState_SetAsyncExc

    def watchdog() -> None:
        wait = seconds
        while not done.wait(wait):
            with lock:
                if not done.is_set():
                    raise_in(ctypes.c_ulong(target), ctypes.py_object(OutOfTime))
            wait = 1.0

    def stop() -> None:  # an exception raised just before is still delivered, and reported as the time running out
        with lock:
            done.set()

    threading.Thread(target=watchdog, name="k2lab-check-deadline", daemon=True).start()
    try:
        yield stop
    finally:
        stop()


# --- torch's global settings -----------------------------------------------------------------------------------


def _set_default_device(device: torch.device) -> None:
    torch.set_default_device(None if device == torch.device("cpu") else device)


# (what it is, read it, set it back, how to say the new value). Each is global state that a learner's function can
# change with one call and that would stay changed for the rest of the notebook.
_SETTINGS: list[tuple[str, Callable[[], Any], Callable[[Any], None], Callable[[Any], str]]] = [
    ("autograd", torch.is_grad_enabled, torch.set_grad_enabled,
     lambda on: f"turned autograd {'on' if on else 'off'} (torch.set_grad_enabled({on}))"),
    ("default dtype", torch.get_default_dtype, torch.set_default_dtype,
     lambda dtype: f"set the default dtype to {dtype} (torch.set_default_dtype)"),
    ("default device", torch.get_default_device, _set_default_device,
     lambda device: f"set the default device to {device} (torch.set_default_device)"),
    ("anomaly detection", lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
     lambda value: torch.set_anomaly_enabled(*value),
     lambda value: f"turned anomaly detection {'on' if value[0] else 'off'} (torch.autograd.set_detect_anomaly)"),
    ("deterministic algorithms",
     lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
     lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1]),
     lambda value: f"turned deterministic algorithms {'on' if value[0] else 'off'} "
                   f"(torch.use_deterministic_algorithms)"),
    ("threads", torch.get_num_threads, torch.set_num_threads,
     lambda n: f"set the number of threads to {n} (torch.set_num_threads)"),
    ("float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision,
     lambda p: f"set the float32 matmul precision to {p!r}"),
]


@contextlib.contextmanager
def kept_settings() -> Iterator[None]:
    """Put torch's global settings back as they were on entry, and note each one that the code inside changed."""
    before = [get() for _, get, _, _ in _SETTINGS]
    try:
        yield
    finally:
        changed = []
        for (_, get, put, say), value in zip(_SETTINGS, before, strict=True):
            now = get()
            if now != value:
                put(value)
                changed.append(say(now))
        if changed:
            note(f"your function {', '.join(changed)}; the check set it back, since the rest of the notebook runs "
                 f"with these settings")


# --- the arguments: what the learner's function must not change ------------------------------------------------


def _snapshot(value: Any) -> Any:
    """A copy of every tensor inside ``value`` (tensors, modules' parameters and buffers, lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, torch.nn.Module):
        return {name: t.detach().clone() for name, t in itertools.chain(value.named_parameters(),
                                                                        value.named_buffers())}
    if isinstance(value, Mapping):
        return {key: _snapshot(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_snapshot(item) for item in value]
    return None


def _changed(value: Any, before: Any) -> str | None:
    """Where ``value``'s tensors differ from their ``_snapshot`` (``""`` for the value itself, ``"['k']"`` inside),
    else None. Containers that gained or lost items are not judged: only the tensors the caller handed over."""
    if isinstance(value, torch.Tensor):
        now = value.detach()
        if now.shape != before.shape or now.dtype != before.dtype or now.device != before.device:
            return ""
        equal = torch.equal(now, before) or (now.is_floating_point()
                                             and torch.allclose(now, before, rtol=0, atol=0, equal_nan=True))
        return None if equal else ""
    if isinstance(value, torch.nn.Module):
        now = dict(itertools.chain(value.named_parameters(), value.named_buffers()))
        for name, old in before.items():
            if name in now and _changed(now[name], old) is not None:
                return f".{name}"
        return None
    if isinstance(value, Mapping) and isinstance(before, dict):
        for key, old in before.items():
            if key in value and (where := _changed(value[key], old)) is not None:
                return f"[{key!r}]{where}"
        return None
    if isinstance(value, (list, tuple)) and isinstance(before, list):
        for i, (item, old) in enumerate(zip(value, before, strict=False)):
            if (where := _changed(item, old)) is not None:
                return f"[{i}]{where}"
    return None


def _argument_names(fn: Callable, count: int) -> list[str]:
    """The learner's names for the first ``count`` positional arguments, or "argument i" where it has none."""
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"argument {i + 1}" for i in range(count)]


IN_PLACE = ("whoever called your function still holds that tensor (a cache, a figure's history, the model's "
            "weights); compute into a new tensor (x = x + ..., or x.clone() first)")


# --- k2lab's own implementations: seen while the learner's function runs ----------------------------------------


class _Calls:
    """Records which of the ``watched`` code objects run (directly or deep inside) while active, by a profile
    function (sys.setprofile: this thread only, and only where no profiler runs already)."""

    def __init__(self, watched: Mapping[CodeType, str]):
        self.watched = dict(watched)
        self.seen: list[str] = []
        self._active = False

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = self.watched.get(frame.f_code)
            if name is not None and name not in self.seen:
                self.seen.append(name)

    def __enter__(self) -> _Calls:
        self._active = bool(self.watched) and sys.getprofile() is None
        if self._active:
            sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._active:
            sys.setprofile(None)


def code_of(fn: Callable) -> CodeType:
    """The code object that runs when ``fn`` (a function, method, property or module class) is called."""
    if isinstance(fn, property):
        fn = fn.fget
    if isinstance(fn, type) and issubclass(fn, torch.nn.Module):
        fn = fn.forward
    return inspect.unwrap(fn).__code__


# --- running the learner's function -----------------------------------------------------------------------------


def call(fn: Callable, *args: Any, keep: bool | Sequence[int] = True, in_place: Mapping[int, str] | None = None,
         own: Mapping[Callable, str] | None = None, uses: Mapping[Callable, str] | None = None
         ) -> tuple[Any, Verdict | None]:
    """Run the learner's function on ``args`` -> (its output, None), or (None, a failing verdict) when it raised,
    ran out of time, changed an argument it was given or called k2lab's own answer. Global settings it changed are
    put back (and noted).

    ``keep``: the arguments that must come back unchanged (True: all; a list of their indices; False: none), with
    ``in_place`` the reason to give for some of them. ``own``: k2lab functions or module classes that ARE the
    answer (name for the verdict): calling one fails. ``uses``: k2lab pieces that may stand in for the learner's
    own, noted when used."""
    indices = range(len(args)) if keep is True else () if keep is False else keep
    kept = {i: _snapshot(args[i]) for i in indices}
    watched = {} if _REFERENCES.get() else {code_of(f): name for f, name in (own or {}).items()}
    watched |= {code_of(f): name for f, name in (uses or {}).items()}
    seconds = _TIME_LIMIT_S.get()
    calls = _Calls(watched)
    out, error = None, None
    try:
        with kept_settings(), calls, _deadline(seconds) as stop:
            try:
                out = fn(*args)
            finally:
                stop()
    except OutOfTime:
        return None, named(f"your function ran for {seconds:g} s without returning: an infinite loop? (a loop "
                           f"whose condition never turns false, or a `while` without its step); the check stopped it "
                           f"(exercises.time_limit(seconds) gives a slow answer more time)")
    except NotImplementedError:
        error = Verdict(False, "not written yet: replace `raise NotImplementedError` with your code")
    except Exception as err:  # the learner's code may raise anything; say what and keep the notebook running
        error = Verdict(False, f"your function raised {type(err).__name__}: {err}")
    for name in calls.seen:
        if (own or {}) and name in (own or {}).values():
            return None, named(f"your function calls k2lab's own {name}, which is the answer this check compares "
                               f"with; write the computation yourself (k2lab's source is there to read afterwards)")
        note(f"your function uses k2lab's {name} (a stand-in for your own)")
    if error is not None:
        return None, error
    names = _argument_names(fn, len(args))
    for i, before in kept.items():
        where = _changed(args[i], before)
        if where is not None:
            reason = (in_place or {}).get(i, IN_PLACE)
            return None, named(f"you changed your input `{names[i]}{where}` in place: {reason}")
    return out, None


def scales_with(fn: Callable, args: Sequence[Any], index: int, out: Any, factor: float = 2.0, *,
                atol: float = 1e-5, rtol: float = 1e-4) -> bool | None:
    """Whether the learner's output is multiplied by ``factor`` when argument ``index`` is (a property the right
    answer has: SwiGLU is linear in its up and down projections, say); None when the second run fails."""
    scaled = list(args)
    scaled[index] = args[index] * factor
    again, error = call(fn, *scaled, keep=False)
    first, second = as_tensor(out), as_tensor(again)
    if error is not None or first is None or second is None or first.shape != second.shape:
        return None
    return same(second, first * factor, atol + rtol * factor * first.double().abs().max().item(), rtol)


def gives(fn: Callable, args: Sequence[Any], expected: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-4) -> bool:
    """Whether the learner's ``fn(*args)`` runs and returns ``expected``: with one part of the inputs switched off (a
    zero), a wrong answer that comes out right there has that part right, so the mistake is in the other."""
    out, error = call(fn, *args, keep=False)
    return error is None and as_tensor(out) is not None and same(as_tensor(out), expected, atol, rtol)


def same(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    """Whether ``a`` and ``b`` have one shape and agree to ``atol``/``rtol`` (compared in float64)."""
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol)


def as_tensor(out: Any) -> torch.Tensor | None:
    """The learner's answer as a detached CPU tensor, or None when it is not one (nor convertible)."""
    if isinstance(out, torch.Tensor):
        return out.detach().cpu()
    try:
        return torch.as_tensor(out)
    except (TypeError, ValueError, RuntimeError):
        return None


def compare(what: str, out: Any, expected: torch.Tensor, mistakes: Mistakes = (), *,
            atol: float = 1e-5, rtol: float = 1e-4, axes: Mapping[int, str] | None = None,
            terms: Mapping[str, torch.Tensor] | None = None) -> Verdict:
    """Compare the learner's tensor with the expected one; name the mistake it matches, else say how it differs.
    All of them are compared on the CPU, wherever each was computed: in float64, which not every device has.
    ``mistakes`` may be a function that makes the list: it is called only when the answer is wrong. ``axes`` names
    the axes along which the answer may be right in some places and wrong in others ({1: "position"}), and
    ``terms`` tensors that a wrong answer may have added or left out ({"x": x}), for ``diagnose``."""
    if out is None:
        return named("your function returned None; did you forget `return`?", what)
    tensor = as_tensor(out)
    if tensor is None:
        return named(f"expected a tensor of shape {list(expected.shape)}, got a {type(out).__name__}", what)
    out, expected = tensor, torch.as_tensor(expected).detach().cpu()
    if out.numel() == expected.numel() == 1:  # a number: 0.5, tensor(0.5) and tensor([0.5]) alike
        out = out.reshape(expected.shape)
    if same(out, expected, atol, rtol):
        gap = (out.double() - expected.double()).abs().max().item() if out.numel() else 0.0
        return Verdict(True, f"{what}: matches k2lab (max |difference| {gap:.1e})")
    for message, candidate in (mistakes() if callable(mistakes) else mistakes):
        candidate = torch.as_tensor(candidate).detach().cpu()
        # A mistake is recognised up to rounding at the scale of its whole answer: computed in another order (or
        # in float64), its small entries may differ by more than their own size allows.
        loose = atol + rtol * candidate.double().abs().max().item() if candidate.numel() else atol
        if same(out, candidate, loose, rtol):
            return named(message, what)
    if out.shape != expected.shape:
        if out.numel() == expected.numel():
            return named(f"wrong shape: got {list(out.shape)}, expected {list(expected.shape)} (as many numbers: "
                         f"a reshape or an axis in the wrong place?)", what)
        return named(f"wrong shape: got {list(out.shape)}, expected {list(expected.shape)}", what)
    if not torch.isfinite(out).all():
        return named("your output has NaN or infinite values", what)
    diagnosis = diagnose(out, expected, atol, rtol, axes or {}, terms or {})
    if diagnosis is not None:
        return named(diagnosis, what)
    gap = (out.double() - expected.double()).abs().max().item()
    return Verdict(False, f"{what}: differs from k2lab by up to {gap:.3g} (and matches no common mistake we know)")


def _constant(values: torch.Tensor, tolerance: float = 1e-4) -> bool:
    values = values[torch.isfinite(values)]
    return values.numel() > 0 and bool(values.std(correction=0) <= tolerance * values.abs().mean())


def _indices(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def diagnose(out: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, axes: Mapping[int, str],
             terms: Mapping[str, torch.Tensor] | None = None) -> str | None:
    """How a wrong answer of the right shape differs, where the difference has a shape that says something: the
    right numbers in another order, one factor for the whole answer, one per row or one per feature (the last axis),
    one constant added, a multiple of one of ``terms`` added (or taken away), or right at some indices of a named
    axis and wrong at others. None when it has none."""
    o, e = out.double(), expected.double()
    if o.numel() > 1 and torch.allclose(o.flatten().sort().values, e.flatten().sort().values, atol=atol, rtol=rtol):
        return ("your numbers are the right ones in another order: an axis transposed or permuted (compare your "
                "layout with the docstring's shapes)")
    scale = e.abs().max()
    big = e.abs() > 1e-3 * scale
    ratio = torch.where(big, o / e, torch.nan)
    if big.sum() > 1 and _constant(ratio) and abs(ratio[big].mean() - 1) > 1e-3:
        return f"wrong scale: yours is {ratio[big].mean().item():.4g} times the right answer"
    if o.ndim >= 2 and o.shape[-1] > 1 and o.numel() > o.shape[-1]:
        rows, cols = ratio.reshape(-1, o.shape[-1]), ratio.reshape(-1, o.shape[-1]).T
        for lines, what, cause in ((rows, "row (along the last axis)", "what each row is divided or multiplied by"),
                                   (cols, "feature (the last axis)", "a per-feature factor (a weight)")):
            factors = torch.stack([line[torch.isfinite(line)].mean() if torch.isfinite(line).any() else
                                   torch.tensor(torch.nan, dtype=line.dtype) for line in lines])
            if all(_constant(line) for line in lines if torch.isfinite(line).any()) and not _constant(factors, 1e-3):
                low, high = factors[torch.isfinite(factors)].aminmax()
                return (f"each {what} is off by its own factor ({low.item():.3g} to {high.item():.3g} times the right "
                        f"one): {cause} is wrong")
    diff = o - e
    if o.numel() > 1 and diff.std(correction=0) <= atol + rtol * scale and diff.mean().abs() > atol + rtol * scale:
        return f"yours is the right answer plus a constant ({diff.mean().item():.4g}) everywhere"
    for name, term in (terms or {}).items():
        t = torch.as_tensor(term).detach().double().cpu().expand_as(o)
        if t.abs().max() == 0:
            continue
        c = (diff * t).sum() / (t * t).sum()  # the best multiple of the term
        if abs(c) > 1e-3 and same(diff, c * t, atol + rtol * scale, rtol):
            if abs(c - 1) < 1e-3:
                return f"yours is the right answer plus {name}: it has no place in the result"
            if abs(c + 1) < 1e-3:
                return f"yours is the right answer minus {name}: you left {name} out"
            return f"yours is the right answer plus {c.item():.3g} times {name}"
    for axis, name in axes.items():
        if axis >= o.ndim or o.shape[axis] < 2:
            continue
        matches = [same(o.select(axis, i), e.select(axis, i), atol, rtol) for i in range(o.shape[axis])]
        if any(matches) and not all(matches):
            right = [i for i, m in enumerate(matches) if m]
            wrong = [i for i, m in enumerate(matches) if not m]
            return f"yours is right at {name} {_indices(right)} and wrong at {name} {_indices(wrong)}"
    return None


# --- watching how an answer is computed --------------------------------------------------------------------------


def _normalised(values: torch.Tensor) -> torch.Tensor:
    """The values, divided by the one of largest magnitude (sign included), sorted: the same for any layout of the
    same numbers and for any nonzero multiple of them."""
    flat = values.detach().double().cpu().flatten()
    if flat.numel() == 0:
        return flat
    peak = flat[flat.abs().argmax()]
    return (flat / peak if peak != 0 else flat).sort().values


class _CurrentFunction(TorchFunctionMode):
    """Keeps the name of the outermost torch function running (``einsum``, ``matmul``, ...) for the ``Watch``."""

    def __init__(self, stack: list[str]):
        super().__init__()
        self.stack = stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name == "einsum":  # "einsum of 3": torch picks the order of its contractions
            name = f"einsum of {sum(isinstance(t, torch.Tensor) for t in tree_leaves(list(args[1:])))}"
        self.stack.append(name)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.stack.pop()


@dataclass
class _Target:
    name: str
    values: torch.Tensor  # [numel] normalised
    position: int | None  # the sequence position this piece holds alone, None for pieces over every position
    any_scale: bool = True  # matched at any nonzero multiple, else as these very numbers


class Watch(TorchDispatchMode):
    """Sees every tensor that an operation makes while the learner's code runs under ``with watch:``, to check HOW
    an answer was computed, not only what it is.

    ``shapes`` and ``dtypes`` record every result. ``forbid(name, t, ...)`` names a tensor the code must not build,
    in any layout (the same numbers in any order), at any scale (any nonzero multiple), whole or in the pieces a loop
    would make (per batch row, per head, per position, any mix). ``found`` lists the names seen; ``inside[name]`` the
    torch function that built it (``"einsum of 3"``: torch chose the order of a three-operand einsum). Pieces that
    hold one position count only when two positions or more turn up, so that a query at position 0, which attends
    to key 0 alone, is not mistaken for its key."""

    def __init__(self, atol: float = 1e-4):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: set[torch.dtype] = set()
        self.found: list[str] = []
        self.inside: dict[str, str | None] = {}
        self.atol = atol
        self._targets: dict[int, list[_Target]] = {}  # numel -> targets
        self._positions: dict[str, set[int]] = {}
        self._functions: list[str] = []
        self._function_mode = _CurrentFunction(self._functions)

    def forbid(self, name: str, t: torch.Tensor, loop_dims: Sequence[int] = (), position_dim: int | None = None,
               any_scale: bool = True) -> Watch:
        """Forbid ``t`` and every piece a loop over some of ``loop_dims`` makes of it (``position_dim``, one of
        them, is the sequence axis); ``any_scale=False`` looks for these very numbers only (to see whether a step
        was taken: G divided by its norm, say)."""
        for piece, index in _slices(t, loop_dims):
            position = index.get(position_dim) if position_dim is not None else None
            values = _normalised(piece) if any_scale else piece.detach().double().cpu().flatten().sort().values
            self._targets.setdefault(piece.numel(), []).append(_Target(name, values, position, any_scale))
        return self

    def __enter__(self) -> Watch:
        self._function_mode.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._function_mode.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for result in tree_leaves(out):
            if isinstance(result, torch.Tensor):
                self.shapes.append(tuple(result.shape))
                self.dtypes.add(result.dtype)
                self._look_for_forbidden(result)
        return out

    def _look_for_forbidden(self, result: torch.Tensor) -> None:
        targets = self._targets.get(result.numel(), ())
        if not targets or not result.is_floating_point() or result.device.type == "meta":
            return
        values = _normalised(result)
        exact = result.detach().double().cpu().flatten().sort().values
        for target in targets:
            mine = values if target.any_scale else exact
            if target.name in self.found or not torch.allclose(mine, target.values, atol=self.atol, rtol=0):
                continue
            if target.position is not None:
                positions = self._positions.setdefault(target.name, set())
                positions.add(target.position)
                if len(positions) < 2:
                    continue
            self.found.append(target.name)
            self.inside[target.name] = self._functions[0] if self._functions else None


def _slices(t: torch.Tensor, loop_dims: Sequence[int]) -> Iterator[tuple[torch.Tensor, dict[int, int]]]:
    """``t`` and every slice of it that a loop over some of ``loop_dims`` would make (per head, per row, both), each
    with the index it took along each sliced dim: the pieces a learner who builds a forbidden tensor one head (or
    one position) at a time makes instead of the whole."""
    for r in range(len(loop_dims) + 1):
        for dims in itertools.combinations(loop_dims, r):
            for index in itertools.product(*(range(t.shape[d]) for d in dims)):
                piece = t
                for d, i in sorted(zip(dims, index, strict=True), reverse=True):  # the last dim first keeps indices
                    piece = piece.select(d, i)
                yield piece, dict(zip(dims, index, strict=True))
