"""Routing: which experts each token chose, with what weights, and where the correction bias changed the choice.

    tr = k2lab.routing.trace(model, ids)
    tr.layers                     # the MoE layer indices: row j of every tensor below is layer tr.layers[j]
    tr.indices, tr.weights        # [L_moe, B, T, k]
    tr.scores, tr.choice_scores   # [L_moe, B, T, E] sigmoid affinities; affinities + correction bias
    tr.bias_flips                 # [L_moe, B, T] bool: the bias changed the chosen set
    tr.flip_counts                # [L_moe] how many tokens flipped per layer

Selection always uses the router's own rule on the choice scores (``select_experts``), never a sort of the logits:
the bias shifts choices, and groups (n_group > 1) restrict them. Routing metrics are functions of a RoutingTrace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .activation_cache import ActivationCache
    from .model import K2Model

_GATE_PROBES = ("hook_scores", "hook_choice_scores", "hook_topk_idx", "hook_topk_weights")


def moe_layers(model: K2Model) -> list[int]:
    """Indices of the model's MoE layers (dense ones come first in K2: layer 0)."""
    layers = [i for i in range(len(model.layers)) if model.config.is_moe_layer(i)]
    if not layers:
        raise ValueError("this model has no MoE layer (first_k_dense_replace >= num_hidden_layers)")
    return layers


def allowed_experts(choice: torch.Tensor, n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """[..., E] bool: the experts in the ``topk_group`` best groups, a group scored by the sum of its two best
    choice scores (everything when n_group == 1). This is the router's group limit."""
    if n_group <= 1:
        return torch.ones_like(choice, dtype=torch.bool)
    grouped = choice.unflatten(-1, (n_group, -1))  # [..., G, E/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [..., G]
    kept = group_scores.topk(topk_group, dim=-1).indices  # [..., topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept, True)  # [..., G]
    return keep[..., None].expand(grouped.shape).flatten(-2)  # [..., E]


def select_experts(choice: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """[..., k] the router's choice: top-k of ``choice`` [..., E] among the allowed groups, best first."""
    limited = choice.masked_fill(~allowed_experts(choice, n_group, topk_group), float("-inf"))
    return limited.topk(top_k, dim=-1).indices


@dataclass
class RoutingTrace:
    """Per MoE layer routing of one forward. Row j of every tensor is layer ``layers[j]``.

    ``unbiased_indices`` is what the router would choose with a zero correction bias (the same rule, groups
    included, on the plain scores); ``bias_flips`` marks tokens whose chosen SET differs from it (order ignored).
    """

    layers: list[int]
    indices: torch.Tensor  # [L_moe, B, T, k] chosen experts, best choice score first
    weights: torch.Tensor  # [L_moe, B, T, k] their weights (from the unbiased scores, renormalised, scaled)
    scores: torch.Tensor  # [L_moe, B, T, E] sigmoid(logits)
    choice_scores: torch.Tensor  # [L_moe, B, T, E] scores + e_score_correction_bias
    unbiased_indices: torch.Tensor  # [L_moe, B, T, k] the top-k of the scores without the bias
    bias_flips: torch.Tensor  # [L_moe, B, T] bool

    @property
    def flip_counts(self) -> torch.Tensor:
        """[L_moe] int: tokens per layer whose chosen set the bias changed."""
        return self.bias_flips.flatten(1).sum(-1)

    def row(self, layer: int) -> int:
        """The row of model layer ``layer`` in this trace's tensors."""
        if layer not in self.layers:
            raise ValueError(f"layer {layer} is not a MoE layer; MoE layers here: {self.layers}")
        return self.layers.index(layer)

    @classmethod
    def from_cache(cls, cache: ActivationCache) -> RoutingTrace:
        """Build from a cache holding every MoE layer's gate probes (hook_scores ... hook_topk_weights)."""
        cfg, layers = cache.model.config, moe_layers(cache.model)
        missing = [name for i in layers for p in _GATE_PROBES if (name := f"layers.{i}.mlp.gate.{p}") not in cache]
        if missing:
            raise KeyError(f"a routing trace needs the gate probes of every MoE layer; missing e.g. {missing[:3]}")
        indices, weights = cache.stack("gate.hook_topk_idx"), cache.stack("gate.hook_topk_weights")
        scores, choice = cache.stack("gate.hook_scores"), cache.stack("gate.hook_choice_scores")
        unbiased = select_experts(scores, indices.shape[-1], cfg.n_group, cfg.topk_group)
        flips = (indices.sort(-1).values != unbiased.sort(-1).values).any(-1)  # [L_moe, B, T]
        return cls(layers, indices, weights, scores, choice, unbiased, flips)


@torch.no_grad()
def trace(model: K2Model, input_ids: torch.Tensor, **forward_kwargs) -> RoutingTrace:
    """Run ``model(input_ids)`` once, recording only the router probes, and return the routing of every MoE layer.
    Active interventions (``model.hooks``, ``k2lab.interventions``) are seen: the trace shows the routing used."""
    moe_layers(model)  # fail early, with a clear message, on a dense-only model
    wanted = lambda name: ".mlp.gate." in name and name.endswith(_GATE_PROBES)
    _, cache = model.run_with_cache(input_ids, names=wanted, **forward_kwargs)
    return RoutingTrace.from_cache(cache)
