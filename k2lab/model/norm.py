"""RMSNorm as released: normalise in float32, cast back, then scale (the order matters in bfloat16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        if x.dtype == self.weight.dtype == torch.float32:  # nothing to cast: one fused call, the same arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)  # x * rsqrt(mean(x^2) + eps), float32
        return self.weight * normed.to(x.dtype)
