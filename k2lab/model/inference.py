"""Speed room: inference mode for ``k2lab.generate`` and its compiled step, when nothing observes the model.

Replaces ``torch.no_grad`` around generation. Inference mode also skips the bookkeeping that no_grad keeps on every
op (version counters, a record of each view): about a tenth to a fifth of K2-nano's generation on the CPU
(docs/speed.md). Its tensors can never enter autograd later, so it is used only when no code but k2lab's and
PyTorch's could keep one (``is_observed``); what generate returns and what the cache keeps are ordinary tensors
either way. A plain ``model(ids)`` never switches by itself: it runs as its caller's mode says.
"""

from __future__ import annotations

import torch
from torch import nn


def is_observed(model: nn.Module) -> bool:
    """True when code other than k2lab's and PyTorch's may see the forward's tensors: a function on a probe (k2lab's,
    PyTorch's or an nnsight trace: ``HookPoint.active``), a PyTorch forward hook on any other module or on every
    module, a wrapper in place of a module's ``forward`` that may run now (``forward_wrapper_runs``), or a module of
    any other class spliced into the model (it could keep what it sees). One walk over the module tree."""
    from .hooks import HookPoint  # hooks.py imports this module

    # Hooks registered for every module (nn.modules.module.register_module_forward_hook) live in these registries.
    if (getattr(torch.nn.modules.module, "_global_forward_hooks", None)
            or getattr(torch.nn.modules.module, "_global_forward_pre_hooks", None)):
        return True
    for module in model.modules():
        if isinstance(module, HookPoint):
            if module.active:
                return True
        elif (module._forward_hooks or module._forward_pre_hooks or forward_wrapper_runs(module)
              or not type(module).__module__.startswith(("k2lab.", "torch."))):
            return True
    return False


def forward_wrapper_runs(module: nn.Module) -> bool:
    """Whether a wrapper that took over ``module.forward`` (an instance attribute) may see its tensors now. nnsight
    installs its wrapper on every module of ``NNsight(model)`` for good, inert outside a trace, and records in
    ``module.__nnsight__`` whether one of its traces is running; any other wrapper counts as running."""
    if "forward" not in module.__dict__:
        return False
    nnsight_trace = getattr(module.__dict__.get("__nnsight__"), "active", None)  # -> (interleaver or None, ...)
    return nnsight_trace()[0] is not None if callable(nnsight_trace) else True
