"""Speed room: the chosen experts run grouped, tokens sorted by expert, experts of similar load in pairs.

Replaces ``MoE``'s reference loop (one ``where`` and three products per chosen expert) where ``moe.choose_experts``
says so: for a decode step (one new token per sequence, at most ``DECODE_BATCH`` sequences), on a GPU (where each
``where`` waits for the device), for training (``MoE.experts_impl = "grouped"``) and in a compiled decode step
(indexed_experts.py). ``run_experts`` runs the path the chooser named; ``grouped_experts_impl`` is its rule for
grouped experts on each device:

- On the CPU, and where nothing below applies, in pairs (``paired_experts``): two experts of similar load run as one
  batched product over a strided view of the stacks (no copy). That halves the product calls, and a batched product
  runs a batch entry per thread, where one expert's product of a few rows runs on one thread (what a decode step
  gains: ``python -m benchmarks.vs_hf``, docs/speed.md). One gather in and one gather out, so that autograd's backward
  is one pass of each, and ``StackSlices`` gives the pairs' views of a stack one gradient node per stack. Which
  experts run is read back to Python once per layer (one ``.tolist()``: a host sync on a GPU), so torch.compile does
  not trace it (``torch.compiler.disable``).
- On a GPU, without a host sync: stacked bfloat16 experts sorted by expert through one grouped product per projection
  (``sorted_experts``: ``torch._grouped_mm``, whose group offsets stay on the device); experts held quantized, at most
  as many slots as experts (a decode step), read by index (model/indexed.py).

Equal to the loop to float32 rounding, in the same slot layout [B, T, k, D]. Streamed experts (read from files per
expert) run one at a time in the paired path, still sorted.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .indexed_experts import indexed_experts

if TYPE_CHECKING:
    from ..moe import Experts


def expert_groups(counts: list[int], pairs: bool) -> list[tuple[int, ...]]:
    """The experts with tokens (counts [E]) as they run: pairs of similar load, each in id order, and the odd one out
    alone; every one alone unless ``pairs``."""
    chosen = [e for e, count in enumerate(counts) if count]
    if not pairs:
        return [(e,) for e in chosen]
    by_load = sorted(chosen, key=counts.__getitem__)
    pairs_ = [tuple(sorted(pair)) for pair in zip(by_load[0::2], by_load[1::2], strict=False)]
    return pairs_ + [(by_load[-1],)] * (len(by_load) % 2)


def group_span(group: tuple[int, ...]) -> slice:
    """The slice of a stack [E, ...] that holds a group's experts: a < b as rows a and b (a stride of b - a), e as row
    e alone."""
    first, last = group[0], group[-1]
    return slice(first, last + 1, max(last - first, 1))


class StackSlices(torch.autograd.Function):
    """Views of a stacked parameter [E, ...], one per group of experts (``group_span``), whose backward writes every
    group's gradient into one stack-sized tensor. Plain slicing would do the same forward, but each slice's backward
    fills a zeroed stack-sized gradient of its own, which autograd then adds into the stack's: one stack's worth of
    writes per group, per stack, per layer."""

    @staticmethod
    def forward(ctx, stack: torch.Tensor, groups: list[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
        """stack [E, ...] -> one view per group of experts (``group_span``)."""
        ctx.groups, ctx.shape = groups, stack.shape
        return tuple(stack[group_span(group)] for group in groups)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        """The groups' gradients written into one stack-sized gradient [E, ...] (None when no group's output reached the
        loss)."""
        stack_grad = None
        for group, grad in zip(ctx.groups, grads, strict=True):
            if grad is not None:  # a group whose output did not reach the loss has no gradient
                if stack_grad is None:
                    stack_grad = grad.new_zeros(ctx.shape)
                stack_grad[group_span(group)] += grad
        return stack_grad, None


def run_groups(experts: Experts, groups: list[tuple[int, ...]], blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each group's experts on its row block, h [g, n, D] -> [g, n, D] (row block j through expert group[j]): one
    batched SwiGLU per group over views of the stacks, or each expert's ``expert_linears`` when there are none."""
    stacks = experts.stacks
    if stacks is None:
        outs = []
        for group, h in zip(groups, blocks, strict=True):
            gate, up, down = experts.expert_linears(group[0])
            outs.append(down(F.silu(gate(h[0])) * up(h[0]))[None])
        return outs
    if torch.is_grad_enabled() and stacks[0].requires_grad:
        views = [StackSlices.apply(stack, groups) for stack in stacks]
    else:  # no gradient to route: plain views (the autograd Function costs about 20 us a call)
        views = [[stack[group_span(group)] for group in groups] for stack in stacks]
    return [torch.bmm(F.silu(torch.bmm(h, gate.mT)) * torch.bmm(h, up.mT), down.mT)
            for h, gate, up, down in zip(blocks, *views, strict=True)]


def run_experts(impl: str, experts: Experts, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Every chosen expert's output by the path ``impl`` (``moe.choose_experts``' name): x [B, T, D], idx [B, T, k] ->
    [B, T, k, D], slot s of token (b, t) holding expert idx[b, t, s]'s SwiGLU of x[b, t]."""
    if impl == "shapes":  # the meta device: shapes without values (the full K2 without memory)
        return x.new_empty(*idx.shape, x.shape[-1])
    run = {"indexed": indexed_experts, "sorted": sorted_experts, "paired": paired_experts}[impl]
    return run(experts, x, idx)


def grouped_experts_impl(experts: Experts, x: torch.Tensor, idx: torch.Tensor) -> str:
    """How grouped experts run on x's device: on a GPU without a host sync where it can ("sorted" for stacked experts
    when not training, where ``torch._grouped_mm`` runs grouped; "indexed" for at most as many slots as experts that
    can be gathered by index), else in pairs ("paired")."""
    if x.device.type != "cpu":
        stacks = experts.stacks
        training = torch.is_grad_enabled() and stacks is not None and stacks[0].requires_grad
        if stacks is not None and not training and grouped_mm_runs(x.device, x.dtype):
            return "sorted"
        if idx.numel() <= experts.num_experts and experts.indexable:
            return "indexed"
    return "paired"


@torch.compiler.assume_constant_result
def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs its grouped kernel on ``device`` for ``dtype``: bfloat16 on CUDA devices of
    compute capability 9.0 or more. Elsewhere it falls back to a loop that reads the offsets back to the host."""
    return (device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device)[0] >= 9)


def sorted_experts(experts: Experts, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """As ``run_experts``, for stacked experts, with nothing read back to the host: the (token, slot) rows sorted by
    expert, and one grouped product per projection (``torch._grouped_mm``) over the stacks, each expert's rows ending
    at an offset computed on the device (an expert without rows is an empty group). A compiled graph traces it whole."""
    B, T, k = idx.shape
    D = x.shape[-1]
    flat = idx.reshape(-1)  # [N*k] expert of each (token, slot)
    order = flat.argsort(stable=True)  # [N*k] slots sorted by expert
    counts = torch.zeros(experts.num_experts, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))  # [E] (bincount would read its size back to the host)
    ends = counts.cumsum(0, dtype=torch.int32)  # [E] where each expert's rows end among the sorted ones
    rows = x.reshape(B * T, D).index_select(0, order // k)  # [N*k, D] sorted by expert

    def grouped(h: torch.Tensor, stack: torch.Tensor) -> torch.Tensor:  # [N*k, in] through [E, out, in] -> [N*k, out]
        return torch._grouped_mm(h, stack.mT, offs=ends)

    gate, up, down = experts.stacks
    h = F.silu(grouped(rows, gate)) * grouped(rows, up)  # [N*k, I]
    out = grouped(h, down)  # [N*k, D]
    return torch.empty_like(out).index_copy_(0, order, out).view(B, T, k, D)  # back to slot order


@torch.compiler.disable
def paired_experts(experts: Experts, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """As ``run_experts``, experts of similar load in pairs (the module docstring), reading which experts run back
    to Python once."""
    B, T, k = idx.shape
    D = x.shape[-1]
    x, flat = x.reshape(B * T, D), idx.reshape(-1)  # [N, D], [N*k] expert of each (token, slot)
    if B * T == 1:  # one token: every chosen expert reads its row; nothing to sort or gather
        chosen = flat.tolist()  # k distinct experts, in slot order
        groups = expert_groups([int(e in chosen) for e in range(experts.num_experts)], experts.stacks is not None)
        outs = run_groups(experts, groups, [x.expand(len(group), 1, D) for group in groups])  # [g, 1, D] each
        out = dict(zip(itertools.chain(*groups), torch.cat(outs).unbind(), strict=True))  # expert -> [1, D]
        return torch.cat([out[e] for e in chosen]).view(B, T, k, D)
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    groups = expert_groups(counts, experts.stacks is not None)
    # The rows a group of g experts reads are one [g, m, D] block, m the group's largest count: expert j's rows start
    # at j*m, and the rows past its count are padding (token 0's row, whose outputs are never read).
    sorted_start = [0, *itertools.accumulate(counts)][:-1]  # [E] where expert e's rows begin among the sorted slots
    block_start, blocks, rows = [0] * len(counts), [], 0  # ... and in the blocks
    for group in groups:
        m = max(counts[e] for e in group)
        for j, e in enumerate(group):
            block_start[e] = rows + j * m
        blocks.append(len(group) * m)
        rows += blocks[-1]
    order = flat.argsort(stable=True)  # [N*k] slots sorted by expert
    shift = torch.tensor([b - s for b, s in zip(block_start, sorted_start, strict=True)], device=flat.device)
    row_of_sorted = torch.arange(flat.numel(), device=flat.device) + shift[flat[order]]  # [N*k] each sorted slot's row
    token_of_row = flat.new_zeros(rows).index_copy_(0, row_of_sorted, order // k)  # [rows] (pads: 0)
    # One gather, one cat and one gather back whatever the number of experts, so backward is one pass of each. On the
    # CPU index_select gathers rows about three times faster than x[order // k].
    grouped = x.index_select(0, token_of_row).split(blocks)  # per group [g*m, D]
    outs = run_groups(experts, groups, [h.view(len(group), -1, D) for group, h in zip(groups, grouped, strict=True)])
    out = torch.cat([o.view(-1, D) for o in outs])  # [rows, D]
    row_of_slot = torch.empty_like(order).index_copy_(0, order, row_of_sorted)  # [N*k]
    return out.index_select(0, row_of_slot).view(B, T, k, D)  # back to slot order
