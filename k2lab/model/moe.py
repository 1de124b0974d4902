"""Feed-forward blocks: the dense SwiGLU, and K2's mixture of experts (sigmoid router with correction bias,
routed experts held stacked, one always-on shared expert).

Shapes: B batch, T positions, D width, E routed experts, k experts per token, I expert hidden width.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from ..config import K2Config
from .hooks import HookPoint
from .linear import Linear, linear

# The router's correction bias is held (and stored, and read) in float32 whatever dtype the rest of the model uses:
# its steps are ~1e-3, and bfloat16 rounding would change which experts are chosen.
CORRECTION_BIAS_DTYPE = torch.float32


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP of the first blocks and the shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden)
        self.up_proj = Linear(dim, hidden)
        self.down_proj = Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def group_best(topk_method: str) -> int:
    """How many of a group's best choice scores add up to the group's score: two for ``noaux_tc`` (K2,
    DeepSeek-V3), one for DeepSeek-V2's ``group_limited_greedy``."""
    return 2 if topk_method == "noaux_tc" else 1


def allowed_experts(choice: torch.Tensor, n_group: int = 1, topk_group: int = 1, best: int = 2) -> torch.Tensor:
    """[..., E] bool: the experts in the ``topk_group`` best groups, a group scored by the sum of its ``best``
    choice scores (everything when n_group == 1). This is the router's group limit."""
    if n_group <= 1:
        return torch.ones_like(choice, dtype=torch.bool)
    grouped = choice.unflatten(-1, (n_group, -1))  # [..., G, E/G]
    group_scores = grouped.topk(best, dim=-1).values.sum(-1)  # [..., G]
    kept = group_scores.topk(topk_group, dim=-1).indices  # [..., topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept, True)  # [..., G]
    return keep[..., None].expand(grouped.shape).flatten(-2)  # [..., E]


def select_experts(choice: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1,
                   best: int = 2) -> torch.Tensor:
    """[..., k] the router's choice: top-k of ``choice`` [..., E] among the allowed groups, best first."""
    if n_group > 1:
        choice = choice.masked_fill(~allowed_experts(choice, n_group, topk_group, best), float("-inf"))
    return choice.topk(top_k, dim=-1).indices


class Router(nn.Module):
    """K2's router (``mlp.gate`` in the checkpoint), stage by stage:

    1. logits = x @ W^T in float32                               hook_logits        [B, T, E]
    2. s = sigmoid(logits): independent affinities, not softmax  hook_scores        [B, T, E]
    3. choice = s + b, b the e_score_correction_bias (float32)   hook_choice_scores [B, T, E]
       (with n_group > 1, groups outside the topk_group best, by the sum of their top-2 choice scores, are
       excluded)
    4. idx = top-k of choice: the bias decides WHO is chosen     hook_topk_idx      [B, T, k]
    5. w = s[idx] / (sum + 1e-20) * routed_scaling_factor:       hook_topk_weights  [B, T, k]
       the bias never enters the weights

    The bias is trained by load balancing, not by gradient: an overloaded expert's bias falls, so fewer
    tokens choose it, without an auxiliary loss bending the language-model objective.

    DeepSeek-V2's router (``scoring_func="softmax"``), for contrast: s = softmax(logits) over all experts (experts
    compete for one unit of probability), no bias (``e_score_correction_bias`` is None; choice = s), top-k of s
    ("greedy"; "group_limited_greedy" keeps the topk_group groups with the highest single score), weights s[idx]
    (renormalised only if norm_topk_prob) times routed_scaling_factor.
    """

    def __init__(self, cfg: K2Config):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.scoring_func, self.topk_method = cfg.scoring_func, cfg.topk_method
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))  # [E, D]
        self.e_score_correction_bias: torch.Tensor | None
        bias = torch.zeros(cfg.n_routed_experts, dtype=CORRECTION_BIAS_DTYPE) if cfg.has_correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        self.hook_logits = HookPoint()  # [B, T, E] float32
        self.hook_scores = HookPoint()  # [B, T, E] sigmoid(logits), or softmax(logits) for a softmax router
        self.hook_choice_scores = HookPoint()  # [B, T, E] scores + correction bias (the scores without one)
        self.hook_topk_idx = HookPoint()  # [B, T, k] chosen experts (int64); replacing it re-routes
        self.hook_topk_idx.index_bound = cfg.n_routed_experts  # a replacement route must name real experts
        self.hook_topk_weights = HookPoint()  # [B, T, k] float32 weights of the chosen experts

    def _apply(self, fn, recurse=True):
        # The bias stays CORRECTION_BIAS_DTYPE whatever dtype the model moves to; devices still follow.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if bias is not None:
            self.e_score_correction_bias = bias.to(self.e_score_correction_bias.device)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.hook_logits(linear(x.float(), self.weight.float()))  # [B, T, E]
        if self.scoring_func == "sigmoid":
            scores = self.hook_scores(logits.sigmoid())
            choice = self.hook_choice_scores(scores + self.e_score_correction_bias)
        else:
            scores = self.hook_scores(logits.softmax(dim=-1))
            choice = self.hook_choice_scores(scores)
        idx = select_experts(choice, self.top_k, self.n_group, self.topk_group, group_best(self.topk_method))
        idx = self.hook_topk_idx(idx)  # [B, T, k]
        weights = scores.gather(-1, idx)  # [B, T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, self.hook_topk_weights(weights * self.scaling)


def group_span(group: tuple[int, ...]) -> slice:
    """The slice of a stack [E, ...] that holds a group's experts: a < b as rows a and b (a stride of b - a), e as row
    e alone."""
    first, last = group[0], group[-1]
    return slice(first, last + 1, max(last - first, 1))


def group_views(stack: torch.Tensor, groups: list[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
    """Each group's view of a stack [E, ...] (``group_span``), no copy."""
    return tuple(stack[group_span(group)] for group in groups)


class StackSlices(torch.autograd.Function):
    """Views of a stacked parameter [E, ...], one per group of experts (``group_span``), whose backward writes every
    group's gradient into one stack-sized tensor. Plain slicing would do the same forward, but each slice's backward
    fills a zeroed stack-sized gradient of its own, which autograd then adds into the stack's: one stack's worth of
    writes per group, per stack, per layer (docs/speed.md, "Experts in pairs")."""

    @staticmethod
    def forward(ctx, stack: torch.Tensor, groups: list[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
        ctx.groups, ctx.shape = groups, stack.shape
        return group_views(stack, groups)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        stack_grad = None
        for group, grad in zip(ctx.groups, grads, strict=True):
            if grad is not None:  # a group whose output did not reach the loss has no gradient
                if stack_grad is None:
                    stack_grad = grad.new_zeros(ctx.shape)
                stack_grad[group_span(group)] += grad
        return stack_grad, None


class RoutedExperts(nn.Module):
    """E SwiGLU experts stored stacked: gate_proj/up_proj [E, I, D], down_proj [E, D, I].

    Dispatch sorts the k*N (token, slot) pairs by expert and runs only the experts that were chosen, two at a time:
    a pair of experts with similar loads runs as one batched product over a strided view of the stacks (no copy).
    That halves the product calls, and a batched product runs a batch entry per thread, where one expert's product of
    a few dozen rows splits poorly over threads (docs/speed.md, "Experts in pairs"). The output keeps the slot layout
    [N, k, D] (expert output before weighting), which is what ``hook_expert_out`` shows.
    """

    # Whether two experts' matrices are a strided view of stacks held here, so that experts run in pairs. Streamed and
    # quantized experts make each expert's matrices as it runs (``expert_weights``): pairing them would copy both
    # and hold them at once, so they run one at a time. False on an instance runs this one's experts one at a time.
    pairs_in_place = True

    def __init__(self, cfg: K2Config):
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = E
        self.gate_proj = nn.Parameter(torch.empty(E, I, D))
        self.up_proj = nn.Parameter(torch.empty(E, I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, D], up [I, D], down [D, I]) of one expert; the seam where streamed or FP8 experts plug in."""
        return self.gate_proj[expert], self.up_proj[expert], self.down_proj[expert]

    def expert(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU on the tokens routed to it: h [n, D] -> [n, D]."""
        gate, up, down = self.expert_weights(expert)
        return linear(F.silu(linear(h, gate)) * linear(h, up), down)

    def group_weights(self, groups: list[tuple[int, ...]]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each group's (gate [g, I, D], up [g, I, D], down [g, D, I]), groups of one or two experts in id order
        (``groups``): views of the stacks, no copy, through one ``StackSlices`` per stack where a gradient may flow."""
        # Without a gradient to route, plain views: the autograd Function costs about 20 us a call, three calls per MoE
        # layer of every decode step.
        grad = torch.is_grad_enabled()
        slices = [StackSlices.apply(w, groups) if grad and w.requires_grad else group_views(w, groups)
                  for w in (self.gate_proj, self.up_proj, self.down_proj)]
        return list(zip(*slices, strict=True))

    def run_groups(self, groups: list[tuple[int, ...]], blocks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each group's experts on its row block, h [g, n, D] -> [g, n, D] (row block j through expert group[j]): one
        batched SwiGLU per group over ``group_weights``, or, unless ``pairs_in_place``, ``expert`` one at a time."""
        if not self.pairs_in_place:
            return [self.expert(group[0], h[0])[None] for group, h in zip(groups, blocks, strict=True)]
        return [torch.bmm(F.silu(torch.bmm(h, gate.mT)) * torch.bmm(h, up.mT), down.mT)
                for h, (gate, up, down) in zip(blocks, self.group_weights(groups), strict=True)]

    def groups(self, counts: list[int]) -> list[tuple[int, ...]]:
        """The experts with tokens (counts [E]) as they run: pairs of similar load, each in id order, and the odd
        one out alone (every one alone unless ``pairs_in_place``)."""
        chosen = [e for e, count in enumerate(counts) if count]
        if not self.pairs_in_place:
            return [(e,) for e in chosen]
        by_load = sorted(chosen, key=counts.__getitem__)
        pairs = [tuple(sorted(pair)) for pair in zip(by_load[0::2], by_load[1::2], strict=False)]
        return pairs + [(by_load[-1],)] * (len(by_load) % 2)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [N, D], idx [N, k] -> each slot's expert output [N, k, D]."""
        if torch.compiler.is_compiling() and self.pairs_in_place and idx.numel() <= self.num_experts:
            return self.indexed(x, idx)
        return self.dispatch(x, idx)

    def indexed(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The few-token case inside a compiled graph (a compiled decode step): every slot's SwiGLU over its expert's
        matrices read by index, x [N, D], idx [N, k] -> [N, k, D]. Eagerly, ``gate_proj[idx]`` would copy the
        chosen matrices first (three times the bytes, docs/speed.md); compiled, the indexing and the products fuse
        into kernels that read each chosen matrix in place, with no sync to name the experts in Python. Used
        while at most as many slots as experts, so that no more matrices are read than the stacks hold."""
        gate, up = self.gate_proj[idx], self.up_proj[idx]  # [N, k, I, D]
        h = F.silu(torch.einsum("nd,nkid->nki", x, gate)) * torch.einsum("nd,nkid->nki", x, up)  # [N, k, I]
        return torch.einsum("nki,nkdi->nkd", h, self.down_proj[idx])  # [N, k, D]

    # Which experts run, and on how many tokens, is data: torch.compile would specialise on it and recompile
    # every step. Compiled models with many tokens (the training run) call this eagerly and fuse the dense code
    # around it; a compiled decode step reads its few tokens' experts by index instead (``indexed``).
    @torch.compiler.disable
    def dispatch(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Eager dispatch by expert: x [N, D], idx [N, k] -> each slot's expert output [N, k, D]."""
        N, k = idx.shape
        D = x.shape[-1]
        flat = idx.reshape(-1)  # [N*k] expert of each (token, slot)
        # Which experts run is read back to Python once per layer (one .tolist()), and each pair's matrices are
        # then read in place by its own batched matmuls. Gathering all the chosen experts' matrices for one batched
        # matmul would copy them first, tripling the bytes a decode step moves for its experts (docs/speed.md).
        if N == 1:  # one token (decode): every chosen expert reads its row; nothing to sort or gather
            chosen = flat.tolist()  # k distinct experts, in slot order
            counts = [0] * self.num_experts
            for e in chosen:
                counts[e] = 1
            groups = self.groups(counts)
            outs = self.run_groups(groups, [x.expand(len(group), 1, D) for group in groups])  # [g, 1, D] each
            out = dict(zip(itertools.chain(*groups), torch.cat(outs).unbind(), strict=True))  # expert -> [1, D]
            return torch.cat([out[e] for e in chosen]).view(1, k, D)

        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        groups = self.groups(counts)
        # The rows a group of g experts reads are one [g, m, D] block, m the group's largest count: expert j's rows
        # start at j*m, and the rows past its count are padding (token 0's row, whose outputs are never read).
        sorted_start = [0, *itertools.accumulate(counts)][:-1]  # [E] where expert e's rows begin: among the sorted
        block_start = [0] * len(counts)  # slots, and in the blocks
        blocks, rows = [], 0
        for group in groups:
            m = max(counts[e] for e in group)
            for j, e in enumerate(group):
                block_start[e] = rows + j * m
            blocks.append(len(group) * m)
            rows += blocks[-1]
        order = flat.argsort(stable=True)  # [N*k] slots sorted by expert
        shift = torch.tensor([b - s for b, s in zip(block_start, sorted_start, strict=True)], device=flat.device)
        row_of_sorted = torch.arange(N * k, device=flat.device) + shift[flat[order]]  # [N*k] each sorted slot's row
        token_of_row = flat.new_zeros(rows).index_copy_(0, row_of_sorted, order // k)  # [rows] (pads: 0)
        # One gather, one cat and one gather back whatever the number of experts, so backward is one pass of
        # each (per-group indexing or in-place writes would make autograd allocate a whole [N*k, D] gradient per
        # expert). On the CPU index_select gathers rows about three times faster than x[order // k] and puts them
        # back faster than index_copy_ does (python -m benchmarks.moe_dispatch).
        grouped = x.index_select(0, token_of_row).split(blocks)  # per group [g*m, D]
        outs = self.run_groups(groups, [h.view(len(group), -1, D) for group, h in zip(groups, grouped, strict=True)])
        out = torch.cat([o.view(-1, D) for o in outs])  # [rows, D]
        row_of_slot = torch.empty_like(order).index_copy_(0, order, row_of_sorted)  # [N*k]
        return out.index_select(0, row_of_slot).view(N, k, D)  # back to slot order


class MoE(nn.Module):
    """routed (sum over the k chosen experts of weight * expert(x)) + shared expert(x)."""

    def __init__(self, cfg: K2Config):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg)
        self.shared_experts = (
            SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts else None
        )
        self.hook_expert_out = HookPoint()  # [B, T, k, D] each chosen expert's output, before weighting
        self.hook_routed_out = HookPoint()  # [B, T, D] weighted sum over the k slots
        self.hook_shared_out = HookPoint()  # [B, T, D] the shared expert's output

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        B, T, D = x.shape
        idx, weights = self.gate(x)  # [B, T, k], [B, T, k]
        expert_out = self.hook_expert_out(self.experts(x.reshape(B * T, D), idx.reshape(B * T, -1)).view(B, T, -1, D))
        # The weighted sum over the k slots in float32, as one batched [1, k] @ [k, D] product per token
        routed = torch.matmul(weights.unsqueeze(-2), expert_out.float()).squeeze(-2)  # [B, T, D]
        routed = self.hook_routed_out(routed.to(x.dtype))
        if self.shared_experts is None:
            return routed
        return routed + self.hook_shared_out(self.shared_experts(x))
