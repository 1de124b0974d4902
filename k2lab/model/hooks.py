"""Hook points: named places on the forward path where a probe can read or replace a tensor.

A probe's name is its module path plus a ``hook_`` leaf (``layers.3.mlp.gate.hook_topk_idx``), so the name
says where it lives and leads to the neighbouring weights in the checkpoint. Hook functions follow the
TransformerLens convention: ``fn(tensor, hook) -> None | replacement``, with ``hook.name`` the probe's name.

A hook point with nothing attached is a Python attribute test and a return: it costs nothing measurable and
keeps no tensor alive. Expensive quantities (attention patterns) are computed only when a probe asks.

    logits, cache = model.run_with_cache(ids, names="hook_resid_post")     # read (see activation_cache.py)
    with model.hooks(fwd_hooks=[("layers.1.hook_attn_out", lambda t, hook: 0 * t)]):
        ablated = model(ids)                                                # edit; detached on exit
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # the model package imports no analysis at import time (data flows model -> analysis)
    from ..analysis.cache import ActivationCache

HookFn = Callable[[torch.Tensor, "HookPoint"], torch.Tensor | None]
NameFilter = str | Iterable[str] | Callable[[str], bool] | None  # see HookedModule.select_hook_names
FwdHooks = Iterable[tuple[str | Callable[[str], bool], HookFn]]  # (exact name or predicate, fn) pairs


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
        """Every probe, layer by layer in module order (a cache from run_with_cache is in firing order)."""
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
    def hooks(self, fwd_hooks: FwdHooks = ()) -> Iterator[None]:
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

    def run_with_hooks(self, input_ids: torch.Tensor, fwd_hooks: FwdHooks = (), **forward_kwargs) -> torch.Tensor:
        """``model(input_ids, **forward_kwargs)`` with ``fwd_hooks`` attached for this one forward."""
        with self.hooks(fwd_hooks=fwd_hooks):
            return self(input_ids, **forward_kwargs)

    def run_with_cache(self, input_ids: torch.Tensor, names: NameFilter = None,
                       device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                       **forward_kwargs) -> tuple[torch.Tensor, ActivationCache]:
        """Forward once and record the probes selected by ``names`` -> ``(logits, cache)``.

        ``names``: None (every probe), a list of exact names, a substring (``"hook_resid_post"``) or a predicate.
        Tensors are stored detached (the forward still builds its graph if grad is on), moved to ``device`` and, if
        floating point, cast to ``dtype`` when given. Recording hooks go after any already attached, so a cache
        taken inside ``model.hooks(...)`` holds the edited activations. Asking for ``hook_pattern`` or
        ``hook_attn_scores`` makes the naive attention path leave its fused kernel for an explicit softmax.
        """
        store: dict[str, torch.Tensor] = {}

        def record(tensor: torch.Tensor, hook: HookPoint) -> None:
            tensor = tensor.detach()
            if device is not None or dtype is not None:
                tensor = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
            store[hook.name] = tensor

        with self.hooks(fwd_hooks=[(name, record) for name in self.select_hook_names(names)]):
            logits = self(input_ids, **forward_kwargs)
        from ..analysis.cache import ActivationCache  # the cache type is analysis; imported on first use

        return logits, ActivationCache(store, self)

    def reset_hooks(self) -> None:
        """Detach every function from every probe (a safety net for interactive sessions)."""
        for point in self._hook_points.values():
            point.fns.clear()
