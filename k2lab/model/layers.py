"""The small modules every block is built from: a bias-free Linear, RMSNorm, the SwiGLU feed-forward, and HookPoint,
the identity a probe hangs on (named and managed by ``hooks.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .speed.linear import split_linear, split_pays

HookFn = Callable[[torch.Tensor, "HookPoint"], torch.Tensor | None]


class Linear(nn.Linear):
    """x @ W^T without a bias, the checkpoint's layout (``weight`` [out, in])."""

    speed = True  # K2Model.speed: False runs F.linear always

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        """x [..., in] -> x @ W^T [..., out]; a decode step's single row may split over the CPU's threads
        (speed/linear.py)."""
        if self.speed and x.dim() > 1 and x.shape[-2] == 1 and split_pays(x, self.weight):  # a decode step's rows
            return split_linear(x, self.weight)  # speed/linear.py: over the CPU's threads
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and cast back before the scale (the order matters in bfloat16)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        """x [..., dim] -> x / rms(x) * weight [..., dim], in x's dtype."""
        if x.dtype == self.weight.dtype == torch.float32:  # nothing to cast: one fused call, the same arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)  # x * rsqrt(mean(x^2) + eps), float32
        return self.weight * normed.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense feed-forward of the first blocks, and the shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden)
        self.up_proj = Linear(dim, hidden)
        self.down_proj = Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        """x [..., D] -> down(silu(gate(x)) * up(x)) [..., D]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HookPoint(nn.Module):
    """Identity on the forward path. Attached functions may read the tensor (or its gradient) or replace it."""

    def __init__(self) -> None:
        super().__init__()
        self.name = ""  # set by the model from the module path
        self.fns: list[HookFn] = []  # forward hooks: fn(tensor, hook)
        self.bwd_fns: list[HookFn] = []  # backward hooks: fn(grad, hook), run while the gradient passes
        self.index_bound: int | None = None  # for probes of indices (hook_topk_idx): replacements lie in 0..bound-1
        # For probes the forward computes only to be read (hook_max_logit): the leaf name of the probe beside it to
        # hook instead. A replacement would change nothing downstream, so returning one raises.
        self.read_only: str | None = None

    @property
    def active(self) -> bool:
        """True when something may read this probe or its gradient: a k2lab hook (forward or backward), a PyTorch
        forward (pre-)hook, or a wrapper that took over ``forward`` (nnsight's, which cannot say ahead which probes a
        trace will read, and stays on a module from ``NNsight(model)`` on). The caller then materialises what the
        probe shows (attention patterns leave the fused kernel, which makes none, so that a gradient hook on them has a
        tensor to run on)."""
        return bool(self.fns or self.bwd_fns or self._forward_hooks or self._forward_pre_hooks
                    or "forward" in self.__dict__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] as each forward hook in turn leaves it: read, or replaced by a tensor of the same shape, dtype and
        device. Backward hooks, when attached, will run on x's gradient."""
        for fn in tuple(self.fns):  # a copy: a hook may detach hooks (reset_hooks) while they run
            try:
                out = fn(x, self)
            except Exception as err:
                err.add_note(f"raised by a hook on {self.name}")
                raise
            if out is not None:
                x = self._checked(out, x, "hook")
        if self.bwd_fns and x.requires_grad:
            x.register_hook(self._backward)
        return x

    def _backward(self, grad: torch.Tensor) -> torch.Tensor:
        """Run the backward hooks attached when the gradient arrives (none once their ``hooks`` block has exited)."""
        for fn in tuple(self.bwd_fns):
            out = fn(grad, self)
            if out is not None:
                grad = self._checked(out, grad, "backward hook")
        return grad

    def _checked(self, out: object, x: torch.Tensor, kind: str) -> torch.Tensor:
        """A replacement must be a tensor like the one it replaces (shape, dtype, device), of a probe whose value the
        forward uses; indices must be in range."""
        if self.read_only is not None:
            instead = self.name[: len(self.name) - len(self.name.rpartition(".")[2])] + self.read_only
            raise ValueError(f"{kind} on {self.name} returned a replacement, but {self.name} is read-only: the forward "
                             f"computes it only to be read and never uses it, so a replacement would change nothing. "
                             f"Return None to read it; to change the computation, hook {instead} instead")
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"{kind} on {self.name} returned {type(out).__name__}; expected a tensor "
                             f"{tuple(x.shape)} {x.dtype} (or None to keep it)")
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"{kind} on {self.name} returned {tuple(out.shape)} {out.dtype} on {out.device}; "
                             f"expected {tuple(x.shape)} {x.dtype} on {x.device} (cast with .to(tensor))")
        if self.index_bound is not None and out.numel() and (out.min() < 0 or out.max() >= self.index_bound):
            bad = out[(out < 0) | (out >= self.index_bound)][0].item()
            raise ValueError(f"{kind} on {self.name} returned index {bad}; valid: 0..{self.index_bound - 1}")
        return out

    def extra_repr(self) -> str:
        """What ``print(module)`` shows after the class name: the probe's name."""
        return self.name
