"""Speed room: each slot's expert read by index, with no expert id read back to Python.

Replaces ``MoE``'s reference loop (and grouped_experts.py's grouping) inside a ``torch.compile`` graph with at most as
many (token, slot) pairs as there are experts, which is a decode step (``generate(compile=True)``), and on a GPU for a
decode step of experts held quantized (``grouped_experts.grouped_experts_impl``). The loop and the grouping read back to
Python which experts run; a compiled graph cannot, and would break or recompile for every choice, and on a GPU each read
is a host sync. Here the chosen matrices are indexed with the routing tensor itself:

- stacked experts: ``gate_proj[idx]``. Eagerly that would copy the chosen matrices first (three times the bytes), but
  compiled, the indexing and the products fuse into kernels that read each chosen matrix in place;
- experts held otherwise (FP8, INT4: ``Experts.chosen_weights``): the stored values and scales are gathered by index and
  dequantized. Compiled, each product is written as a multiply and a sum, which inductor fuses with the gather and the
  dequantization into one reduction: each chosen matrix is read once, as stored, and no dequantized copy is written.

Used while at most as many slots as experts, so no more matrices are read than the stacks hold. Equal to the loop to
float32 rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ..moe import Experts


def indexed_experts(experts: Experts, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, T, D], idx [B, T, k] -> each slot's expert output [B, T, k, D] (``experts.indexable``)."""
    stacks = experts.stacks
    if stacks is None:
        gate, up, down = experts.chosen_weights(idx)  # [B, T, k, I, D], [B, T, k, I, D], [B, T, k, D, I]
        rows = x[:, :, None]  # [B, T, 1, D]
        h = F.silu(row_products(rows, gate)) * row_products(rows, up)  # [B, T, k, I]
        return row_products(h, down)  # [B, T, k, D]
    gate, up = stacks[0][idx], stacks[1][idx]  # [B, T, k, I, D]
    h = F.silu(torch.einsum("btd,btkid->btki", x, gate)) * torch.einsum("btd,btkid->btki", x, up)  # [B, T, k, I]
    return torch.einsum("btki,btkdi->btkd", h, stacks[2][idx])  # [B, T, k, D]


def row_products(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """v [..., n] against each row of w [..., m, n] -> [..., m] (v broadcasts over w's leading dimensions)."""
    if torch.compiler.is_compiling():  # a multiply and a sum: inductor fuses them with what made w into one reduction
        return (v[..., None, :] * w).sum(-1)
    return (w @ v[..., None]).squeeze(-1)  # eagerly a batched product: the multiply would write all of w again
