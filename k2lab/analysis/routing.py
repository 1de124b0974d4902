"""Routing: which experts each token chose, with what weights, and where the correction bias changed the choice.

    tr = k2lab.routing.trace(model, ids)
    tr.layers                     # the MoE layer indices: row j of every tensor below is layer tr.layers[j]
    tr.indices, tr.weights        # [L_moe, B, T, k]
    tr.scores, tr.choice_scores   # [L_moe, B, T, E] sigmoid affinities; affinities + correction bias
    tr.bias_flips                 # [L_moe, B, T] bool: the bias changed the chosen set
    tr.flip_counts                # [L_moe] how many tokens flipped per layer

Selection always uses the router's own rule on the choice scores (``select_experts``), never a sort of the logits:
the bias shifts choices, and groups (n_group > 1) restrict them.

Routing metrics (below ``trace``) are functions of a RoutingTrace, or of expert counts so that they also read a
training log. Notation: N tokens, E routed experts, k chosen per token, S_t the set token t chose, c_e the number of
tokens whose set holds expert e (so sum_e c_e = N k).

    counts = expert_counts(tr)                 # [L_moe, E] c_e
    relative_load(counts), max_violation(counts)
    domain_specialization(tr)                  # [L_moe, E] c_e / N, per text domain (code, prose, ...)
    vocabulary_specialization(tr, ids)         # which experts each token id goes to
    coactivation(tr)                           # [L_moe, E, E] C(i -> j)
    consecutive_same_expert_rate(tr)           # [L_moe] against consecutive_baseline(E, k)
    router_entropy(tr)                         # [L_moe, B, T]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from ..model.moe import allowed_experts, select_experts  # noqa: F401 - the router's own rule, re-exported

if TYPE_CHECKING:
    from ..model.transformer import K2Model
    from .cache import ActivationCache

_GATE_PROBES = ("hook_scores", "hook_choice_scores", "hook_topk_idx", "hook_topk_weights")


def moe_layers(model: K2Model) -> list[int]:
    """Indices of the model's MoE layers (dense ones come first in K2: layer 0)."""
    layers = [i for i in range(len(model.layers)) if model.config.is_moe_layer(i)]
    if not layers:
        raise ValueError("this model has no MoE layer (first_k_dense_replace >= num_hidden_layers)")
    return layers


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


# ---- metrics ---------------------------------------------------------------------------------------------------------
def expert_counts(tr: RoutingTrace, top: int | None = None) -> torch.Tensor:
    """[L_moe, E] int64: c_e, the tokens (over batch and positions) with expert e among their first ``top`` slots.

    ``top=None`` counts all k slots (then sum_e c_e = N k); ``top=1`` counts each token's first choice only (slots
    are ordered by choice score, best first)."""
    idx = tr.indices if top is None else tr.indices[..., :top]  # [L_moe, B, T, top]
    E = tr.scores.shape[-1]
    return torch.stack([torch.bincount(row.flatten(), minlength=E) for row in idx])


def load_fraction(counts: torch.Tensor) -> torch.Tensor:
    """[..., E] the share of routed assignments each expert got: load_e = c_e / sum_e' c_e' (uniform: 1/E)."""
    counts = counts.double()
    return (counts / counts.sum(-1, keepdim=True).clamp(min=1)).float()


def relative_load(counts: torch.Tensor) -> torch.Tensor:
    """[..., E] each expert's load against the uniform share: c_e / mean_e'(c_e') = E * load_e (1 is balanced)."""
    counts = counts.double()
    return (counts / counts.mean(-1, keepdim=True).clamp(min=1e-12)).float()


def max_violation(counts: torch.Tensor) -> torch.Tensor:
    """[...] MaxVio, the balance measure of auxiliary-loss-free balancing (Wang et al. 2024):

        MaxVio = (max_e c_e - mean_e c_e) / mean_e c_e = max_e relative_load_e - 1

    0 when perfectly balanced; 1 when the busiest expert gets twice its share. ``counts`` [..., E] from
    ``expert_counts`` or a training log's per-step loads."""
    return relative_load(counts).amax(-1) - 1


def domain_specialization(tr: RoutingTrace, top: int | None = None) -> torch.Tensor:
    """[L_moe, E] OLMoE's domain specialisation for the text this trace saw (one domain: code, prose, ...):

        specialization(e, D) = N_e^(top)(D) / N(D)

    the share of the domain's N(D) tokens that have expert e among their first ``top`` slots (all k when None).
    Uniform routing gives top / E; compare the same expert across domains."""
    n_tokens = tr.indices[0, ..., 0].numel()
    return expert_counts(tr, top).float() / max(n_tokens, 1)


@dataclass
class VocabularySpecialization:
    """OLMoE's vocabulary specialisation: for token id x and expert e,

        specialization(e, x) = N_e^(top)(x) / N(x)

    N(x) the occurrences of x in the text, N_e^(top)(x) those routed to e among their first ``top`` slots. Pass the
    input ids to ask which experts a token goes to, or the predicted ids (argmax of the logits, aligned with the
    same positions) to ask which experts precede an output token.
    """

    layers: list[int]  # row j of ``counts`` is layer layers[j]
    token_ids: torch.Tensor  # [U] the distinct token ids seen, ascending
    occurrences: torch.Tensor  # [U] N(x)
    counts: torch.Tensor  # [L_moe, U, E] N_e^(top)(x)
    top: int

    @property
    def ratio(self) -> torch.Tensor:
        """[L_moe, U, E] specialization(e, x); each token's row sums to ``top``."""
        return self.counts.float() / self.occurrences[None, :, None].float()

    def mean_max(self, min_count: int = 10) -> torch.Tensor:
        """[L_moe] the layer summary: the mean over token ids seen at least ``min_count`` times of max_e
        specialization(e, x). 1 when every id always goes to the same expert; rarer ids score high by chance,
        hence ``min_count``. NaN for a layer when no id is frequent enough."""
        frequent = self.occurrences >= min_count  # [U]
        return self.ratio[:, frequent].amax(-1).mean(-1)

    def top_tokens(self, layer: int, expert: int, n: int = 10, min_count: int = 10) -> list[tuple[int, float, int]]:
        """The ``n`` token ids most specialised to ``expert`` at model layer ``layer``: (id, ratio, N(x)),
        among ids seen at least ``min_count`` times, highest ratio first."""
        ratio = self.ratio[self.layers.index(layer), :, expert].masked_fill(self.occurrences < min_count, -1.0)
        best = ratio.argsort(descending=True, stable=True)[:n]
        return [(int(self.token_ids[u]), float(ratio[u]), int(self.occurrences[u])) for u in best if ratio[u] >= 0]


def vocabulary_specialization(tr: RoutingTrace, token_ids: torch.Tensor, top: int = 1) -> VocabularySpecialization:
    """Count, per layer, where each token id of ``token_ids`` [B, T] (aligned with the trace's positions) was
    routed among its first ``top`` slots. See VocabularySpecialization for the definition."""
    token_ids = torch.as_tensor(token_ids).reshape(tr.indices.shape[1:3])  # [B, T]
    unique, inverse, occurrences = token_ids.flatten().unique(return_inverse=True, return_counts=True)
    E, U = tr.scores.shape[-1], len(unique)
    idx = tr.indices[..., :top].flatten(1, 2)  # [L_moe, N, top]
    cell = inverse.to(idx.device)[None, :, None] * E + idx  # [L_moe, N, top] flat (token id, expert) cell
    counts = torch.stack([torch.bincount(row.flatten(), minlength=U * E) for row in cell]).view(-1, U, E)
    return VocabularySpecialization(list(tr.layers), unique, occurrences, counts.cpu(), top)


def coactivation(tr: RoutingTrace) -> torch.Tensor:
    """[L_moe, E, E] OLMoE's co-activation: how often expert j is chosen when expert i is,

        C(i -> j) = N(i and j chosen by the same token) / N(i chosen)

    Not symmetric (a busy j joins a rare i often). Rows of never-chosen experts are 0, and so is the diagonal
    (an expert trivially co-occurs with itself). Uniform random routing gives (k - 1) / (E - 1) off the diagonal."""
    chosen = _chosen(tr).flatten(1, 2).float()  # [L_moe, N, E] 0/1
    together = chosen.transpose(1, 2) @ chosen  # [L_moe, E, E] N(i and j); the diagonal is N(i)
    alone = together.diagonal(dim1=1, dim2=2)  # [L_moe, E]
    out = together / alone.clamp(min=1)[..., None]
    return out * (1 - torch.eye(out.shape[-1], device=out.device))


def consecutive_same_expert_rate(tr: RoutingTrace) -> torch.Tensor:
    """[L_moe] the share of neighbouring token pairs (t, t + 1), within each sequence, whose chosen sets share at
    least one expert: mean over pairs of 1[S_t and S_(t+1) intersect]. Compare with ``consecutive_baseline``."""
    chosen = _chosen(tr)  # [L_moe, B, T, E]
    shared = (chosen[:, :, 1:] & chosen[:, :, :-1]).any(-1)  # [L_moe, B, T - 1]
    return shared.float().flatten(1).mean(-1)


def consecutive_baseline(num_experts: int, top_k: int) -> float:
    """What ``consecutive_same_expert_rate`` would be if each token drew its k experts uniformly at random:
    1 - C(E - k, k) / C(E, k), the chance that two random k-sets of E share an expert (0.156 for K2's 8 of 384)."""
    return 1 - math.comb(num_experts - top_k, top_k) / math.comb(num_experts, top_k)


def router_entropy(tr: RoutingTrace, over: Literal["scores", "weights"] = "scores") -> torch.Tensor:
    """[L_moe, B, T] per-token entropy in nats, H = -sum_i p_i ln p_i, of

    - ``"scores"``: the sigmoid affinities normalised over all experts, p_e = s_e / sum_e' s_e' (max ln E): how
      sharply the router prefers some experts before the bias and the top-k cut;
    - ``"weights"``: the chosen experts' weights normalised, p_j = w_j / sum_j' w_j' (max ln k): how evenly a token
      spreads over the experts it uses."""
    if over not in ("scores", "weights"):
        raise ValueError(f"over must be 'scores' or 'weights', got {over!r}")
    values = (tr.scores if over == "scores" else tr.weights).double()
    p = values / values.sum(-1, keepdim=True).clamp(min=1e-300)
    return -(p * p.clamp(min=1e-300).log()).sum(-1).float()


def _chosen(tr: RoutingTrace) -> torch.Tensor:
    """[L_moe, B, T, E] bool: expert e is in token t's chosen set."""
    out = torch.zeros(tr.scores.shape, dtype=torch.bool, device=tr.indices.device)
    return out.scatter_(-1, tr.indices, True)
