"""Hook points: named places on the forward path where a probe can read or replace a tensor (and its gradient).

A probe's name is its module path plus a ``hook_`` leaf (``layers.3.mlp.gate.hook_topk_idx``), so the name
says where it lives and leads to the neighbouring weights in the checkpoint. Hook functions follow the
TransformerLens convention: ``fn(tensor, hook) -> None | replacement``, with ``hook.name`` the probe's name.

A HookPoint is an ordinary ``nn.Module`` called through ``nn.Module.__call__``, so PyTorch forward hooks fire on
it and nnsight sees it: ``NNsight(model).layers[3].mlp.gate.hook_topk_idx.output`` reads or sets that probe. With
nothing attached, PyTorch's call goes straight to ``forward``, an empty loop and a return: a probe costs about
1.5 microseconds (0.1 ms for the ~90 probes of a decode step) and keeps no tensor alive. Expensive quantities
(attention patterns) are computed only when something reads their probe (``HookPoint.active``).

Selecting probes, everywhere a selector is taken (``run_with_cache(names=)``, ``hooks(fwd_hooks=[(selector, fn)])``,
``interventions.patch``): an exact name, a run of whole name components (``"hook_resid_post"``: every layer's;
``"layers.1"``: layer 1's probes, not layers 10-19's; ``"mlp.gate"``), a predicate on the name, or a list of any of
these. A part of a component (``"hook_resid"``) selects nothing and raises with the closest names. Short
TransformerLens-style names: ``get_act_name("resid_post", 3)``.

    logits, cache = model.run_with_cache(ids, names="hook_resid_post")     # read (see activation_cache.py)
    with model.hooks(fwd_hooks=[("layers.1.hook_attn_out", lambda t, hook: 0 * t)]):
        ablated = model(ids)                                                # edit; detached on exit
    with model.hooks(bwd_hooks=[("hook_resid_mid", lambda g, hook: print(hook.name, g.norm()))]):
        model(ids, return_type="loss").backward()                          # gradients, inside the block

TransformerLens's spellings work too: ``model.run_with_hooks(ids, fwd_hooks=[...])`` (one forward inside such a
block), ``model.add_hook(selector, fn, dir="fwd" | "bwd")`` (attached until ``model.reset_hooks()``, which detaches
every hook but those of a block still open: a ``hooks`` block, and the interventions and splices built on it, hold
until they exit, as TransformerLens keeps spliced SAEs through ``reset_hooks()``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Literal

import torch
from torch import nn

from .layers import HookFn, HookPoint

Selector = str | Callable[[str], bool]
NameFilter = Selector | Iterable[Selector] | None  # see HookedModule.select_hook_names
Hooks = Iterable[tuple[NameFilter, HookFn]]  # (selector, fn) pairs

# Short names (TransformerLens habit) -> the probe's path inside layer i, or its whole name for model-level probes.
LAYER_PROBES = {
    "resid_pre": "hook_resid_pre", "resid_mid": "hook_resid_mid", "resid_post": "hook_resid_post",
    "ln1": "input_layernorm.hook_out", "ln2": "post_attention_layernorm.hook_out",
    "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out",
    "q_latent": "self_attn.hook_q_latent", "kv_latent": "self_attn.hook_kv_latent",
    "q_nope": "self_attn.hook_q_nope", "q_pe": "self_attn.hook_q_pe", "rot_q_pe": "self_attn.hook_rot_q_pe",
    "k_pe": "self_attn.hook_k_pe", "rot_k_pe": "self_attn.hook_rot_k_pe",
    "attn_scores": "self_attn.hook_attn_scores", "max_logit": "self_attn.hook_max_logit",
    "pattern": "self_attn.hook_pattern", "z": "self_attn.hook_z",
    "router_logits": "mlp.gate.hook_logits", "scores": "mlp.gate.hook_scores",
    "choice_scores": "mlp.gate.hook_choice_scores", "topk_idx": "mlp.gate.hook_topk_idx",
    "topk_weights": "mlp.gate.hook_topk_weights", "expert_out": "mlp.hook_expert_out",
    "routed_out": "mlp.hook_routed_out", "shared_out": "mlp.hook_shared_out",
}
MODEL_PROBES = {"embed": "embed_tokens.hook_out", "final_norm": "norm.hook_out", "logits": "hook_logits"}


# TransformerLens spellings of probe paths -> k2lab's, accepted wherever a probe name is (k2lab's stay the documented
# ones): blocks.{i}. for layers.{i}., attn. for self_attn., ln1/ln2/ln_final.hook_normalized for the norms' hook_out.
TL_PATHS = [
    (re.compile(r"^blocks\.(\d+)\."), r"layers.\1."),
    (re.compile(r"^layers\.(\d+)\.attn\."), r"layers.\1.self_attn."),
    (re.compile(r"^layers\.(\d+)\.ln1\.hook_normalized"), r"layers.\1.input_layernorm.hook_out"),
    (re.compile(r"^layers\.(\d+)\.ln2\.hook_normalized"), r"layers.\1.post_attention_layernorm.hook_out"),
    (re.compile(r"^ln_final\.hook_normalized"), "norm.hook_out"),
    (re.compile(r"^hook_embed$"), "embed_tokens.hook_out"),
]


def canonical_probe_name(name: str) -> str:
    """k2lab's spelling of a probe name or name fragment given in TransformerLens's: ``"blocks.3.attn.hook_z"`` ->
    ``"layers.3.self_attn.hook_z"``; any other string is returned as it is."""
    if not name.startswith(("blocks.", "ln_final.", "hook_embed")):
        return name
    for pattern, replacement in TL_PATHS:
        name = pattern.sub(replacement, name)
    return name


def get_act_name(name: str, layer: int | None = None) -> str:
    """The probe name of a short name: ``get_act_name("resid_post", 3)`` -> ``"layers.3.hook_resid_post"``,
    ``get_act_name("logits")`` -> ``"hook_logits"``. Short names are the probe leaves without ``hook_`` (the gate's
    logits are ``"router_logits"``); a full probe name is returned as it is. See LAYER_PROBES and MODEL_PROBES."""
    if layer is None:
        if name in MODEL_PROBES:
            return MODEL_PROBES[name]
        if "hook_" in name:
            return name
        if name in LAYER_PROBES:
            raise ValueError(f"{name!r} is a per-layer probe: give its layer, e.g. get_act_name({name!r}, 0)")
    else:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer must be a non-negative integer, got {layer!r}")
        if name in LAYER_PROBES:
            return f"layers.{layer}.{LAYER_PROBES[name]}"
        if name in MODEL_PROBES:
            raise ValueError(f"{name!r} is a model-level probe ({MODEL_PROBES[name]}): give no layer")
    close = difflib.get_close_matches(name, [*LAYER_PROBES, *MODEL_PROBES], n=5, cutoff=0.5)
    raise KeyError(f"no probe has the short name {name!r}; closest: {close or 'none'} "
                   f"(short names: {sorted(LAYER_PROBES)} per layer, {sorted(MODEL_PROBES)} for the model)")


def has_components(name: str, selector: str) -> bool:
    """Whether the dotted ``selector`` is a run of whole components of the probe ``name``: ``"layers.1"`` and
    ``"hook_resid_post"`` of ``"layers.1.hook_resid_post"``, but not ``"layers.1"`` of ``"layers.12.hook_z"`` nor
    ``"hook_resid"`` of anything."""
    parts, wanted = name.split("."), selector.strip(".").split(".")
    return any(parts[i : i + len(wanted)] == wanted for i in range(len(parts) - len(wanted) + 1))


def one_selector(names: NameFilter, names_filter: NameFilter) -> NameFilter:
    """``names=`` and TransformerLens' ``names_filter=`` are two spellings of one probe selector: the one given."""
    if names is not None and names_filter is not None:
        raise ValueError("give exactly one of names= and names_filter= (two spellings of the same selector), not both")
    return names if names is not None else names_filter


def hook_triples(fwd_hooks: Hooks, bwd_hooks: Hooks) -> list[tuple[NameFilter, HookFn, str]]:
    """The ``(selector, fn)`` pairs of ``fwd_hooks`` and ``bwd_hooks`` as ``(selector, fn, "fwd" | "bwd")``; a pair
    of any other form raises."""
    triples = []
    for dir, pairs in (("fwd", fwd_hooks), ("bwd", bwd_hooks)):
        if pairs is None or isinstance(pairs, str | tuple) and len(pairs) == 2 and callable(pairs[1]):
            raise ValueError(f"{dir}_hooks takes a list of (selector, fn) pairs, e.g. {dir}_hooks=[(name, fn)]; got "
                             f"{pairs!r}" + (" (one pair: wrap it in a list)" if pairs is not None else ""))
        for pair in pairs:
            if not (isinstance(pair, tuple | list) and len(pair) == 2 and callable(pair[1])):
                raise ValueError(f"{dir}_hooks takes (selector, fn) pairs with fn(tensor, hook); got {pair!r}")
            triples.append((pair[0], pair[1], dir))
    return triples


class HookedModule(nn.Module):
    """Mixin for the root model: names every HookPoint by its path and attaches hooks by selector."""

    def __init__(self) -> None:
        super().__init__()
        self._open_blocks: list[list[tuple[list[HookFn], HookFn]]] = []  # what each open ``hooks`` block attached

    def name_hook_points(self) -> None:
        """Name every HookPoint by its module path (``layers.3.mlp.gate.hook_topk_idx``) and index them by name; the
        model calls it once its modules are built."""
        self._hook_points = {name: m for name, m in self.named_modules() if isinstance(m, HookPoint)}
        for name, point in self._hook_points.items():
            point.name = name

    def is_observed(self) -> bool:
        """True when code other than k2lab's and PyTorch's may see the forward's tensors, which a compiled graph would
        not run (``generate(compile=True)`` then runs eagerly): a function on a probe, a PyTorch forward hook on a
        module or on every module, a wrapper in place of a module's ``forward`` (nnsight's, from ``NNsight(model)`` on),
        or a module of any other class spliced into the model. One walk over the module tree."""
        registries = torch.nn.modules.module  # hooks registered for every module (register_module_forward_hook)
        if getattr(registries, "_global_forward_hooks", None) or getattr(registries, "_global_forward_pre_hooks", None):
            return True
        for module in self.modules():
            if isinstance(module, HookPoint):
                if module.active:
                    return True
            elif (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__
                  or not type(module).__module__.startswith(("k2lab.", "torch."))):
                return True
        return False

    def hook_names(self) -> list[str]:
        """Every probe, layer by layer in module order (a cache from run_with_cache is in firing order)."""
        return list(self._hook_points)

    def hook_point(self, name: str) -> HookPoint:
        """The probe of this exact name, or its TransformerLens spelling (raises with the closest names)."""
        name = canonical_probe_name(name)
        if name not in self._hook_points:
            close = difflib.get_close_matches(name, self._hook_points, n=5, cutoff=0.5)
            raise KeyError(f"no probe named {name!r}; closest: {close or 'none'} (see model.hook_names())")
        return self._hook_points[name]

    def select_hook_names(self, names: NameFilter) -> list[str]:
        """Probe names chosen by ``names``: None (all), an exact name, a run of whole name components (``"layers.1"``:
        layer 1's probes; ``"hook_z"``: every layer's), a predicate, or a list of these (their union, in module order);
        TransformerLens's ``blocks.{i}.`` spellings work (``canonical_probe_name``). A selector that matches nothing
        raises with the closest names."""
        if names is None:
            return self.hook_names()
        if callable(names):
            found = [n for n in self._hook_points if names(n)]
            if not found:
                raise KeyError("the name predicate matched no probe; see model.hook_names()")
            return found
        if isinstance(names, str):
            names = canonical_probe_name(names)
            if names in self._hook_points:
                return [names]
            found = [n for n in self._hook_points if has_components(n, names)]
            if not found:
                self.hook_point(names)  # raises with suggestions
            return found
        if not isinstance(names, Iterable):
            raise ValueError(f"a probe selector is a name, a substring, a predicate or a list of these; got {names!r}")
        chosen = {n for selector in names for n in self.select_hook_names(selector)}
        return [n for n in self._hook_points if n in chosen]

    @contextmanager
    def hooks(self, fwd_hooks: Hooks = (), bwd_hooks: Hooks = ()) -> Iterator[None]:
        """Attach ``(selector, fn)`` pairs for the duration of the block; removed on exit, even on error.

        ``fwd_hooks``: ``fn(activation, hook)`` may return a replacement of the same shape and dtype.
        ``bwd_hooks``: ``fn(grad, hook)`` sees the gradient of the probe's tensor (of whatever is differentiated,
        with respect to the activation) and may return a replacement; run backward inside the block.

        >>> with model.hooks(fwd_hooks=[("layers.1.hook_attn_out", lambda t, hook: t * 0)]):
        ...     logits = model(ids)
        """
        attached: list[tuple[list[HookFn], HookFn]] = []
        self._open_blocks.append(attached)  # what reset_hooks() keeps
        try:
            for selector, fn, dir in hook_triples(fwd_hooks, bwd_hooks):
                attached += [(fns, fn) for fns in self._attach(selector, fn, dir)]
            yield
        finally:
            self._open_blocks = [block for block in self._open_blocks if block is not attached]
            for fns, fn in reversed(attached):
                if any(f is fn for f in fns):  # a splice closed inside the block may have taken its probe away
                    del fns[max(i for i, f in enumerate(fns) if f is fn)]

    def add_hook(self, name: NameFilter, fn: HookFn, dir: Literal["fwd", "bwd"] = "fwd") -> None:
        """TransformerLens's ``add_hook``: attach ``fn`` to every probe ``name`` selects (a name, substring, predicate
        or list, as ``select_hook_names`` takes) until ``model.reset_hooks()``. ``dir="fwd"``: ``fn(activation, hook)``
        at each forward; ``dir="bwd"``: ``fn(grad, hook)`` at each backward. Either may return a replacement."""
        self._attach(name, fn, dir)

    def _attach(self, selector: NameFilter, fn: HookFn, dir: str) -> list[list[HookFn]]:
        """Append ``fn`` to the forward (``dir="fwd"``) or backward (``"bwd"``) functions of every selected probe ->
        the lists it was appended to."""
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"dir must be 'fwd' or 'bwd', got {dir!r}")
        if not callable(fn):
            raise ValueError(f"a hook is a function fn(tensor, hook); got {fn!r}")
        points = [self._hook_points[name] for name in self.select_hook_names(selector)]
        lists = [point.fns if dir == "fwd" else point.bwd_fns for point in points]
        for fns in lists:
            fns.append(fn)
        return lists

    def run_with_hooks(self, input_ids: torch.Tensor | str | list[str], fwd_hooks: Hooks = (), bwd_hooks: Hooks = (),
                       reset_hooks_end: bool = True, **forward_kwargs) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """TransformerLens's spelling: ``model(input_ids, **forward_kwargs)`` with the ``(selector, fn)`` pairs of
        ``fwd_hooks`` and ``bwd_hooks`` attached -> what the forward returns.

        ``reset_hooks_end=True``: the hooks are detached when the forward returns (``with model.hooks(...)``), so
        backward hooks, which run at a later ``.backward()``, are refused. ``False``: they stay attached, as
        ``add_hook`` attaches them, so a later ``.backward()`` runs the backward ones, until ``model.reset_hooks()``.
        """
        if not isinstance(reset_hooks_end, bool):
            raise ValueError(f"reset_hooks_end must be True or False, got {reset_hooks_end!r}")
        triples = hook_triples(fwd_hooks, bwd_hooks)
        if not reset_hooks_end:
            for selector, fn, dir in triples:
                self._attach(selector, fn, dir)
            return self(input_ids, **forward_kwargs)
        if any(dir == "bwd" for _, _, dir in triples):
            raise ValueError("bwd_hooks run during a .backward() after run_with_hooks returns, but "
                             "reset_hooks_end=True detaches them when it returns: pass reset_hooks_end=False (and call "
                             "model.reset_hooks() after the backward), or run the backward inside "
                             "`with model.hooks(bwd_hooks=...)`")
        with self.hooks(fwd_hooks=[(selector, fn) for selector, fn, _ in triples]):
            return self(input_ids, **forward_kwargs)

    def reset_hooks(self) -> None:
        """Detach every function that ``add_hook`` (or ``run_with_hooks(reset_hooks_end=False)``) attached to a probe,
        and any other a session lost track of: the way out of stray hooks. The hooks of a block still open (``with
        model.hooks(...)``, and the interventions and splices built on it) stay until that block exits, as
        TransformerLens keeps spliced SAEs through ``reset_hooks()``."""
        held: dict[tuple[int, int], int] = {}  # (id of a probe's list, id of a function) -> how many open blocks hold
        for block in self._open_blocks:
            for fns, fn in block:
                held[id(fns), id(fn)] = held.get((id(fns), id(fn)), 0) + 1
        for point in self._hook_points.values():
            for fns in (point.fns, point.bwd_fns):
                kept = []
                for fn in fns:
                    if held.get((id(fns), id(fn)), 0) > 0:
                        held[id(fns), id(fn)] -= 1
                        kept.append(fn)
                fns[:] = kept

    def run_with_cache(self, input_ids: torch.Tensor | str | list[str], names: NameFilter = None,
                       device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
                       names_filter: NameFilter = None, incl_bwd: bool = False,
                       metric: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       **forward_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward once and record the probes selected by ``names`` (or ``names_filter``, the same) ->
        ``(output, record)``, ``output`` what ``model(input_ids, **forward_kwargs)`` returns and ``record`` {probe name:
        tensor} in firing order (``K2Model.run_with_cache`` wraps it in an ``ActivationCache``).

        ``names``: None (every probe), an exact name, a substring (``"hook_resid_post"``), a predicate, or a list.
        Tensors are stored detached (the forward still builds its graph if grad is on), moved to ``device`` and, if
        floating point, cast to ``dtype`` when given. Recording hooks go after any already attached, so a cache
        taken inside ``model.hooks(...)`` holds the edited activations. Asking for ``hook_pattern`` or
        ``hook_attn_scores`` makes the naive attention path leave its fused kernel for an explicit softmax.

        ``incl_bwd=True``: the output must be a scalar (``return_type="loss"``, or "both", whose loss is used), or
        ``metric(output)`` must be, when a metric is given (a logit difference, say); its gradient with respect to
        every selected probe is stored as ``name + "_grad"`` (through ``torch.autograd.grad``: parameters' ``.grad``
        are left alone). Probes that carry no gradient (the integer ``hook_topk_idx``, the detached
        ``hook_max_logit``, and ``hook_choice_scores``, which only ranks experts) get no ``_grad`` entry.
        """
        names = one_selector(names, names_filter)
        if metric is not None and not incl_bwd:
            raise ValueError("metric= names what incl_bwd=True differentiates; without incl_bwd there is no gradient")
        selected = self.select_hook_names(names)
        store: dict[str, torch.Tensor] = {}
        live: dict[str, torch.Tensor] = {}  # with incl_bwd: the activations themselves, to differentiate against

        def stored(tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor.detach()
            if device is not None or dtype is not None:
                tensor = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
            return tensor

        def record(tensor: torch.Tensor, hook: HookPoint) -> None:
            if incl_bwd and tensor.requires_grad:
                live[hook.name] = tensor
            store[hook.name] = stored(tensor)

        with torch.enable_grad() if incl_bwd else nullcontext(), self.hooks(fwd_hooks=[(selected, record)]):
            output = self(input_ids, **forward_kwargs)
            if incl_bwd:
                scalar = metric(output) if metric is not None else output[1] if isinstance(output, tuple) else output
                if not isinstance(scalar, torch.Tensor) or scalar.numel() != 1 or not scalar.requires_grad:
                    got = tuple(scalar.shape) if isinstance(scalar, torch.Tensor) else type(scalar).__name__
                    if isinstance(scalar, torch.Tensor) and scalar.numel() == 1:
                        got = f"{got}, which does not depend on the model (no gradient)"
                    if metric is not None:
                        raise ValueError(f"incl_bwd=True differentiates metric(output), which must be a scalar "
                                         f"tensor; the metric returned {got}")
                    raise ValueError(f"incl_bwd=True differentiates a scalar output, e.g. return_type='loss'; the "
                                     f"forward returned {got}")
                grads = torch.autograd.grad(scalar, list(live.values()), allow_unused=True)
                for name, grad in zip(list(live), grads, strict=True):
                    if grad is not None:
                        store[name + "_grad"] = stored(grad)
        return output, store
