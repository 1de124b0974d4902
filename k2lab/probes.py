"""Hook points: named places on the forward path where a probe can read or replace a tensor.

A probe's name is its module path plus a ``hook_`` leaf (``layers.3.mlp.gate.hook_topk_idx``), so the name
says where it lives and leads to the neighbouring weights in the checkpoint. Hook functions follow the
TransformerLens convention: ``fn(tensor, hook) -> None | replacement``, with ``hook.name`` the probe's name.

A hook point with nothing attached is a Python attribute test and a return: it costs nothing measurable and
keeps no tensor alive. Expensive quantities (attention patterns) are computed only when a probe asks.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

HookFn = Callable[[torch.Tensor, "HookPoint"], torch.Tensor | None]
NameFilter = str | Iterable[str] | Callable[[str], bool] | None  # see HookedModule.select_hook_names


class HookPoint(nn.Module):
    """Identity on the forward path. Attached functions may read the tensor or return a replacement."""

    def __init__(self) -> None:
        super().__init__()
        self.name = ""  # set by the model from the module path
        self.fns: list[HookFn] = []

    @property
    def active(self) -> bool:
        """True when some function is attached, so the caller should materialise what this probe shows."""
        return bool(self.fns)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # bypasses nn.Module's call machinery: it is hot
        for fn in self.fns:
            out = fn(x, self)
            if out is not None:
                if not isinstance(out, torch.Tensor) or out.shape != x.shape:
                    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    raise ValueError(f"hook on {self.name} returned {got}; expected a tensor of {tuple(x.shape)}")
                x = out
        return x

    def extra_repr(self) -> str:
        return self.name


class HookedModule(nn.Module):
    """Mixin for the root model: names every HookPoint by its path and attaches hooks by name or predicate."""

    def name_hook_points(self) -> None:
        self._hook_points = {name: m for name, m in self.named_modules() if isinstance(m, HookPoint)}
        for name, point in self._hook_points.items():
            point.name = name

    def hook_names(self) -> list[str]:
        """Every probe, in forward order."""
        return list(self._hook_points)

    def hook_point(self, name: str) -> HookPoint:
        return self.resolve_hook_names(name)[0][1]

    def resolve_hook_names(self, selector: str | Callable[[str], bool]) -> list[tuple[str, HookPoint]]:
        """Probes matching an exact name or a predicate; an unmatched selector raises with the closest names."""
        if callable(selector):
            found = [(n, p) for n, p in self._hook_points.items() if selector(n)]
            if not found:
                raise KeyError("the hook predicate matched no probe; see model.hook_names()")
            return found
        if selector in self._hook_points:
            return [(selector, self._hook_points[selector])]
        close = difflib.get_close_matches(selector, self._hook_points, n=5, cutoff=0.5)
        raise KeyError(f"no probe named {selector!r}; closest: {close or 'none'} (see model.hook_names())")

    def select_hook_names(self, names: NameFilter) -> list[str]:
        """``None`` (all), a list of exact names, a substring, or a predicate -> matching probe names."""
        if names is None:
            return self.hook_names()
        if callable(names):
            return [n for n, _ in self.resolve_hook_names(names)]
        if isinstance(names, str):
            if names in self._hook_points:
                return [names]
            found = [n for n in self._hook_points if names in n]
            if not found:
                self.resolve_hook_names(names)  # raises with suggestions
            return found
        return [n for name in names for n, _ in self.resolve_hook_names(name)]

    @contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[str | Callable[[str], bool], HookFn]] = ()) -> Iterator[None]:
        """Attach ``(name_or_predicate, fn)`` pairs for the duration of the block; removed on exit, even on error.

        >>> with model.hooks(fwd_hooks=[("layers.1.hook_attn_out", lambda t, hook: t * 0)]):
        ...     logits = model(ids)
        """
        attached: list[tuple[HookPoint, HookFn]] = []
        try:
            for selector, fn in fwd_hooks:
                for _, point in self.resolve_hook_names(selector):
                    point.fns.append(fn)
                    attached.append((point, fn))
            yield
        finally:
            for point, fn in reversed(attached):
                point.fns.remove(fn)

    def reset_hooks(self) -> None:
        """Detach every function from every probe (a safety net for interactive sessions)."""
        for point in self._hook_points.values():
            point.fns.clear()
