"""Speed room: inside a compiled decode step, each slot's expert read by index.

Replaces ``MoE``'s reference loop (and ``dispatch.py``'s grouping) inside a ``torch.compile`` graph with at most as
many (token, slot) pairs as there are experts, which is a decode step (``generate(compile=True)``). The loop and the
grouping read back to Python which experts run; a compiled graph cannot, and would break or recompile for every
choice. Here the chosen matrices are indexed with the routing tensor itself: eagerly, ``gate_proj[idx]`` would copy
the chosen matrices first (three times the bytes), but compiled, the indexing and the products fuse into kernels that
read each chosen matrix in place, with no sync. Used while at most as many slots as experts, so no more matrices are
read than the stacks hold. Equal to the loop to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def indexed_experts(experts, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, T, D], idx [B, T, k] -> each slot's expert output [B, T, k, D] (``experts`` a stacked RoutedExperts)."""
    gate, up = experts.gate_proj[idx], experts.up_proj[idx]  # [B, T, k, I, D]
    h = F.silu(torch.einsum("btd,btkid->btki", x, gate)) * torch.einsum("btd,btkid->btki", x, up)  # [B, T, k, I]
    return torch.einsum("btki,btkdi->btkd", h, experts.down_proj[idx])  # [B, T, k, D]
