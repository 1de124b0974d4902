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

Padded batches: ``trace(model, ids, attention_mask=mask)`` keeps the mask (``tr.token_mask`` [B, T]) and every metric
counts real tokens only. Pooling and comparing text domains, splitting by token class, and a table for pandas:

    tr_code = trace_dataset(model, code_texts, batch_size=8)   # or RoutingTrace.concat of per-batch traces
    c = contrast(tr_code, tr_prose)            # per layer and expert: token and weight shares, ratios, bootstrap CIs
    digits = tr_code.select(torch.isin(tr_code.token_ids, digit_ids))   # the same trace, digit tokens only
    df = tr_code.to_dataframe()                # one row per (sequence, position, layer, slot)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from ..config import K2Config
from ..model.inputs import prepare_inputs
from ..model.moe import allowed_experts, group_best  # noqa: F401 - the router's own rule, re-exported
from ..model.transformer import K2Model
from .datasets import batches

if TYPE_CHECKING:
    import pandas

    from ..model.activation_cache import ActivationCache

_GATE_PROBES = ("hook_scores", "hook_choice_scores", "hook_topk_idx", "hook_topk_weights")


def select_experts(choice: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1,
                   best: int = 2) -> torch.Tensor:
    """[..., k] the experts the router's stage 4 picks from choice scores [..., E], best first: top-k among the
    experts of the ``topk_group`` best groups (``Router.forward``'s rule, for scores the router did not make)."""
    if n_group > 1:
        choice = choice.masked_fill(~allowed_experts(choice, n_group, topk_group, best), -torch.inf)
    return choice.topk(top_k, dim=-1).indices


def moe_layers(model: K2Model | K2Config) -> list[int]:
    """Indices of the MoE layers of a model or config (dense ones come first in K2: layer 0)."""
    cfg, L = (model, model.num_hidden_layers) if isinstance(model, K2Config) else (model.config, len(model.layers))
    layers = [i for i in range(L) if cfg.is_moe_layer(i)]
    if not layers:
        raise ValueError("this model has no MoE layer (first_k_dense_replace >= num_hidden_layers)")
    return layers


@dataclass
class RoutingTrace:
    """Per MoE layer routing of one forward. Row j of every tensor is layer ``layers[j]``.

    ``unbiased_indices`` is what the router would choose with a zero correction bias (the same rule, groups
    included, on the plain scores); ``bias_flips`` marks tokens whose chosen SET differs from it (order ignored).
    ``token_mask`` says which positions count (real tokens, narrowed further by ``select``); ``token_ids`` are the
    ids that were routed, when the trace was made from ids or text (``trace``), for tables and selections by token.
    """

    layers: list[int]
    indices: torch.Tensor  # [L_moe, B, T, k] chosen experts, best choice score first
    weights: torch.Tensor  # [L_moe, B, T, k] their weights (from the unbiased scores, renormalised, scaled)
    scores: torch.Tensor  # [L_moe, B, T, E] sigmoid(logits)
    choice_scores: torch.Tensor  # [L_moe, B, T, E] scores + e_score_correction_bias
    unbiased_indices: torch.Tensor  # [L_moe, B, T, k] the top-k of the scores without the bias
    bias_flips: torch.Tensor  # [L_moe, B, T] bool
    token_mask: torch.Tensor | None = None  # [B, T] bool: real tokens (False at pads); None: all real
    token_ids: torch.Tensor | None = None  # [B, T] int64 the routed ids (pads' ids included); None: not known

    @property
    def flip_counts(self) -> torch.Tensor:
        """[L_moe] int: tokens per layer whose chosen set the bias changed."""
        return (self.bias_flips & self.real_tokens()).flatten(1).sum(-1)

    def real_tokens(self) -> torch.Tensor:
        """[B, T] bool: the positions that hold real tokens (all, unless the trace came from a padded batch)."""
        if self.token_mask is not None:
            return self.token_mask.to(self.indices.device)
        return torch.ones(self.indices.shape[1:3], dtype=torch.bool, device=self.indices.device)

    @classmethod
    def concat(cls, traces: Sequence[RoutingTrace]) -> RoutingTrace:
        """One trace of all the sequences of ``traces`` (batches of one model), stacked along B. Shorter traces are
        padded at the end of T, and ``token_mask`` marks those pads, so lengths may differ. ``token_ids`` are joined
        when every trace has them."""
        traces = list(traces)
        if not traces:
            raise ValueError("concat needs at least one trace")
        if any(t.layers != traces[0].layers or t.scores.shape[-1] != traces[0].scores.shape[-1] for t in traces):
            raise ValueError("concat needs traces of the same model: their MoE layers or expert counts differ")
        T = max(t.indices.shape[2] for t in traces)
        device = traces[0].indices.device  # traces gathered elsewhere (the CPU, another GPU) join the first one there

        def padded(t: RoutingTrace, field: str) -> torch.Tensor:
            x = getattr(t, field).to(device)  # [L_moe, B, T, ...]
            pad = [0, 0] * (x.dim() - 3) + [0, T - x.shape[2]]
            return torch.nn.functional.pad(x, pad)

        fields = ("indices", "weights", "scores", "choice_scores", "unbiased_indices", "bias_flips")
        joined = {f: torch.cat([padded(t, f) for t in traces], dim=1) for f in fields}
        masks = [torch.nn.functional.pad(t.real_tokens().to(device), [0, T - t.indices.shape[2]]) for t in traces]
        same = all(t.token_mask is None and t.indices.shape[2] == T for t in traces)
        ids = None  # [B_total, T] only when every trace knows its ids
        if all(t.token_ids is not None for t in traces):
            ids = torch.cat([torch.nn.functional.pad(t.token_ids.to(device), [0, T - t.indices.shape[2]])
                             for t in traces])
        return cls(list(traces[0].layers), **joined, token_mask=None if same else torch.cat(masks), token_ids=ids)

    def select(self, token_mask: torch.Tensor) -> RoutingTrace:
        """The sub-trace of the tokens ``token_mask`` picks: bool (or 0/1) [B, T], aligned with this trace's
        positions (``tr.token_ids``, ``tr.real_tokens()``), on any device. Pads stay out whatever it says.

        The tensors are shared, not copied: the result keeps every sequence and position and narrows
        ``token_mask`` to the picked real tokens, so its metrics, ``concat``, ``contrast`` and ``to_dataframe`` see
        those tokens only, and sequence indices still name the same texts (a sequence with no picked token stays,
        empty). Splitting by token class:

            digits = torch.isin(tr.token_ids, digit_ids)            # [B, T]
            contrast(tr.select(digits), tr.select(~digits))
        """
        real = self.real_tokens()  # [B, T]
        picked = torch.as_tensor(token_mask)
        if tuple(picked.shape) != tuple(real.shape) or picked.is_floating_point() or picked.is_complex():
            raise ValueError(f"token_mask must be bool or 0/1 [B, T] = {list(real.shape)}, aligned with the trace's "
                             f"positions; got {picked.dtype} {list(picked.shape)}")
        if picked.dtype != torch.bool and ((picked != 0) & (picked != 1)).any():
            raise ValueError(f"token_mask holds values other than 0 and 1: {sorted(picked.unique().tolist())[:5]}")
        narrowed = real & picked.bool().to(real.device)  # [B, T]
        if not narrowed.any():
            raise ValueError(f"token_mask picks none of the trace's {int(real.sum())} real tokens: the sub-trace "
                             "would be empty")
        return dataclasses.replace(self, token_mask=narrowed)

    def to_dataframe(self) -> pandas.DataFrame:
        """The trace as a long table, one row per (sequence, position, layer, slot) of every counted token (pads and
        tokens left out by ``select`` excluded), in that order. Columns:

        - ``sequence``, ``position``: the row and column of the trace's [B, T]; the position is the token's index in
          its text when rows are unpadded or padded on the right (``trace_dataset``), and counts the pads before it
          in a left-padded row;
        - ``layer``: the model layer (not the trace's row); ``slot``: 0..k-1, highest choice score first;
        - ``token_id`` (when the trace knows its ids), ``expert``, ``weight`` (that expert's routing weight),
          ``score`` (its sigmoid score s), ``choice_score`` (s + correction bias);
        - ``bias_chosen``: the expert is in the token's set only because of the bias (not in the top-k of s alone).

        Needs pandas (``pip install "k2lab[lab]"``). The table holds L_moe * k rows per token."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError('RoutingTrace.to_dataframe needs pandas, part of the lab extra: pip install '
                              '"k2lab[lab]" (or pip install pandas)') from None
        sequence, position = self.real_tokens().nonzero(as_tuple=True)  # [N] each: the counted tokens
        per_token = lambda x: x[:, sequence, position].movedim(0, 1)  # [L_moe, B, T, ...] -> [N, L_moe, ...]
        expert = per_token(self.indices)  # [N, L_moe, k]
        N, L, k = expert.shape
        unbiased = per_token(self.unbiased_indices)  # [N, L_moe, k]
        columns = {
            "sequence": sequence[:, None, None].expand(N, L, k),
            "position": position[:, None, None].expand(N, L, k),
            "layer": torch.tensor(self.layers, device=expert.device)[None, :, None].expand(N, L, k),
            "slot": torch.arange(k, device=expert.device).expand(N, L, k),
            **({} if self.token_ids is None else
               {"token_id": self.token_ids.to(expert.device)[sequence, position][:, None, None].expand(N, L, k)}),
            "expert": expert,
            "weight": per_token(self.weights).float(),
            "score": per_token(self.scores).gather(-1, expert).float(),
            "choice_score": per_token(self.choice_scores).gather(-1, expert).float(),
            "bias_chosen": (expert[..., :, None] != unbiased[..., None, :]).all(-1),  # [N, L_moe, k]
        }
        return pd.DataFrame({name: column.flatten().cpu().numpy() for name, column in columns.items()})

    def row(self, layer: int) -> int:
        """The row of model layer ``layer`` in this trace's tensors."""
        if layer not in self.layers:
            raise ValueError(f"layer {layer} is not a MoE layer; MoE layers here: {self.layers}")
        return self.layers.index(layer)

    @classmethod
    def from_cache(cls, cache: ActivationCache) -> RoutingTrace:
        """Build from a cache holding every MoE layer's gate probes (hook_scores ... hook_topk_weights)."""
        cfg = cache.config  # a cache loaded or unpickled without its model still knows its config
        layers = moe_layers(cfg)
        missing = [name for i in layers for p in _GATE_PROBES if (name := f"layers.{i}.mlp.gate.{p}") not in cache]
        if missing:
            raise KeyError(f"a routing trace needs the gate probes of every MoE layer; missing e.g. {missing[:3]}")
        indices, weights, scores, choice = (cache.stack_present(f"gate.{leaf}")[1] for leaf in (
            "hook_topk_idx", "hook_topk_weights", "hook_scores", "hook_choice_scores"))  # [L_moe, B, T, ...]
        best = group_best(cfg.topk_method)
        unbiased = select_experts(scores, indices.shape[-1], cfg.n_group, cfg.topk_group, best)  # [L_moe, B, T, k]
        flips = (indices.sort(-1).values != unbiased.sort(-1).values).any(-1)  # [L_moe, B, T]
        tr = cls(layers, indices, weights, scores, choice, unbiased, flips)
        if cache.mask is not None:  # the pads the forward ran with: the trace's metrics and tables skip them
            tr.token_mask = cache.mask.to(indices.device)
        return tr


@torch.no_grad()
def trace(model: K2Model, input_ids: torch.Tensor, **forward_kwargs) -> RoutingTrace:
    """Run ``model(input_ids)`` once, recording only the router probes, and return the routing of every MoE layer.
    Active interventions (``model.hooks``, ``k2lab.interventions``) are seen: the trace shows the routing used.

    Pads are not tokens: with ``attention_mask=`` (a padded batch), a list of texts of different lengths (padded by
    the model's tokenizer), or ids whose rows begin or end with pads and no mask (``model.infer_attention_mask``
    finds them, as the forward does), the trace keeps the mask, and its metrics skip the pads. An explicit
    ``attention_mask`` wins. The ids are kept too (``tr.token_ids``)."""
    moe_layers(model)  # fail early, with a clear message, on a dense-only model
    wanted = lambda name: ".mlp.gate." in name and name.endswith(_GATE_PROBES)
    mask = forward_kwargs.pop("attention_mask", None)
    if isinstance(model, K2Model):  # text is tokenized, or the pads of ids found, as the model would: keep that mask
        inputs = prepare_inputs(model, input_ids, mask)
        input_ids, mask = inputs.ids, inputs.mask
    if mask is not None:
        forward_kwargs["attention_mask"] = mask
    _, cache = model.run_with_cache(input_ids, names=wanted, **forward_kwargs)
    tr = RoutingTrace.from_cache(cache)
    if mask is not None:
        tr.token_mask = torch.as_tensor(mask).reshape(tr.indices.shape[1:3]).bool().to(tr.indices.device)
    if isinstance(input_ids, torch.Tensor):
        tr.token_ids = input_ids.reshape(tr.indices.shape[1:3]).to(tr.indices.device)
    return tr


def trace_dataset(model: K2Model, texts: Iterable[str], batch_size: int = 8, max_len: int | None = None,
                  progress: bool | None = None) -> RoutingTrace:
    """The routing of every text of ``texts``, traced ``batch_size`` texts at a time (``k2lab.analysis.batches``:
    its checks, ``max_len`` keeping each text's first tokens, a progress bar), as one trace: row b of its [B, T]
    is ``texts[b]``, T the longest text's tokens, ``token_mask`` marking where each text ends.

    Batches are padded on the right, so column t is token t of its text (in every batch and in ``to_dataframe``);
    pads take no position, so the routing is the same as left padding's. The trace holds every token's scores and
    choice scores ([L_moe, B, T, E] each, float32, on the model's device): for K2 (E = 384, 60 MoE layers) about
    190 KB a token, so trace a large corpus in parts and keep what each part's metrics give."""
    parts = [trace(model, ids, attention_mask=mask)
             for ids, mask in batches(model, texts, batch_size, max_len, padding_side="right", progress=progress)]
    return RoutingTrace.concat(parts)


# ---- metrics ---------------------------------------------------------------------------------------------------------
def expert_counts(tr: RoutingTrace, top: int | None = None) -> torch.Tensor:
    """[L_moe, E] int64: c_e, the tokens (over batch and positions) with expert e among their first ``top`` slots.

    ``top=None`` counts all k slots (then sum_e c_e = N k); ``top=1`` counts each token's first choice only (slots
    are ordered by choice score, best first)."""
    _check_trace(tr, top)
    idx = (tr.indices if top is None else tr.indices[..., :top])[:, tr.real_tokens()]  # [L_moe, N, top]
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
    return counts.float() / int(tr.real_tokens().sum())


@dataclass
class VocabularySpecialization:
    """OLMoE's vocabulary specialisation: for token id x and expert e,

        specialization(e, x) = N_e^(top)(x) / N(x)

    N(x) the occurrences of x in the text, N_e^(top)(x) those routed to e among their first ``top`` slots. Pass the
    input ids to ask which experts a token goes to, or the predicted ids (argmax of the logits, aligned with the
    same positions) to ask which experts precede an output token. Every tensor lives on the device of ``counts``
    (the trace's).
    """

    layers: list[int]  # row j of ``counts`` is layer layers[j]
    token_ids: torch.Tensor  # [U] the distinct token ids seen, ascending
    occurrences: torch.Tensor  # [U] N(x)
    counts: torch.Tensor  # [L_moe, U, E] N_e^(top)(x)
    top: int

    def __post_init__(self) -> None:
        # The methods combine occurrences with counts: keep both (and the ids they index) where the counts are.
        self.token_ids, self.occurrences = (t.to(self.counts.device) for t in (self.token_ids, self.occurrences))

    @property
    def ratio(self) -> torch.Tensor:
        """[L_moe, U, E] specialization(e, x); each token's row sums to ``top``."""
        return self.counts.float() / self.occurrences[None, :, None].float()

    def mean_max(self, min_count: int = 10) -> torch.Tensor:
        """[L_moe] the layer summary: the mean over token ids seen at least ``min_count`` times of max_e
        specialization(e, x). 1 when every id always goes to the same expert; rarer ids score high by chance,
        hence ``min_count``. NaN for a layer when no id is frequent enough."""
        frequent = self.occurrences >= min_count  # [U]
        best = self.ratio.amax(-1)  # [L_moe, U]
        # A masked mean rather than best[:, frequent]: no data-dependent shape, so no GPU sync (0 / 0 gives the NaN)
        return torch.where(frequent, best, 0.0).sum(-1) / frequent.sum()

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
    routed among its first ``top`` slots. See VocabularySpecialization for the definition. The ids may lie on any
    device (the CPU, the model's); the result lies on the trace's."""
    _check_trace(tr, top)
    token_ids = torch.as_tensor(token_ids)
    if token_ids.numel() != tr.indices[0, ..., 0].numel() or token_ids.is_floating_point():
        raise ValueError(f"token_ids must be integer ids aligned with the trace's [B, T] = "
                         f"{list(tr.indices.shape[1:3])}, got {token_ids.dtype} {list(token_ids.shape)}")
    real = tr.real_tokens()  # [B, T] on the trace's device
    token_ids = token_ids.reshape(real.shape).to(real.device)  # [B, T]
    unique, inverse, occurrences = token_ids[real].unique(return_inverse=True, return_counts=True)
    E, U = tr.scores.shape[-1], len(unique)
    idx = tr.indices[..., :top][:, real]  # [L_moe, N, top] real tokens only
    cell = inverse[None, :, None] * E + idx  # [L_moe, N, top] flat (token id, expert) cell
    counts = torch.stack([torch.bincount(row.flatten(), minlength=U * E) for row in cell]).view(-1, U, E)
    return VocabularySpecialization(list(tr.layers), unique, occurrences, counts, top)


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
    real = tr.real_tokens()
    pairs = real[:, 1:] & real[:, :-1]  # [B, T - 1] both tokens real
    return shared[:, pairs].float().mean(-1)


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
    entropy = -(p * p.clamp(min=1e-300).log()).sum(-1).float()  # [L_moe, B, T]
    return entropy.masked_fill(~tr.real_tokens(), float("nan"))  # pads: NaN


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


def _chosen(tr: RoutingTrace, top: int | None = None) -> torch.Tensor:
    """[L_moe, B, T, E] bool: expert e is in token t's chosen set, its first ``top`` slots (all k when None);
    nothing at pads."""
    idx = tr.indices if top is None else tr.indices[..., :top]  # [L_moe, B, T, top]
    out = torch.zeros(tr.scores.shape, dtype=torch.bool, device=idx.device)
    return out.scatter_(-1, idx, True) & tr.real_tokens()[None, :, :, None]


# ---- contrasting two sets of texts -----------------------------------------------------------------------------------
@dataclass
class RoutingContrast:
    """Per layer and expert, how two sets of texts (domains a and b) use the routed experts. Row j is layer
    ``layers[j]``; every tensor is [L_moe, E] and each ``*_ci`` is [2, L_moe, E] (low, high).

    - ``share_*``: the share of the domain's tokens that chose the expert, N_e / N (a token chooses k experts,
      so the shares of one layer sum to k; uniform routing gives k / E);
    - ``weight_share_*``: the share of the domain's routing weight the expert received (sums to 1 per layer);
    - ``ratio``, ``weight_ratio``: a over b (inf where b is 0 and a is not; NaN where both are).

    The intervals are bootstrap percentiles over sequences (tokens of one sequence are not independent, so
    sequences are what is resampled), a and b resampled separately. The tensors lie on trace a's device.
    """

    layers: list[int]
    share_a: torch.Tensor
    share_b: torch.Tensor
    ratio: torch.Tensor
    weight_share_a: torch.Tensor
    weight_share_b: torch.Tensor
    weight_ratio: torch.Tensor
    share_a_ci: torch.Tensor
    share_b_ci: torch.Tensor
    ratio_ci: torch.Tensor
    weight_ratio_ci: torch.Tensor
    confidence: float
    num_sequences: tuple[int, int]
    num_tokens: tuple[int, int]

    def specialised(self, layer: int, toward: Literal["a", "b"] = "a") -> list[tuple[int, float, float, float]]:
        """The experts of model layer ``layer`` whose token-share ratio's interval lies wholly above 1 (toward a)
        or below 1 (toward b): (expert, ratio, low, high), most specialised first."""
        j = self.layers.index(layer)
        ratio, low, high = self.ratio[j], self.ratio_ci[0, j], self.ratio_ci[1, j]
        hit = (low > 1) if toward == "a" else (high < 1)
        order = ratio.argsort(descending=toward == "a").tolist()
        return [(e, float(ratio[e]), float(low[e]), float(high[e])) for e in order if hit[e]]


def contrast(trace_a: RoutingTrace, trace_b: RoutingTrace, top: int | None = None, num_boot: int = 1000,
             confidence: float = 0.95, seed: int = 0) -> RoutingContrast:
    """Compare the routing of two sets of texts (e.g. code in ``trace_a``, prose in ``trace_b``; pool batches with
    ``RoutingTrace.concat``). Chosen means chosen by the router: among the top-k of score + correction bias, as the
    trace records it (``top`` keeps each token's first ``top`` slots only). See RoutingContrast for the fields.

    Why not compare the sigmoid scores (or their softmax)? With a sigmoid router the scores of one token do not
    compete, and the correction bias, not the score, often decides who is chosen: an expert can score high
    everywhere and still be passed over. Token shares measure what the router did; weight shares add how much the
    chosen expert's output counted.
    """
    if trace_a.layers != trace_b.layers or trace_a.scores.shape[-1] != trace_b.scores.shape[-1]:
        raise ValueError("contrast needs traces of the same model: their MoE layers or expert counts differ")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if num_boot < 1:
        raise ValueError(f"num_boot must be >= 1, got {num_boot}")
    # The bootstrap runs on the CPU, in float64, with a CPU generator: the same draws for a seed whatever the traces'
    # devices. Its results then go back where trace a lies.
    stats = [_per_sequence(tr, top) for tr in (trace_a, trace_b)]  # (tokens [B], count [L, B, E], mass [L, B, E])

    def shares(tokens, count, mass, draws=None):
        """Token and weight shares [..., L, E]; ``draws`` [R, B] resamples sequences (how often each is drawn)."""
        if draws is None:
            return count.sum(1) / tokens.sum(), mass.sum(1) / mass.sum((1, 2))[:, None]
        n = draws @ tokens  # [R]
        c = torch.einsum("rb,lbe->rle", draws, count)
        m = torch.einsum("rb,lbe->rle", draws, mass)
        return c / n[:, None, None], m / m.sum(-1, keepdim=True)

    gen = torch.Generator().manual_seed(seed)
    (share_a, wshare_a), (share_b, wshare_b) = (shares(*s) for s in stats)
    (boot_a, wboot_a), (boot_b, wboot_b) = (shares(*s, sequence_draws(len(s[0]), num_boot, gen)) for s in stats)
    interval = lambda samples: bootstrap_interval(samples, confidence)  # [R, L, E] -> [2, L, E]

    device = trace_a.indices.device
    out = lambda t: t.float().to(device)
    return RoutingContrast(
        layers=list(trace_a.layers), share_a=out(share_a), share_b=out(share_b), ratio=out(share_a / share_b),
        weight_share_a=out(wshare_a), weight_share_b=out(wshare_b), weight_ratio=out(wshare_a / wshare_b),
        share_a_ci=out(interval(boot_a)), share_b_ci=out(interval(boot_b)), ratio_ci=out(interval(boot_a / boot_b)),
        weight_ratio_ci=out(interval(wboot_a / wboot_b)), confidence=confidence,
        num_sequences=(len(stats[0][0]), len(stats[1][0])),
        num_tokens=(int(stats[0][0].sum()), int(stats[1][0].sum())),
    )


def sequence_draws(num_sequences: int, num_boot: int, generator: torch.Generator) -> torch.Tensor:
    """[R, S] float64: how often each of S sequences is drawn in each of R = ``num_boot`` bootstrap samples of S
    draws with replacement. Statistics that are sums over sequences are then resampled by one product."""
    picks = torch.randint(0, num_sequences, (num_boot, num_sequences), generator=generator)
    ones = torch.ones(num_boot, num_sequences, dtype=torch.float64)
    return torch.zeros(num_boot, num_sequences, dtype=torch.float64).scatter_add_(1, picks, ones)


def bootstrap_interval(samples: torch.Tensor, confidence: float) -> torch.Tensor:
    """[R, ...] bootstrap samples -> [2, ...] (low, high): their outer order statistics at ``confidence``, without
    interpolation (ratios may be inf), NaN samples skipped."""
    low = torch.nanquantile(samples, (1 - confidence) / 2, dim=0, interpolation="lower")
    high = torch.nanquantile(samples, (1 + confidence) / 2, dim=0, interpolation="higher")
    return torch.stack([low, high])


def _per_sequence(tr: RoutingTrace, top: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence (float64, on the CPU): real tokens [B], tokens that chose each expert [L_moe, B, E], and the
    routing weight each expert received [L_moe, B, E], over the first ``top`` slots (all k when None)."""
    idx = tr.indices if top is None else tr.indices[..., :top]  # [L_moe, B, T, top]
    weights = tr.weights if top is None else tr.weights[..., :top]
    real = tr.real_tokens()[None, :, :, None]  # [1, B, T, 1]
    chosen = _chosen(tr, top).double()  # [L_moe, B, T, E], pads already zero
    mass = torch.zeros_like(chosen).scatter_add_(-1, idx, weights.double())  # [L_moe, B, T, E]
    tokens = tr.real_tokens().sum(-1).double()  # [B]
    return tokens.cpu(), chosen.sum(2).cpu(), (mass * real).sum(2).cpu()
