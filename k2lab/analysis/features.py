"""Features against experts: does a routed expert hold a set of a dictionary's features, or does each feature spread
over many experts? Three measurements, each against what chance gives.

    ft = trace_features(model, sae, texts)          # the features and every MoE layer's routing of the same tokens
    p = purity(ft.active(), ft.chosen(layer=4))      # per feature: the experts its tokens go to, against a shuffle
    info = information(ft.active(), ft.chosen(), ft.sequences(), layers=ft.routing.layers)   # per layer, with CIs
    attr = expert_attribution(model, transcoder, texts)   # per expert: the transcoder features its output lies along
    read = router_read(model, sae, layer=4)          # [F, E]: W_gate (g * W_dec[f]), each feature's direct read
    effect = routing_effect(model, sae, [353], texts)   # ablate (or steer) features, the routing change per layer,
                                                        # against controls matched on frequency, with intervals

Notation: N real tokens, F features, E routed experts, k chosen per token, L_moe MoE layers. A feature is *active*
on a token when its activation is above 0; an expert is *chosen* by a token when it is among the token's k.

- **Purity** of feature f: the share of its active tokens that chose its most frequent expert,
  max_e n(f, e) / n(f). 1 when every token it fires on goes to one expert. Rare features and busy experts score
  high by chance, so the baseline is the same purity with the routing shuffled across tokens (each expert keeps its
  load, each feature its count, and the link between them is cut). Shuffled only among tokens of the same id
  (``within=ft.tokens()``), the baseline keeps what the token alone says about both: purity above that one is
  more than "this feature and this expert both like the token ``def``".
- **Mutual information** I(A_f; C_e) in bits between "feature f is active" and "expert e is chosen", from their
  2 x 2 table over tokens. Per feature the best expert's, and its share of the feature's own entropy,
  I / H(A_f): 1 when the feature is active exactly when that expert is chosen (then I = H(A_f) = H(C_e)). The layer
  summary is the mean share over the features active often enough, with bootstrap intervals over sequences (tokens
  of one text are not independent, as in ``routing.contrast``) and the shuffled baseline, each corrected for the
  plug-in estimate's upward bias.
- **Expert attribution** of a transcoder's features: the MoE's output is the shared expert plus sum_j w_j o_j over
  the chosen slots; the transcoder's is b_dec + sum_f a_f W_dec[f]. The share of expert e's output along feature f
  is sum_t <a_f(t) W_dec[f], w_e(t) o_e(t)> / sum_t |w_e(t) o_e(t)|^2 over the tokens t routed to e: 1 when the
  feature's term is the expert's output, 0 when orthogonal to it; summed over features, the share of the expert's
  output the transcoder accounts for.
- **Router read and routing effect**: what a feature *does* to the routing rather than what it co-occurs with. The
  read is the linear part: adding a W_dec[f] to the residual a router reads moves expert e's logit by
  a (W_gate (g * W_dec[f]))_e / rms(x). The effect is measured: zero (or steer) the feature on its tokens and count
  how their choices and weights change at each later MoE layer, against features of the same frequency treated
  alike, with bootstrap intervals over texts.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import routing
from .datasets import batches
from .routing import RoutingTrace, bootstrap_interval, moe_layers, sequence_draws
from .splicing import ProbeSpec, _block_of, _probe_pair, splice

if TYPE_CHECKING:
    from ..model.hooks import HookPoint
    from ..model.transformer import K2Model


# ---- collecting features and routing ---------------------------------------------------------------------------------
@dataclass
class FeatureTrace:
    """A dictionary's features and every MoE layer's routing over the same tokens (the dictionary spliced in with its
    error term kept, so the routing is the model's own). Row b is the b-th text; pads are 0 in ``features`` and
    False in ``routing.token_mask``."""

    features: torch.Tensor  # [B, T, F] feature activations, float32
    routing: RoutingTrace  # [L_moe, B, T, k] indices and the rest; token_ids [B, T]
    probe: str  # the features probe they were read at, "<probe>.hook_features"

    def active(self) -> torch.Tensor:
        """[N, F] bool: which features are active on each real token (text by text, in order)."""
        return self.features[self.routing.real_tokens()] > 0

    def chosen(self, layer: int | None = None) -> torch.Tensor:
        """[N, E] bool: the experts each real token chose at model layer ``layer``; [L_moe, N, E] for every MoE layer
        when None (row j is layer ``routing.layers[j]``)."""
        chosen = routing._chosen(self.routing)[:, self.routing.real_tokens()]  # [L_moe, N, E]
        return chosen if layer is None else chosen[self.routing.row(layer)]

    def sequences(self) -> torch.Tensor:
        """[N] int64: the text (row b) each real token comes from; what the bootstrap resamples."""
        real = self.routing.real_tokens()  # [B, T]
        rows = torch.arange(real.shape[0], device=real.device)[:, None].expand_as(real)  # [B, T]
        return rows[real]

    def tokens(self) -> torch.Tensor:
        """[N] int64: the id of each real token (a shuffle ``within`` them keeps what the token itself explains)."""
        return self.routing.token_ids[self.routing.real_tokens()]

    def top_activations(self, feature: int, n: int = 10) -> list[tuple[int, int, float]]:
        """The ``n`` tokens where ``feature`` is most active: (text, position, activation), strongest first, active
        tokens only."""
        if not 0 <= feature < self.features.shape[-1]:
            raise ValueError(f"feature must be in 0..{self.features.shape[-1] - 1}, got {feature}")
        values = self.features[..., feature]  # [B, T]
        top = values.flatten().topk(min(n, values.numel()))
        T = values.shape[1]
        return [(int(i) // T, int(i) % T, float(v)) for v, i in zip(top.values, top.indices, strict=True) if v > 0]

    def top_contexts(self, feature: int, decode: Callable[[list[int]], str], n: int = 5, before: int = 8) -> list[str]:
        """The text around the ``n`` tokens where ``feature`` is most active: ``before`` tokens of context, then the
        token itself in guillemets (``'x = «[»'``); ``decode`` turns ids into text (``tokenizer.decode``)."""
        ids = self.routing.token_ids  # [B, T]
        return [decode(ids[b, max(0, t - before):t].tolist()) + "«" + decode([int(ids[b, t])]) + "»"
                for b, t, _ in self.top_activations(feature, n)]


@torch.no_grad()
def trace_features(model: K2Model, dictionary: nn.Module, texts: Iterable[str], probe: ProbeSpec | None = None,
                   batch_size: int = 8, max_len: int | None = None, progress: bool | None = None) -> FeatureTrace:
    """Run ``texts`` (``batch_size`` at a time, each cut to ``max_len`` tokens, as ``k2lab.analysis.batches``) with
    ``dictionary`` spliced into ``probe`` (default: where it was trained, ``dictionary.probe``) with its error term
    kept, and record its features and the routing of every MoE layer. The features are kept dense, B x T x F floats
    (11,000 tokens of 2,048 features take 90 MB): trace a large corpus in parts."""
    probe = _probe_of(dictionary, probe)
    recorded: list[torch.Tensor] = []  # one [b, T, F] per batch

    def record(features: torch.Tensor, hook: HookPoint) -> None:
        recorded.append(features.detach().float())

    traces = []
    with splice(model, probe, dictionary, keep_error=True) as point, model.hooks(fwd_hooks=[(point.name, record)]):
        for ids, mask in batches(model, texts, batch_size, max_len, padding_side="right", progress=progress):
            traces.append(routing.trace(model, ids, attention_mask=mask))
            recorded[-1] = recorded[-1] * mask[..., None]  # pads: no feature is active
    T = max(f.shape[1] for f in recorded)
    features = torch.cat([nn.functional.pad(f, (0, 0, 0, T - f.shape[1])) for f in recorded])  # [B, T, F]
    return FeatureTrace(features, RoutingTrace.concat(traces), point.name)


def _probe_of(dictionary: nn.Module, probe: ProbeSpec | None) -> ProbeSpec:
    """The probe given, or the one the dictionary records (k2lab's dictionaries know where they were trained)."""
    if probe is not None:
        return probe
    try:
        return dictionary.probe
    except (AttributeError, ValueError) as err:
        raise ValueError(f"{type(dictionary).__name__} records no probe; pass probe= (a probe name, or (read, write) "
                         f"for a transcoder)") from err


# ---- purity -----------------------------------------------------------------------------------------------------
@dataclass
class FeaturePurity:
    """Per feature, where its active tokens were routed in one layer (see the module docstring). Features never
    active have NaN purity and baseline."""

    counts: torch.Tensor  # [F, E] active tokens of feature f that chose expert e
    active: torch.Tensor  # [F] tokens on which feature f is active
    top_expert: torch.Tensor  # [F] the expert most of them chose
    purity: torch.Tensor  # [F] the share of them that chose it
    baseline: torch.Tensor  # [F] the same with the routing shuffled across tokens, mean over the shuffles

    @property
    def distribution(self) -> torch.Tensor:
        """[F, E] the share of feature f's active tokens that chose expert e (a row sums to k)."""
        return self.counts / self.active[:, None]

    def purest(self, n: int = 10, min_active: int = 20) -> list[tuple[int, int, float, float, int]]:
        """The ``n`` features whose purity most exceeds its baseline, among those active on ``min_active`` tokens or
        more: (feature, top expert, purity, baseline, active tokens), largest excess first."""
        excess = (self.purity - self.baseline).masked_fill(self.active < min_active, -torch.inf)  # [F]
        order = excess.argsort(descending=True, stable=True)[:n].tolist()
        return [(f, int(self.top_expert[f]), float(self.purity[f]), float(self.baseline[f]), int(self.active[f]))
                for f in order if excess[f] > -torch.inf]


def purity(active: torch.Tensor, chosen: torch.Tensor, num_shuffles: int = 10, within: torch.Tensor | None = None,
           seed: int = 0) -> FeaturePurity:
    """Each feature's expert distribution and purity in one layer: ``active`` [N, F] and ``chosen`` [N, E], bool, over
    the same tokens (``FeatureTrace.active()`` and ``.chosen(layer)``). The baseline shuffles the rows of ``chosen``
    ``num_shuffles`` times (seeded): across all tokens, or only among tokens of the same label when ``within`` [N]
    gives labels (``FeatureTrace.tokens()``: then the baseline keeps what the token ids alone explain)."""
    _check_tokens(active, chosen, "[N, E]")
    _check_positive(num_shuffles=num_shuffles)
    _check_labels(within, active.shape[0])
    active_f, chosen_f = active.float(), chosen.float()
    counts = active_f.T @ chosen_f  # [F, E]
    n_active = active_f.sum(0)  # [F]
    generator = torch.Generator().manual_seed(seed)
    shuffled = torch.zeros_like(n_active)  # [F]
    for _ in range(num_shuffles):
        order = _shuffled_order(len(chosen), within, generator).to(chosen.device)
        shuffled += (active_f.T @ chosen_f[order]).amax(-1)
    return FeaturePurity(counts=counts, active=n_active, top_expert=counts.argmax(-1),
                         purity=counts.amax(-1) / n_active, baseline=shuffled / num_shuffles / n_active)


# ---- mutual information -------------------------------------------------------------------------------------------
@dataclass
class FeatureInformation:
    """Per MoE layer (row j is model layer ``layers[j]``), how much feature activity and expert choice tell about each
    other (see the module docstring). Features outside ``counted`` (active on fewer than ``min_active`` tokens, or on
    all) have NaN in the per-feature tensors and stay out of the means.

    The per-feature tensors are plug-in estimates (the counts' own information), which finite samples bias upward.
    The layer summaries are bias-corrected: ``mean_share`` is the plug-in mean less the bias the bootstrap measures,
    ``mean_share_ci`` the basic bootstrap interval around it, and ``baseline`` corrected the same way, so the three
    compare with one another (``mean_share_plugin`` is the uncorrected mean)."""

    layers: list[int]
    bits: torch.Tensor  # [L_moe, F] max_e I(A_f; C_e), bits (plug-in)
    best_expert: torch.Tensor  # [L_moe, F] the e that maximises it
    share: torch.Tensor  # [L_moe, F] bits / H(A_f), in [0, 1] (plug-in)
    mean_share: torch.Tensor  # [L_moe] mean of share over the counted features, bias-corrected
    mean_share_ci: torch.Tensor  # [2, L_moe] bootstrap interval over sequences (low, high), bias-corrected
    baseline: torch.Tensor  # [L_moe] mean_share with the routing shuffled across tokens, bias-corrected
    counted: torch.Tensor  # [F] bool
    confidence: float
    num_sequences: int
    num_tokens: int
    mean_share_plugin: torch.Tensor  # [L_moe] the plug-in mean of share (mean_share before the correction)


def information(active: torch.Tensor | FeatureTrace, chosen: torch.Tensor | None = None,
                sequences: torch.Tensor | None = None, layers: list[int] | None = None, min_active: int = 50,
                num_boot: int = 200, num_shuffles: int = 5, within: torch.Tensor | None = None,
                confidence: float = 0.95, seed: int = 0) -> FeatureInformation:
    """Mutual information between each feature's activity and each expert's choice, per MoE layer: from a
    ``FeatureTrace`` alone (``information(ft)``, which reads the four below from it), or from ``active`` [N, F] bool,
    ``chosen`` [L_moe, N, E] bool, ``sequences`` [N] naming each token's text and ``layers``, the model layer of each
    row of ``chosen`` (``FeatureTrace.active()``, ``.chosen()``, ``.sequences()``, ``.routing.layers``). The intervals
    resample texts ``num_boot`` times; the baseline averages ``num_shuffles`` shuffles of the routing across tokens
    (within labels, as ``purity``, when ``within`` [N] gives them). Seeded.

    Bias: the plug-in information of a finite sample is biased upward (a feature seen 10 times shares a lot with some
    expert by chance, and the best of E experts more so), and a resample, which repeats texts, is biased about as
    much again, so a plain percentile interval lies above the estimate and above the truth. The summaries are
    therefore corrected by the bootstrap's own measure of that bias, b = mean(resampled) - plug-in: the estimate is
    plug-in - b and the interval the basic bootstrap one, [2 plug-in - q_high, 2 plug-in - q_low] (the percentile
    interval reflected about the estimate), both clipped to [0, 1]. Percentile-based corrections (BC, BCa) cannot
    reach below the smallest resample, and here every resample can lie above the estimate. The baseline is corrected
    the same way, each shuffle from num_boot / num_shuffles resamples. Only features active on ``min_active`` tokens
    or more count: rarer ones carry the most bias."""
    if isinstance(active, FeatureTrace):
        given = [name for name, value in (("chosen", chosen), ("sequences", sequences), ("layers", layers))
                 if value is not None]
        if given:
            raise TypeError(f"information(trace) reads chosen, sequences and layers from the trace; drop "
                            f"{', '.join(given)}")
        trace = active
        active, chosen, sequences, layers = (trace.active(), trace.chosen(), trace.sequences(),
                                             list(trace.routing.layers))
    if chosen is None or sequences is None:
        raise TypeError("information takes a FeatureTrace alone, or active [N, F], chosen [L_moe, N, E] and "
                        "sequences [N] (with layers=)")
    _check_tokens(active, chosen, "[L_moe, N, E]")
    if layers is None:
        raise ValueError(f"information: give layers=, the model layer of each of chosen's {len(chosen)} rows "
                         f"(ft.routing.layers), or pass the FeatureTrace itself: information(ft); numbering the "
                         f"rows 0, 1, ... would label them with layers they are not")
    try:  # ints, or anything that is one (a numpy or 0-d torch integer), never a bool
        named = [operator.index(layer) if not isinstance(layer, bool) else None for layer in layers]
    except TypeError:
        named = [None]
    if None in named:
        raise ValueError(f"layers must be model layer indices (ints), got {layers!r}")
    layers = named
    if len(layers) != len(chosen):
        raise ValueError(f"layers names {len(layers)} layers but chosen holds {len(chosen)} ([L_moe, N, E])")
    if not isinstance(sequences, torch.Tensor) or sequences.shape != (active.shape[0],) or \
            sequences.is_floating_point():
        raise ValueError(f"sequences must be integer text indices [N] = [{active.shape[0]}], got "
                         f"{_described(sequences)}")
    _check_positive(min_active=min_active, num_boot=num_boot, num_shuffles=num_shuffles)
    _check_labels(within, active.shape[0])
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    # Everything below is counts summed per text: the statistic of a bootstrap sample is the same function of the
    # drawn texts' sums. float64 on the CPU, so the same seed draws the same samples on every device.
    _, text = sequences.cpu().unique(return_inverse=True)  # [N] 0..S-1
    S = int(text.max()) + 1
    a = active.cpu().double()  # [N, F]
    c = chosen.cpu().double()  # [L, N, E]
    n_active = a.sum(0)  # [F]
    counted = (n_active >= min_active) & (n_active < len(a))  # [F]
    if not counted.any():
        raise ValueError(f"information: no feature is active on min_active={min_active} tokens or more (and on fewer "
                         f"than all {len(a):,}), so there is no mean to take; lower min_active or trace more text")
    totals = (torch.tensor([float(len(a))]), n_active[None], c.sum(1)[None], torch.einsum("nf,lne->lfe", a, c)[None])
    bits, best, share, plugin = _best_expert_information(*totals, counted)  # per feature [L, F]; plugin [1, L]
    a = a[:, counted]  # [N, F_counted]: only the counted features enter the summaries
    every = torch.ones(int(counted.sum()), dtype=torch.bool)
    members = [text == s for s in range(S)]

    def text_sums(c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per text: tokens [S], active [S, F], chosen [L, S, E], both [L, S, F, E]."""
        both = torch.stack([torch.stack([a[m].T @ layer[m] for m in members]) for layer in c])
        tokens = torch.stack([m.sum() for m in members]).double()
        return (tokens, torch.stack([a[m].sum(0) for m in members]), torch.stack([c[:, m].sum(1) for m in members], 1),
                both)

    observed = text_sums(c)
    step = max(1, 2**22 // max(1, observed[3][:, 0].numel()))  # samples at a time: about 4M cells [R, L, F, E]

    def mean_share(per_text: tuple[torch.Tensor, ...], draws: torch.Tensor) -> torch.Tensor:
        """[R, L] the plug-in mean share of each sample of ``draws`` [R, S]."""
        return torch.cat([_best_expert_information(*_summed(per_text, chunk), every)[3] for chunk in draws.split(step)])

    gen = torch.Generator().manual_seed(seed)
    draws = sequence_draws(S, num_boot, gen)  # [R, S]
    boot = mean_share(observed, draws)  # [R, L]
    corrected = (2 * plugin[0] - boot.nanmean(0)).clamp(0, 1)  # [L] plug-in less the bootstrap's bias
    low, high = bootstrap_interval(boot, confidence)  # [L] each
    interval = torch.stack([2 * plugin[0] - high, 2 * plugin[0] - low]).clamp(0, 1)  # [2, L] the basic interval
    per_shuffle = draws[:max(1, -(-num_boot // num_shuffles))]  # [R / num_shuffles, S]
    everything = torch.ones(1, S, dtype=torch.float64)  # one sample: every text once
    shuffled = []
    for _ in range(num_shuffles):
        sums = text_sums(c[:, _shuffled_order(len(c[0]), within, gen)])
        shuffled.append(2 * mean_share(sums, everything)[0] - mean_share(sums, per_shuffle).nanmean(0))  # [L]
    device = active.device
    return FeatureInformation(
        layers=layers, bits=bits.float().to(device), best_expert=best.to(device), share=share.float().to(device),
        mean_share=corrected.float().to(device), mean_share_ci=interval.float().to(device),
        baseline=torch.stack(shuffled).mean(0).clamp(0, 1).float().to(device), counted=counted.to(device),
        confidence=confidence, num_sequences=S, num_tokens=len(a), mean_share_plugin=plugin[0].float().to(device))


def _summed(per_text: tuple[torch.Tensor, ...], draws: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The totals of per-text sums (tokens [S], active [S, F], chosen [L, S, E], both [L, S, F, E]) over each
    sample of ``draws`` [R, S] (how often each text is drawn; None: one sample of every text once): n [R],
    n_a [R, F], n_c [R, L, E], n_ac [R, L, F, E]."""
    tokens, active, chosen, both = per_text
    draws = torch.ones(1, len(tokens), dtype=torch.float64) if draws is None else draws
    return (draws @ tokens, draws @ active, torch.einsum("rs,lse->rle", draws, chosen),
            torch.einsum("rs,lsfe->rlfe", draws, both))


def _best_expert_information(n: torch.Tensor, n_a: torch.Tensor, n_c: torch.Tensor, n_ac: torch.Tensor,
                             counted: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """From token counts [R], active counts [R, F], chosen counts [R, L, E] and joint counts [R, L, F, E]: per
    feature the best expert's information in bits [L, F] (of the first sample), that expert [L, F], its share of
    H(A_f) [L, F], and the mean share over ``counted`` features per sample [R, L]."""
    n = n[:, None, None, None]  # [R, 1, 1, 1]
    p_a = n_a[:, None, :, None] / n  # [R, 1, F, 1]
    p_c = n_c[:, :, None, :] / n  # [R, L, 1, E]
    p_ac = n_ac / n  # [R, L, F, E] both
    cells = ((p_ac, p_a * p_c), (p_a - p_ac, p_a * (1 - p_c)), (p_c - p_ac, (1 - p_a) * p_c),
             (1 - p_a - p_c + p_ac, (1 - p_a) * (1 - p_c)))  # (joint, product of marginals) for the 2 x 2 cells
    bits = sum(_plogp_ratio(joint, product) for joint, product in cells)  # [R, L, F, E]
    best_bits, best = bits.max(-1)  # [R, L, F]
    entropy = _entropy_bits(p_a[:, :, :, 0])  # [R, 1, F]
    share = (best_bits / entropy).masked_fill(~counted, torch.nan)  # [R, L, F]; NaN also where a sample's H is 0
    mean_share = share.nanmean(-1)  # [R, L]
    return best_bits[0].masked_fill(~counted, torch.nan), best[0], share[0], mean_share


def _plogp_ratio(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p log2(p / q), 0 where p is 0 (the limit); p and q are probabilities, q > 0 wherever p > 0."""
    p = p.clamp(min=0)  # rounding can leave -1e-17 in a cell computed as a difference
    return torch.where(p > 0, p * (p / q.clamp(min=1e-300)).log2(), 0.0)


def _entropy_bits(p: torch.Tensor) -> torch.Tensor:
    """H of a Bernoulli(p) in bits, elementwise."""
    return -(_plogp_ratio(p, torch.ones_like(p)) + _plogp_ratio(1 - p, torch.ones_like(p)))


def _shuffled_order(n: int, within: torch.Tensor | None, generator: torch.Generator) -> torch.Tensor:
    """[n] a random permutation of 0..n-1 (on the CPU), which moves each position only among the positions of the
    same label when ``within`` [n] gives labels: row i of ``x[order]`` is a random row of ``x`` with i's label."""
    if within is None:
        return torch.randperm(n, generator=generator)
    labels = within.cpu()
    grouped = labels.argsort(stable=True)  # [n] positions, label by label, in order
    mixed = torch.randperm(n, generator=generator)
    mixed = mixed[labels[mixed].argsort(stable=True)]  # [n] label by label, in a random order within each label
    order = torch.empty(n, dtype=torch.long)
    order[grouped] = mixed
    return order


# ---- which features an expert's output is made of ---------------------------------------------------------------
@dataclass
class ExpertAttribution:
    """Per routed expert of one MoE layer, the share of its output (its squared norm, summed over the tokens routed
    to it) that lies along each transcoder feature's term (see the module docstring)."""

    layer: int
    shares: torch.Tensor  # [E, F]
    tokens: torch.Tensor  # [E] (token, slot) pairs routed to each expert

    @property
    def explained(self) -> torch.Tensor:
        """[E] the share of each expert's output that the transcoder's features account for, together. It can pass 1:
        a feature's term also carries what other experts and the shared expert write, and may overshoot along this
        expert's output."""
        return self.shares.sum(-1)

    def top_features(self, expert: int, n: int = 10) -> list[tuple[int, float]]:
        """The ``n`` features with the largest share of ``expert``'s output: (feature, share), largest first."""
        if not 0 <= expert < len(self.shares):
            raise ValueError(f"expert must be in 0..{len(self.shares) - 1}, got {expert}")
        top = self.shares[expert].topk(min(n, self.shares.shape[1]))
        return [(int(f), float(s)) for s, f in zip(top.values, top.indices, strict=True)]


def attribution_sums(features: torch.Tensor, decoder: torch.Tensor, expert_out: torch.Tensor, indices: torch.Tensor,
                     weights: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sums behind ``ExpertAttribution`` for N tokens: ``features`` [N, F], the decoder's rows ``decoder`` [F, D],
    each chosen expert's output ``expert_out`` [N, k, D] (``hook_expert_out``), ``indices`` and ``weights`` [N, k]
    (the router's). Returns sum_t <a_f W_dec[f], w o_e> [E, F], sum_t |w o_e|^2 [E] and the (token, slot) pairs per
    expert [E], summed over the tokens routed to each expert."""
    if expert_out.dim() != 3:
        raise ValueError(f"expert_out must be [N, k, D] (hook_expert_out at real tokens), got {_described(expert_out)}")
    N, k, D = expert_out.shape
    if features.shape[0] != N or decoder.shape != (features.shape[1], D) or indices.shape != (N, k) or \
            weights.shape != (N, k):
        shapes = ", ".join(str(list(t.shape)) for t in (features, decoder, expert_out, indices, weights))
        raise ValueError(f"attribution_sums needs features [N, F], decoder [F, D], expert_out [N, k, D], indices and "
                         f"weights [N, k]; got {shapes}")
    contribution = (weights[..., None] * expert_out).float()  # [N, k, D] w_j o_j: what each slot adds to the output
    along = torch.zeros(num_experts, features.shape[1], device=features.device)  # [E, F]
    for e in indices.unique().tolist():
        token, slot = torch.where(indices == e)  # the (token, slot) pairs routed to expert e
        # <a_f W_dec[f], c> = a_f <W_dec[f], c>, summed over those pairs: [n_e, F] -> [F]
        along[e] = (features[token].float() * (contribution[token, slot] @ decoder.float().T)).sum(0)
    expert, energy = indices.flatten(), contribution.pow(2).sum(-1).flatten()  # [N k] each: the slot's expert, |c|^2
    return (along, torch.zeros(num_experts, device=features.device).index_add_(0, expert, energy),
            torch.bincount(expert, minlength=num_experts))


@torch.no_grad()
def expert_attribution(model: K2Model, transcoder: nn.Module, texts: Iterable[str], probe: ProbeSpec | None = None,
                       batch_size: int = 8, max_len: int | None = None, progress: bool | None = None
                       ) -> ExpertAttribution:
    """Which of ``transcoder``'s features each routed expert's output is made of, over ``texts``. The transcoder
    writes an MoE layer's ``hook_mlp_out`` (``probe``: default where it was trained), its decoder rows are
    ``transcoder.W_dec`` [F, D] (k2lab's and SAELens's layout); it is spliced in with its error term kept, so the
    experts and the routing are the model's own."""
    read, write = _probe_pair(model, _probe_of(transcoder, probe))
    match = re.fullmatch(r"layers\.(\d+)\.hook_mlp_out", write)
    if match is None or int(match[1]) not in moe_layers(model):
        raise ValueError(f"expert_attribution needs a dictionary that writes an MoE layer's hook_mlp_out (layers "
                         f"{moe_layers(model)}), got {write}")
    decoder = getattr(transcoder, "W_dec", None)
    if not isinstance(decoder, torch.Tensor):
        raise TypeError(f"expert_attribution reads the feature directions from W_dec [F, D]; "
                        f"{type(transcoder).__name__} has none")
    layer = int(match[1])
    prefix = f"layers.{layer}.mlp."
    names = [f"{write}.hook_features", prefix + "hook_expert_out", prefix + "gate.hook_topk_idx",
             prefix + "gate.hook_topk_weights"]
    num_experts = model.config.n_routed_experts
    totals = None
    with splice(model, (read, write), transcoder, keep_error=True):
        for ids, mask in batches(model, texts, batch_size, max_len, padding_side="right", progress=progress):
            _, cache = model.run_with_cache(ids, names=names, attention_mask=mask)
            features, expert_out, indices, weights = (cache[name][mask.bool()] for name in names)  # real tokens
            sums = attribution_sums(features, decoder.detach(), expert_out, indices, weights, num_experts)
            totals = sums if totals is None else tuple(t + s for t, s in zip(totals, sums, strict=True))
    along, energy, pairs = totals
    return ExpertAttribution(layer, along / energy.clamp(min=1e-30)[:, None], pairs)


# ---- features that steer the router --------------------------------------------------------------------------------
# Probes of a block that fire before its router reads the residual stream: a dictionary written there reaches the
# block's own router; one written anywhere else in a block reaches only later blocks' routers.
_BEFORE_ROUTER = ("hook_resid_pre", "input_layernorm.", "self_attn.", "hook_attn_out", "hook_resid_mid",
                  "post_attention_layernorm.")
_RESIDUAL_WRITES = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out")


def reachable_moe_layers(model: K2Model, probe: str) -> list[int]:
    """The MoE layers whose router a dictionary spliced at ``probe`` (its write probe) can move: those whose router
    reads the residual stream after the probe fires."""
    name = _probe_pair(model, probe)[1]
    block = _block_of(name, len(model.layers))
    leaf = name.split(".", 2)[2] if name.startswith("layers.") else ""
    first = block if leaf.startswith(_BEFORE_ROUTER) else block + 1
    return [layer for layer in moe_layers(model) if layer >= first]


def router_read(model: K2Model, dictionary: nn.Module, layer: int, probe: ProbeSpec | None = None) -> torch.Tensor:
    """[F, E] the direct read of each feature by MoE layer ``layer``'s router: W_gate (g * W_dec[f]), with g the
    layer's post-attention norm weight, from ``dictionary``'s decoder (W_dec [F, D]) written into the residual stream
    at ``probe`` (default where it was trained; an SAE on the residual stream, or a transcoder of an earlier block's
    feed-forward or attention output).

    Read it per unit of the feature's activation and of the token's inverse rms: adding a * W_dec[f] to the residual
    at a token whose residual x reaches the router unchanged (no attention or block in between) changes expert e's
    router logit by a * read[f, e] / rms(x), to first order with the norm's denominator held, which is how
    attribution graphs hold it (``k2lab.circuits``). The denominator's own change adds
    -a (x . W_dec[f]) / (D rms(x)^2) * logit_e (the router's logits scaled down with the whole normalised vector).
    Paths through attention or later blocks between the probe and the router are not in the direct read."""
    name = _probe_pair(model, _probe_of(dictionary, probe))[1]
    leaf = name.rsplit(".", 1)[-1]
    if not (name == "embed_tokens.hook_out" or (name.startswith("layers.") and leaf in _RESIDUAL_WRITES)):
        raise ValueError(f"router_read needs a dictionary that writes the residual stream (the embeddings, "
                         f"hook_resid_pre/mid/post, hook_attn_out or hook_mlp_out); {name} is not added to it")
    if layer not in moe_layers(model):
        raise ValueError(f"layer {layer!r} has no router: the MoE layers are {moe_layers(model)}")
    if layer not in reachable_moe_layers(model, name):
        raise ValueError(f"layer {layer}'s router does not read what {name} writes: the MoE layers it reaches are "
                         f"{reachable_moe_layers(model, name)}")
    decoder = getattr(dictionary, "W_dec", None)
    if not isinstance(decoder, torch.Tensor) or decoder.dim() != 2 or decoder.shape[1] != model.config.hidden_size:
        raise TypeError(f"router_read reads the feature directions from W_dec [F, {model.config.hidden_size}]; "
                        f"{type(dictionary).__name__} has {_described(decoder)}")
    block = model.layers[layer]
    g = block.post_attention_layernorm.weight.detach().float()  # [D]
    gate = block.mlp.gate.weight.detach().float()  # [E, D]
    return (decoder.detach().float().to(gate.device) * g) @ gate.T  # [F, E]


@dataclass
class RoutingEffect:
    """What an intervention on features does to the routing of their own tokens (the tokens where one of them is
    active in the clean run), per MoE layer it can reach, against control features matched on frequency, each
    intervened on in the same way and measured on its own tokens. Intervals: percentiles of a bootstrap over texts
    (``confidence``), the controls resampled with the same draws as the features (paired by text)."""

    layers: list[int]  # the MoE layers the intervention can reach
    features: list[int]
    controls: list[list[int]]  # each control set: one feature per feature, of the nearest frequency
    mode: str
    scale: float
    tokens: int  # the features' tokens
    rate_change: torch.Tensor  # [L, E] change of the share of those tokens that choose each expert
    rate_change_ci: torch.Tensor  # [2, L, E]
    weight_change: torch.Tensor  # [L, E] change of the mean routing weight each expert gets on them (0 unchosen)
    weight_change_ci: torch.Tensor  # [2, L, E]
    moved: torch.Tensor  # [L] the share of the tokens' k choices that changed
    moved_ci: torch.Tensor  # [2, L]
    control_moved: torch.Tensor  # [C, L] the same for each control set, on its own tokens
    excess: torch.Tensor  # [L] moved minus the controls' mean
    excess_ci: torch.Tensor  # [2, L]
    confidence: float

    def __str__(self) -> str:
        lines = [f"{self.mode} features {self.features} ({self.tokens} tokens), against {len(self.controls)} "
                 f"matched control sets:"]
        for j, layer in enumerate(self.layers):
            low, high = self.excess_ci[:, j].tolist()
            lines.append(f"  layer {layer}: {self.moved[j]:.1%} of choices moved (controls "
                         f"{self.control_moved[:, j].mean():.1%}), excess {self.excess[j]:+.1%} [{low:+.1%}, "
                         f"{high:+.1%}]")
        return "\n".join(lines)


def routing_effect(model: K2Model, dictionary: nn.Module, features: int | Sequence[int], texts: Iterable[str],
                   mode: str = "ablate", scale: float | None = None, *, probe: ProbeSpec | None = None,
                   num_controls: int = 8, batch_size: int = 8, max_len: int | None = 256, num_boot: int = 200,
                   confidence: float = 0.95, seed: int = 0, progress: bool | None = None) -> RoutingEffect:
    """Intervene on ``features`` of ``dictionary`` (spliced at ``probe`` with its error term kept, so nothing else
    changes) over ``texts``, and measure per reachable MoE layer how the routing of their tokens changes, against
    ``num_controls`` sets of control features matched on frequency (``RoutingEffect``).

    ``mode="ablate"``: each feature is zeroed where it is active (``scale`` must be None). ``mode="steer"``: each
    feature gets ``scale`` times its mean activation (over its active tokens in ``texts``) added where it is
    active, so a control is steered by as much of its own typical size. The tokens measured are where a feature of
    the set is active in the clean run."""
    if mode not in ("ablate", "steer"):
        raise ValueError(f"mode must be 'ablate' or 'steer', got {mode!r}")
    if mode == "ablate" and scale is not None:
        raise ValueError("scale is for mode='steer' (how much is added); mode='ablate' zeroes the features")
    if mode == "steer" and (isinstance(scale, bool) or not isinstance(scale, int | float)):
        raise ValueError(f"mode='steer' needs scale, a number of mean activations to add, got {scale!r}")
    _check_positive(num_controls=num_controls, num_boot=num_boot)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    probe = _probe_of(dictionary, probe)
    layers = reachable_moe_layers(model, _probe_pair(model, probe)[1])
    if not layers:
        raise ValueError(f"no MoE router reads what {probe} writes: no routing to measure")
    # Tokenized once; every run below goes over the same batches, each forward stopped after the last router.
    texts = list(texts)
    runs = list(batches(model, texts, batch_size, max_len, padding_side="right", progress=progress))
    routers = [f"layers.{layer}.mlp.gate.{leaf}" for layer in layers for leaf in ("hook_topk_idx", "hook_topk_weights")]

    def routing_run(edit: Callable | None = None, keep_features: bool = False) -> tuple[torch.Tensor, ...]:
        """Over every batch, with the dictionary spliced in (error kept) and ``edit`` on its features: the chosen
        experts and weights [L, B, T, k] of the reachable layers, and the features [B, T, F] when asked for."""
        parts = []
        with splice(model, probe, dictionary, keep_error=True) as point:
            names = [point.name, *routers] if keep_features else routers
            with model.hooks(fwd_hooks=[(point.name, edit)] if edit is not None else []):
                for ids, mask in runs:
                    parts.append(record_probes(model, ids, names, attention_mask=mask))
        T = max(ids.shape[1] for ids, _ in runs)

        def joined(name: str) -> torch.Tensor:  # [B, T, ...] over every batch, padded on the right to T
            return torch.cat([nn.functional.pad(part[name], [0, 0] * (part[name].dim() - 2) +
                                                [0, T - part[name].shape[1]]) for part in parts])

        idx = torch.stack([joined(name) for name in routers[0::2]])  # [L, B, T, k]
        weights = torch.stack([joined(name) for name in routers[1::2]]).float()
        return (idx, weights, joined(point.name).float()) if keep_features else (idx, weights)

    clean_idx, clean_weights, clean_features = routing_run(keep_features=True)
    real = torch.cat([nn.functional.pad(mask.bool(), [0, clean_idx.shape[2] - mask.shape[1]]) for _, mask in runs])
    F = clean_features.shape[-1]
    chosen = [int(f) for f in ([features] if isinstance(features, int) else features)]
    if not chosen or any(not 0 <= f < F for f in chosen) or len(set(chosen)) != len(chosen):
        raise ValueError(f"features must be distinct feature indices in 0..{F - 1}, got {features!r}")
    active = (clean_features > 0) & real[..., None]  # [B, T, F]
    counts = active.flatten(0, 1).sum(0)  # [F]
    silent = [f for f in chosen if counts[f] == 0]
    if silent:
        raise ValueError(f"features {silent} are never active on these texts: no token to measure them on")
    mean_activation = (clean_features * active).flatten(0, 1).sum(0) / counts.clamp(min=1)  # [F]
    control_sets = _matched_controls(counts, chosen, num_controls)
    E, k = model.config.n_routed_experts, clean_idx.shape[-1]

    def per_text(group: list[int]) -> tuple[torch.Tensor, ...]:
        """Per text (float64, CPU): tokens [S], change of choices [S, L, E], of weights [S, L, E], moved [S, L]."""
        added = scale * mean_activation[group] if mode == "steer" else None  # [len(group)]

        def intervene(f: torch.Tensor, hook) -> torch.Tensor:  # f [b, T, F]
            on = f[..., group] > 0
            edited = f.clone()
            new = torch.zeros_like(f[..., group]) if added is None else f[..., group] + added
            edited[..., group] = torch.where(on, new, f[..., group])
            return edited

        idx, weights = routing_run(intervene)
        on = active[..., group].any(-1)  # [B, T] the group's tokens
        before_c, after_c = (torch.zeros(*i.shape[:-1], E, device=on.device).scatter_(-1, i, 1.0)
                             for i in (clean_idx, idx))  # [L, B, T, E]
        before_w, after_w = (torch.zeros(*i.shape[:-1], E, device=on.device).scatter_add_(-1, i, w)
                             for i, w in ((clean_idx, clean_weights), (idx, weights)))
        mask = on[None, :, :, None].float()
        d_choice = ((after_c - before_c) * mask).sum(2)  # [L, B, E]
        d_weight = ((after_w - before_w) * mask).sum(2)
        moved = ((before_c * (1 - after_c)).sum(-1) / k * on[None].float()).sum(-1)  # [L, B]
        return (on.sum(-1).double().cpu(), d_choice.transpose(0, 1).double().cpu(),
                d_weight.transpose(0, 1).double().cpu(), moved.T.double().cpu())

    target = per_text(chosen)
    controls = [per_text(group) for group in control_sets]
    draws = routing.sequence_draws(len(texts), num_boot, torch.Generator().manual_seed(seed))  # [R, S]
    everything = torch.ones(1, len(texts), dtype=torch.float64)

    def ratios(parts: tuple[torch.Tensor, ...], weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tokens = (weights @ parts[0]).clamp(min=1)  # [R]
        return tuple(torch.einsum("rs,s...->r...", weights, part) / tokens.view(-1, *[1] * (part.dim() - 1))
                     for part in parts[1:])  # [R, L, E], [R, L, E], [R, L]

    point, boot = ratios(target, everything), ratios(target, draws)
    control_point = torch.stack([ratios(c, everything)[2][0] for c in controls])  # [C, L]
    control_boot = torch.stack([ratios(c, draws)[2] for c in controls]).mean(0)  # [R, L]
    interval = lambda samples: routing.bootstrap_interval(samples, confidence).float()  # noqa: E731
    return RoutingEffect(
        layers=layers, features=chosen, controls=control_sets, mode=mode, scale=0.0 if scale is None else scale,
        tokens=int(target[0].sum()), rate_change=point[0][0].float(), rate_change_ci=interval(boot[0]),
        weight_change=point[1][0].float(), weight_change_ci=interval(boot[1]), moved=point[2][0].float(),
        moved_ci=interval(boot[2]), control_moved=control_point.float(),
        excess=(point[2][0] - control_point.mean(0)).float(), excess_ci=interval(boot[2] - control_boot),
        confidence=confidence)


def record_probes(model: K2Model, ids: torch.Tensor, names: Sequence[str], **forward_kwargs) -> dict[str, torch.Tensor]:
    """The activations of the probes ``names`` in one forward of ``ids``, which stops as soon as the last of them
    has fired: later blocks and the head are not run (the cheap way to read early probes over a corpus)."""
    from .dictionary import _StopForward

    wanted, recorded = set(names), {}

    def record(activation: torch.Tensor, hook: HookPoint) -> None:
        recorded[hook.name] = activation.detach()
        if wanted <= recorded.keys():
            raise _StopForward

    with model.hooks(fwd_hooks=[(list(names), record)]):
        try:
            model(ids, **forward_kwargs)
        except _StopForward:
            pass
    missing = sorted(wanted - recorded.keys())
    if missing:
        raise RuntimeError(f"record_probes: the probes {missing} did not fire in the forward")
    return recorded


def _matched_controls(counts: torch.Tensor, features: list[int], num_controls: int) -> list[list[int]]:
    """``num_controls`` sets, each holding for every feature the unused feature whose active count is nearest its
    own (never one of ``features``, never used twice)."""
    used = set(features)
    order = counts.double()
    sets = []
    for _ in range(num_controls):
        group = []
        for f in features:
            distance = (order - order[f]).abs()
            distance[list(used)] = torch.inf
            distance[counts == 0] = torch.inf
            pick = int(distance.argmin())
            if distance[pick] == torch.inf:
                raise ValueError(f"not enough active features to draw {num_controls} control sets of "
                                 f"{len(features)}: lower num_controls")
            group.append(pick)
            used.add(pick)
        sets.append(group)
    return sets


# ---- checks -------------------------------------------------------------------------------------------------------
def _check_tokens(active: torch.Tensor, chosen: torch.Tensor, shape: str) -> None:
    """``active`` [N, F] bool and ``chosen`` (of the ``shape`` its caller takes, N on its next-to-last axis) bool over
    the same N tokens."""
    if not isinstance(active, torch.Tensor) or active.dtype != torch.bool or active.dim() != 2 or not len(active):
        raise ValueError(f"active must be a bool tensor [N, F] (feature activation > 0, per token) with N >= 1, got "
                         f"{_described(active)}")
    if (not isinstance(chosen, torch.Tensor) or chosen.dtype != torch.bool or chosen.dim() != shape.count(",") + 1
            or chosen.shape[-2] != active.shape[0]):
        raise ValueError(f"chosen must be a bool tensor {shape} (expert e among the token's k) over the same "
                         f"N = {active.shape[0]} tokens as active, got {_described(chosen)}")


def _check_labels(within: torch.Tensor | None, n: int) -> None:
    if within is not None and (not isinstance(within, torch.Tensor) or within.shape != (n,)
                               or within.is_floating_point()):
        raise ValueError(f"within must be None or integer labels [N] = [{n}] (token ids, say), got "
                         f"{_described(within)}")


def _described(value: object) -> str:
    return f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
