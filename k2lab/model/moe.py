"""Feed-forward blocks: the dense SwiGLU, and K2's mixture of experts (sigmoid router with correction bias,
routed experts held stacked, one always-on shared expert).

Shapes: B batch, T positions, D width, E routed experts, k experts per token, I expert hidden width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import K2Config
from .hooks import HookPoint


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP of the first blocks and the shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
    """

    def __init__(self, cfg: K2Config):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))  # [E, D]
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.hook_logits = HookPoint()  # [B, T, E] float32
        self.hook_scores = HookPoint()  # [B, T, E] sigmoid(logits)
        self.hook_choice_scores = HookPoint()  # [B, T, E] scores + correction bias
        self.hook_topk_idx = HookPoint()  # [B, T, k] chosen experts (int64); replacing it re-routes
        self.hook_topk_weights = HookPoint()  # [B, T, k] float32 weights of the chosen experts

    def _apply(self, fn, recurse=True):
        # The bias stays float32 whatever dtype the model moves to: its steps are ~1e-3 and bfloat16 rounding
        # would change which experts are chosen. Devices still follow.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        self.e_score_correction_bias = bias.to(self.e_score_correction_bias.device)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.hook_logits(F.linear(x.float(), self.weight.float()))  # [B, T, E]
        scores = self.hook_scores(logits.sigmoid())
        choice = self.hook_choice_scores(scores + self.e_score_correction_bias)
        if self.n_group > 1:
            grouped = choice.unflatten(-1, (self.n_group, -1))  # [B, T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [B, T, G]
            kept = group_scores.topk(self.topk_group, dim=-1).indices  # [B, T, topk_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)  # [B, T, E]
        idx = self.hook_topk_idx(choice.topk(self.top_k, dim=-1).indices)  # [B, T, k]
        weights = scores.gather(-1, idx)  # [B, T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, self.hook_topk_weights(weights * self.scaling)


class RoutedExperts(nn.Module):
    """E SwiGLU experts stored stacked: gate_proj/up_proj [E, I, D], down_proj [E, D, I].

    Dispatch sorts the k*N (token, slot) pairs by expert and runs one matmul per expert that was chosen;
    unchosen experts cost nothing. The output keeps the slot layout [N, k, D] (expert output before
    weighting), which is what ``hook_expert_out`` shows.
    """

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
        return F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)

    # Which experts run, and on how many tokens, is data: torch.compile would specialise on it and recompile
    # every step. Compiled models (the training run) call this eagerly and fuse the dense code around it.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [N, D], idx [N, k] -> each slot's expert output [N, k, D]."""
        N, k = idx.shape
        # Which experts run is read back to Python once per layer (one .tolist()), and each expert's matrices
        # are then read in place by its own matmuls. Gathering the k chosen experts' matrices for one batched
        # matmul would copy them first, tripling the bytes a decode step moves for its experts (docs/speed.md).
        if N == 1:  # one token (decode): its k experts in slot order, with nothing to sort
            return torch.stack([self.expert(e, x) for e in idx[0].tolist()], dim=1)  # [1, k, D]
        flat = idx.reshape(-1)  # [N*k] expert of each (token, slot)
        order = flat.argsort(stable=True)  # slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        experts = [e for e, count in enumerate(counts) if count]
        sizes = [counts[e] for e in experts]
        if torch.is_grad_enabled():
            # Training: one gather, one split, one cat and one scatter, so that backward is one pass of each.
            # Indexing per group or writing in place would make autograd allocate a whole [N*k, D] gradient per
            # expert.
            grouped = x[order // k].split(sizes)  # per chosen expert, its tokens [n, D]
            by_expert = torch.cat([self.expert(e, h) for e, h in zip(experts, grouped, strict=True)])  # [N*k, D]
            return by_expert.new_empty(N * k, x.shape[-1]).index_copy_(0, order, by_expert).view(N, k, -1)
        # Inference: each group's tokens are gathered just before its expert runs and its output is written
        # straight into its slots, while both are still in cache (about 20% faster at prefill than the above).
        out = x.new_empty(N * k, x.shape[-1])  # [N*k, D] in slot layout
        for e, slots in zip(experts, order.split(sizes), strict=True):
            out[slots] = self.expert(e, x[slots // k])  # [n, D] to the group's slots
        return out.view(N, k, -1)


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
        routed = self.hook_routed_out((expert_out * weights[..., None]).sum(dim=2).to(x.dtype))  # [B, T, D]
        if self.shared_experts is None:
            return routed
        return routed + self.hook_shared_out(self.shared_experts(x))
