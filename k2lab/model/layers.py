"""The three small layers every block is built from: a bias-free Linear, RMSNorm and the SwiGLU feed-forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import SPLIT_MAX_ROWS, split_linear


class Linear(nn.Linear):
    """x @ W^T without a bias, the checkpoint's layout (``weight`` [out, in])."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.shape[-2] == 1 and x.numel() <= SPLIT_MAX_ROWS * x.shape[-1] and x.device.type == "cpu":  # a decode step
            return split_linear(x, self.weight)  # model/linear.py: one block of weight rows per thread
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and cast back before the scale (the order matters in bfloat16)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
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
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
