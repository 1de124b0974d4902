"""K2's mixture of experts: the sigmoid router with its correction bias, the routed experts, the shared expert.

    y = sum_j w_j * SwiGLU_{e_j}(x) + SwiGLU_shared(x)        over the k experts e_j the router chose for x

Shapes: B batch, T positions, D width, E routed experts, k experts per token, I expert hidden width.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..config import K2Config
from .layers import HookPoint, SwiGLU
from .speed.grouped_experts import grouped_experts_impl, run_experts

# The router's correction bias is held (and stored, and read) in float32 whatever dtype the rest of the model uses:
# its steps are ~1e-3, and bfloat16 rounding would change which experts are chosen.
CORRECTION_BIAS_DTYPE = torch.float32


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


class Router(nn.Module):
    """K2's router (``mlp.gate`` in the checkpoint), stage by stage:

    1. logits = x @ W^T in float32                               hook_logits        [B, T, E]
    2. s = sigmoid(logits): independent affinities, not softmax  hook_scores        [B, T, E]
    3. choice = s + b, b the e_score_correction_bias (float32)   hook_choice_scores [B, T, E]
    4. idx = top-k of choice: the bias decides WHO is chosen     hook_topk_idx      [B, T, k]
       (with n_group > 1, only among the topk_group best groups, a group scored by the sum of its top-2 choice
       scores: ``allowed_experts``)
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
        self.group_best = group_best(cfg.topk_method)
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
        """x [B, T, D] -> the chosen experts idx [B, T, k] (best first) and their weights [B, T, k] (float32)."""
        logits = self.hook_logits(F.linear(x.float(), self.weight.float()))  # [B, T, E]
        if self.scoring_func == "sigmoid":
            scores = self.hook_scores(logits.sigmoid())
            choice = self.hook_choice_scores(scores + self.e_score_correction_bias)
        else:
            scores = self.hook_scores(logits.softmax(dim=-1))
            choice = self.hook_choice_scores(scores)
        if self.n_group > 1:  # the group limit: experts outside the topk_group best groups cannot be chosen
            allowed = allowed_experts(choice, self.n_group, self.topk_group, self.group_best)
            choice = choice.masked_fill(~allowed, -torch.inf)
        idx = self.hook_topk_idx(choice.topk(self.top_k, dim=-1).indices)  # [B, T, k]
        weights = scores.gather(-1, idx)  # [B, T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, self.hook_topk_weights(weights * self.scaling)


class Experts(nn.Module, abc.ABC):
    """What ``MoE`` and the speed rooms ask of a layer's E routed SwiGLU experts, however they are held: stacked here
    (``RoutedExperts``), quantized (FP8, INT4: ``k2lab.weights.quant``) or streamed from files
    (``k2lab.weights.streaming``).

    - ``expert_weights(e)``: expert e's matrices (gate [I, D], up [I, D], down [D, I]), what the reference loop reads;
    - ``expert_linears(e)``: its three products h -> h @ W^T (an FP8 expert multiplies as stored where it can);
    - ``stacks``: the [E, ...] stacks (gate, up, down) when they are held as plain tensors the speed rooms can view in
      place, else None;
    - ``indexable`` and ``chosen_weights(idx)``: whether the matrices of the experts a routing tensor names can be
      gathered by that tensor itself (no expert id read back to Python), and the gathered matrices.
    """

    num_experts: int
    indexable: bool = True

    @abc.abstractmethod
    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, D], up [I, D], down [D, I]) of expert ``expert``."""

    def expert_linears(self, expert: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
        """The products h [n, in] -> h @ W^T of expert ``expert``'s gate, up and down."""
        return tuple(partial(F.linear, weight=weight) for weight in self.expert_weights(expert))

    @property
    def stacks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(gate [E, I, D], up [E, I, D], down [E, D, I]) held as plain tensors, or None."""
        return None

    def chosen_weights(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The matrices of the experts ``idx`` [...] names, gathered by ``idx`` itself: (gate [..., I, D],
        up [..., I, D], down [..., D, I]). Only where ``indexable``."""
        raise NotImplementedError(f"{type(self).__name__} cannot gather its experts by index (indexable is False)")


class RoutedExperts(Experts):
    """E SwiGLU experts stored stacked: gate_proj/up_proj [E, I, D], down_proj [E, D, I]. Only storage: ``MoE``
    runs them."""

    def __init__(self, cfg: K2Config):
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = E
        self.gate_proj = nn.Parameter(torch.empty(E, I, D))
        self.up_proj = nn.Parameter(torch.empty(E, I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, D], up [I, D], down [D, I]) of one expert."""
        return self.gate_proj[expert], self.up_proj[expert], self.down_proj[expert]

    @property
    def stacks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [E, I, D], up [E, I, D], down [E, D, I]): the parameters themselves."""
        return self.gate_proj, self.up_proj, self.down_proj

    def chosen_weights(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stacks indexed by ``idx`` [...]: (gate [..., I, D], up [..., I, D], down [..., D, I])."""
        return self.gate_proj[idx], self.up_proj[idx], self.down_proj[idx]


ExpertsImpl = Literal["auto", "loop", "grouped"]
EXPERTS_IMPLS = ("auto", "loop", "grouped")
# A decode step (one new token per sequence) of at most this many sequences runs grouped by default: its experts'
# products have few rows.
DECODE_BATCH = 16


def choose_experts(setting: ExpertsImpl, experts: Experts, x: torch.Tensor, idx: torch.Tensor, speed: bool = True
                   ) -> str:
    """How the chosen experts run for this call -> one name: "loop" (the reference, ``MoE.forward``), "shapes" (on the
    meta device: the output's shape only), or a speed room of speed/grouped_experts.py: "indexed", "sorted",
    "paired". ``setting`` is ``MoE.experts_impl``; ``speed`` is ``K2Model.speed``. The rule, in order:

    1. the meta device has no values to choose by: "shapes";
    2. the speed rooms off, or ``setting == "loop"``: "loop";
    3. inside a compiled graph with at most one (token, slot) pair per expert (a compiled decode step), experts that
       can be gathered by index: "indexed" (nothing read back to Python, which a graph cannot do);
    4. ``setting == "grouped"`` (training: one gradient pass per stack), a decode step (one new token per sequence,
       at most ``DECODE_BATCH`` sequences) or any device but the CPU (where the loop's ``where`` per expert waits for
       the device): grouped, by ``grouped_experts``' rule for the device ("sorted", "indexed" or "paired");
    5. otherwise: "loop".
    """
    if setting not in EXPERTS_IMPLS:
        raise ValueError(f"MoE.experts_impl must be one of {EXPERTS_IMPLS}, got {setting!r}")
    B, T, _ = idx.shape
    if x.device.type == "meta":
        return "shapes"
    if not speed or setting == "loop":
        return "loop"
    if torch.compiler.is_compiling() and idx.numel() <= experts.num_experts and experts.indexable:
        return "indexed"
    if setting == "grouped" or (T == 1 and B <= DECODE_BATCH) or x.device.type != "cpu":
        return grouped_experts_impl(experts, x, idx)
    return "loop"


class MoE(nn.Module):
    """routed (sum over the k chosen experts of weight * expert(x)) + shared expert(x)."""

    speed = True  # K2Model.speed: False runs the reference loop always
    experts_impl: ExpertsImpl = "auto"  # how the chosen experts run: choose_experts

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
        """x [B, T, D] -> the routed experts' weighted sum, plus the shared expert where there is one [B, T, D]; the
        experts run as ``choose_experts`` names (the reference loop, or a speed room)."""
        B, T, D = x.shape
        idx, weights = self.gate(x)  # [B, T, k], [B, T, k]
        impl = choose_experts(self.experts_impl, self.experts, x, idx, self.speed)
        if impl == "loop":  # the reference: each chosen expert's SwiGLU on the tokens routed to it, into their slots
            expert_out = x.new_zeros(B, T, idx.shape[-1], D)  # [B, T, k, D]
            for e in idx.unique().tolist():
                b, t, slot = torch.where(idx == e)  # the (token, slot) pairs that chose expert e
                gate, up, down = self.experts.expert_weights(e)  # [I, D], [I, D], [D, I]
                h = x[b, t]  # [n, D]
                expert_out[b, t, slot] = F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)
        else:
            expert_out = run_experts(impl, self.experts, x, idx)  # speed/grouped_experts.py
        expert_out = self.hook_expert_out(expert_out)  # [B, T, k, D]
        routed = (weights[..., None] * expert_out.float()).sum(-2)  # [B, T, D] the weighted sum, in float32
        routed = self.hook_routed_out(routed.to(x.dtype))
        if self.shared_experts is None:
            return routed
        return routed + self.hook_shared_out(self.shared_experts(x))
