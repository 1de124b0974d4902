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


# ---- metrics ---------------------------------------------------------------------------------------------------------
def expert_counts(tr: RoutingTrace, top: int | None = None) -> torch.Tensor:
    """[L_moe, E] int64: c_e, the tokens (over batch and positions) with expert e among their first ``top`` slots.

    ``top=None`` counts all k slots (then sum_e c_e = N k); ``top=1`` counts each token's first choice only (slots
    are ordered by choice score, best first)."""
    _check_trace(tr, top)
    idx = tr.indices if top is None else tr.indices[..., :top]  # [L_moe, B, T, top]
    E = tr.scores.shape[-1]
    return torch.stack([torch.bincount(row.flatten(), minlength=E) for row in idx])


def load_fraction(counts: torch.Tensor) -> torch.Tensor:
    """[..., E] the share of routed assignments each expert got: load_e = c_e / sum_e' c_e' (uniform: 1/E)."""
    counts = _check_counts(counts).double()
    return (counts / counts.sum(-1, keepdim=True)).float()


def relative_load(counts: torch.Tensor) -> torch.Tensor:
    """[..., E] each expert's load against the uniform share: c_e / mean_e'(c_e') = E * load_e (1 is balanced)."""
    counts = _check_counts(counts).double()
    return (counts / counts.mean(-1, keepdim=True)).float()


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
    counts = expert_counts(tr, top)  # checks the trace
    return counts.float() / tr.indices[0, ..., 0].numel()


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
        if layer not in self.layers:
            raise ValueError(f"layer {layer} is not a MoE layer of this trace; its layers: {self.layers}")
        ratio = self.ratio[self.layers.index(layer), :, expert].masked_fill(self.occurrences < min_count, -1.0)
        best = ratio.argsort(descending=True, stable=True)[:n]
        return [(int(self.token_ids[u]), float(ratio[u]), int(self.occurrences[u])) for u in best if ratio[u] >= 0]


def vocabulary_specialization(tr: RoutingTrace, token_ids: torch.Tensor, top: int = 1) -> VocabularySpecialization:
    """Count, per layer, where each token id of ``token_ids`` [B, T] (aligned with the trace's positions) was
    routed among its first ``top`` slots. See VocabularySpecialization for the definition."""
    _check_trace(tr, top)
    token_ids = torch.as_tensor(token_ids)
    if token_ids.numel() != tr.indices[0, ..., 0].numel() or token_ids.is_floating_point():
        raise ValueError(f"token_ids must be integer ids aligned with the trace's [B, T] = "
                         f"{list(tr.indices.shape[1:3])}, got {token_ids.dtype} {list(token_ids.shape)}")
    token_ids = token_ids.reshape(tr.indices.shape[1:3])  # [B, T]
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
    _check_trace(tr)
    chosen = _chosen(tr).flatten(1, 2).float()  # [L_moe, N, E] 0/1
    together = chosen.transpose(1, 2) @ chosen  # [L_moe, E, E] N(i and j); the diagonal is N(i)
    alone = together.diagonal(dim1=1, dim2=2)  # [L_moe, E]
    out = together / alone.clamp(min=1)[..., None]
    return out * (1 - torch.eye(out.shape[-1], device=out.device))


def consecutive_same_expert_rate(tr: RoutingTrace) -> torch.Tensor:
    """[L_moe] the share of neighbouring token pairs (t, t + 1), within each sequence, whose chosen sets share at
    least one expert: mean over pairs of 1[S_t and S_(t+1) intersect]. Compare with ``consecutive_baseline``."""
    _check_trace(tr)
    if tr.indices.shape[2] < 2:
        raise ValueError(f"consecutive_same_expert_rate needs sequences of 2 or more tokens; the trace's are "
                         f"{tr.indices.shape[2]} long")
    chosen = _chosen(tr)  # [L_moe, B, T, E]
    shared = (chosen[:, :, 1:] & chosen[:, :, :-1]).any(-1)  # [L_moe, B, T - 1]
    return shared.float().flatten(1).mean(-1)


def consecutive_baseline(num_experts: int, top_k: int) -> float:
    """What ``consecutive_same_expert_rate`` would be if each token drew its k experts uniformly at random:
    1 - C(E - k, k) / C(E, k), the chance that two random k-sets of E share an expert (0.156 for K2's 8 of 384)."""
    if not (_is_int(num_experts) and _is_int(top_k) and 1 <= top_k <= num_experts):
        raise ValueError(f"num_experts and top_k must be integers with 1 <= top_k <= num_experts, got "
                         f"num_experts={num_experts!r}, top_k={top_k!r}")
    return 1 - math.comb(num_experts - top_k, top_k) / math.comb(num_experts, top_k)


def router_entropy(tr: RoutingTrace, over: Literal["scores", "weights"] = "scores") -> torch.Tensor:
    """[L_moe, B, T] per-token entropy in nats, H = -sum_i p_i ln p_i, of

    - ``"scores"``: the sigmoid affinities normalised over all experts, p_e = s_e / sum_e' s_e' (max ln E): how
      sharply the router prefers some experts before the bias and the top-k cut;
    - ``"weights"``: the chosen experts' weights normalised, p_j = w_j / sum_j' w_j' (max ln k): how evenly a token
      spreads over the experts it uses."""
    if over not in ("scores", "weights"):
        raise ValueError(f"over must be 'scores' or 'weights', got {over!r}")
    _check_trace(tr)
    values = (tr.scores if over == "scores" else tr.weights).double()
    p = values / values.sum(-1, keepdim=True).clamp(min=1e-300)
    return -(p * p.clamp(min=1e-300).log()).sum(-1).float()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_trace(tr: RoutingTrace, top: int | None = None) -> None:
    """A trace with at least one MoE layer and one token; ``top`` (if given) a slot count in 1..k."""
    if not isinstance(tr, RoutingTrace):
        raise TypeError(f"tr must be a RoutingTrace (k2lab.routing.trace(model, ids)), got {type(tr).__name__}")
    if not tr.layers or tr.indices.shape[0] == 0:
        raise ValueError("the routing trace has no MoE layer: nothing to measure")
    if tr.indices[0, ..., 0].numel() == 0:
        raise ValueError(f"the routing trace holds no tokens ([B, T] = {list(tr.indices.shape[1:3])})")
    k = tr.indices.shape[-1]
    if top is not None and not (_is_int(top) and 1 <= top <= k):
        raise ValueError(f"top must be None or an integer in 1..k={k}, got {top!r}")


def _check_counts(counts: torch.Tensor) -> torch.Tensor:
    """Expert counts [..., E] with at least one routed token in every row."""
    counts = torch.as_tensor(counts)
    if counts.dim() == 0 or counts.shape[-1] == 0 or counts.is_floating_point() and not counts.isfinite().all():
        raise ValueError(f"counts must be expert counts [..., E], got {counts.dtype} {list(counts.shape)}")
    if counts.numel() == 0 or (counts.sum(-1) <= 0).any() or (counts < 0).any():
        raise ValueError("counts hold a row with no routed tokens (or a negative count): a load needs tokens; "
                         f"got shape {list(counts.shape)}")
    return counts


def _chosen(tr: RoutingTrace) -> torch.Tensor:
    """[L_moe, B, T, E] bool: expert e is in token t's chosen set."""
    out = torch.zeros(tr.scores.shape, dtype=torch.bool, device=tr.indices.device)
    return out.scatter_(-1, tr.indices, True)
