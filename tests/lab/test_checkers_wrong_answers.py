"""The exercise checkers cannot be fooled (issue #39): each wrong answer below is a small function written the way a
learner would write it, and each must fail WITH ITS REASON, while the right answer passes. This covers the four
wrong answers a review saw pass (BPE merging the highest rank first, the absorbed score through k_nope, the bias
update with the median, attribution without eps), the two that got a misleading reason (a longest-match BPE, a
neighbour-pair rotation), and the construction track's checkers (BPE training, YaRN, MLA from its weights, the whole
model from its state dict, Newton-Schulz, QK-Clip)."""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from learner import (
    byte_sequences,
    count_pairs,
    fails_with,
    k2,
    learn_merges,
    mla,
    mla_absorbed,
    mla_inputs,
    pairs_in,
    passes,
    route,
)

from k2lab.lab import exercises as ex

# --- 01: rank-BPE -------------------------------------------------------------------------------------------------


def merging(choose, at_most=None):
    """Rank-BPE that merges the pair ``choose`` picks among the (rank, position) pairs present, ``at_most`` times
    (None: until no pair is left): the right rule with ``min`` (lowest rank first), and wrong ones a learner writes."""
    def bpe(ranks, piece):
        parts, merges = [piece[i:i + 1] for i in range(len(piece))], 0
        while (pairs := pairs_in(ranks, parts)) and merges != at_most:
            _, i = choose(pairs)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
            merges += 1
        return parts
    return bpe


bpe = merging(min)
bpe_highest_rank_first = merging(max)
bpe_first_pair_from_the_left = merging(lambda pairs: min(pairs, key=lambda pair: pair[1]))
bpe_one_merge = merging(min, at_most=1)


def bpe_longest_match(ranks, piece):
    parts = []
    while piece:
        n = max(n for n in range(1, len(piece) + 1) if piece[:n] in ranks)
        parts.append(piece[:n])
        piece = piece[n:]
    return parts


def test_bpe_wrong_rules_each_get_their_reason():
    passes(ex.check_bpe(bpe))
    fails_with(ex.check_bpe(bpe_highest_rank_first), "HIGHEST-ranked pair first")
    fails_with(ex.check_bpe(bpe_first_pair_from_the_left), "first mergeable pair from the left")
    fails_with(ex.check_bpe(bpe_longest_match), "longest known token from the left")
    fails_with(ex.check_bpe(bpe_one_merge), "stopped after one merge")
    fails_with(ex.check_bpe(lambda r, p: [t.decode() for t in bpe(r, p)]), "not str")
    fails_with(ex.check_bpe(lambda r, p: [r[t] for t in bpe(r, p)]), "not their ranks")


# --- 01: BPE training ---------------------------------------------------------------------------------------------


def train_bpe(texts, num_merges, pre_tokenize):
    words = Counter(piece for text in texts for piece in pre_tokenize(text))
    return learn_merges(byte_sequences(words), list(words.values()), num_merges)


def train_least_frequent(texts, num_merges, pre_tokenize):
    words = Counter(piece for text in texts for piece in pre_tokenize(text))
    return learn_merges(byte_sequences(words), list(words.values()), num_merges, pick=min)


def train_across_pre_tokens(texts, num_merges, pre_tokenize):
    return learn_merges(byte_sequences(texts), [1] * len(texts), num_merges)


def train_counting_once(texts, num_merges, pre_tokenize):
    words = Counter(piece for text in texts for piece in pre_tokenize(text))
    counts = count_pairs(byte_sequences(words), list(words.values()))
    return [pair for pair, _ in counts.most_common(num_merges)]


def train_from_characters(texts, num_merges, pre_tokenize):
    words = Counter(piece for text in texts for piece in pre_tokenize(text))
    return learn_merges([[c.encode() for c in word] for word in words], list(words.values()), num_merges)


def train_distinct_words(texts, num_merges, pre_tokenize):
    words = sorted({piece for text in texts for piece in pre_tokenize(text)})
    return learn_merges(byte_sequences(words), [1] * len(words), num_merges)


def test_bpe_training_right_answers_pass_whatever_their_tie_rule():
    passes(ex.check_bpe_training(train_bpe))
    passes(ex.check_bpe_training(ex.train_bpe))  # the reference breaks ties by bytes order; the learner's by dict order

    def as_ranks(texts, num_merges, pre_tokenize):
        merges = train_bpe(texts, num_merges, pre_tokenize)
        return {bytes([b]): b for b in range(256)} | {a + b: 256 + i for i, (a, b) in enumerate(merges)}

    passes(ex.check_bpe_training(as_ranks))


def test_bpe_training_wrong_answers_each_get_their_reason():
    fails_with(ex.check_bpe_training(train_least_frequent), "least frequent pair")
    fails_with(ex.check_bpe_training(train_across_pre_tokens), "across pre-token boundaries")
    fails_with(ex.check_bpe_training(train_counting_once), "did not count the pairs again after merging")
    fails_with(ex.check_bpe_training(train_from_characters), "started from characters, not bytes")
    fails_with(ex.check_bpe_training(train_distinct_words), "each distinct pre-token once")
    fails_with(ex.check_bpe_training(lambda t, n, p: train_bpe(t, n - 1, p)), "returned 15 merges")
    fails_with(ex.check_bpe_training(lambda t, n, p: [a + b for a, b in train_bpe(t, n, p)]), "not the merged token")
    fails_with(ex.check_bpe_training(lambda t, n, p: [(a.decode("latin-1"), b.decode("latin-1"))
                                                      for a, b in train_bpe(t, n, p)]), "not str")


# --- 02: the rotation ---------------------------------------------------------------------------------------------


def rotate_neighbour_pairs(x, positions, inv_freq):
    """GPT-J's layout: each neighbour pair (x_2i, x_2i+1) as one complex number, turned by e^(i angle)."""
    angles = positions[:, None].float() * inv_freq
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def test_a_neighbour_pair_rotation_is_told_it_paired_neighbours():
    fails_with(ex.check_rotation(rotate_neighbour_pairs), "paired neighbours")
    backwards = lambda x, p, f: rotate_neighbour_pairs(x, -p, f)  # noqa: E731
    fails_with(ex.check_rotation(backwards), "paired neighbours")

    def rotate_halves_by_other_angles(x, positions, inv_freq):
        angles = positions[:, None].float() * inv_freq.flip(0)
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], dim=-1)

    fails_with(ex.check_rotation(rotate_halves_by_other_angles), "a rotation of the right pairs, by other angles")


# --- 02: YaRN -----------------------------------------------------------------------------------------------------


def yarn(cfg, *, ramp_reversed=False, betas_swapped=False, plain=False, mscale=True, squared=True):
    R, theta, factor = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor
    base = 1.0 / theta ** (torch.arange(0, R, 2).float() / R)  # [R/2]
    if plain:
        inv_freq = base
    else:
        def d(beta):
            return R * math.log(cfg.original_max_position_embeddings / (2 * math.pi * beta)) / (2 * math.log(theta))

        fast, slow = (cfg.beta_slow, cfg.beta_fast) if betas_swapped else (cfg.beta_fast, cfg.beta_slow)
        low, high = max(math.floor(d(fast)), 0), min(math.ceil(d(slow)), R - 1)
        high = high + 0.001 if high == low else high
        ramp = ((torch.arange(R // 2).float() - low) / (high - low)).clamp(0, 1)
        ramp = 1 - ramp if ramp_reversed else ramp
        inv_freq = base / factor * ramp + base * (1 - ramp)
    m = 0.1 * cfg.mscale_all_dim * math.log(factor) + 1
    m_factor = (m**2 if squared else m) if mscale else 1.0
    return inv_freq, cfg.qk_head_dim**-0.5 * m_factor


def test_yarn_frequencies():
    passes(ex.check_yarn_frequencies(yarn))
    fails_with(ex.check_yarn_frequencies(lambda c: yarn(c, ramp_reversed=True)), "ramp runs the wrong way")
    fails_with(ex.check_yarn_frequencies(lambda c: yarn(c, betas_swapped=True)), "swapped beta_fast and beta_slow")
    fails_with(ex.check_yarn_frequencies(lambda c: yarn(c, mscale=False)), "forgot YaRN's m")
    fails_with(ex.check_yarn_frequencies(lambda c: yarn(c, squared=False)), "m goes in squared")
    fails_with(ex.check_yarn_frequencies(lambda c: yarn(c, plain=True)), "plain RoPE")
    fails_with(ex.check_yarn_frequencies(lambda c: yarn(c)[0]), "return two things")


def test_the_swapped_betas_only_show_on_deepseek_v3():
    """K2's beta_fast equals its beta_slow, so only DeepSeek-V3's config (beta_fast 32) tells the swap apart."""
    verdict = ex.check_yarn_frequencies(lambda c: yarn(c, betas_swapped=True))
    fails_with(verdict, "DeepSeek-V3's inverse frequencies")


# --- 03: MLA ------------------------------------------------------------------------------------------------------


def test_mla_forward_naive():
    passes(ex.check_mla_forward(mla))
    passes(ex.check_mla_forward(mla_absorbed))  # the absorbed form is a right naive answer too
    fails_with(ex.check_mla_forward(lambda *a: mla(*a, kv_norm=False)), "forgot kv_a_layernorm")
    fails_with(ex.check_mla_forward(lambda *a: mla(*a, deinterleave=False)), "de-interleave them first")
    fails_with(ex.check_mla_forward(lambda *a: mla(*a, mask=lambda s: s)), "forgot the causal mask")

    def rope_part_first(w, cfg, x, cos, sin):
        H, N, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q_b = w["q_b_proj.weight"].view(H, N + R, -1)
        swapped = dict(w, **{"q_b_proj.weight": torch.cat([q_b[:, R:], q_b[:, :R]], dim=1).flatten(0, 1)})
        return mla(swapped, cfg, x, cos, sin)  # reads each head's query as [rope | nope]

    fails_with(ex.check_mla_forward(rope_part_first), "took the rotary part first")


def test_mla_forward_absorbed():
    passes(ex.check_mla_forward(mla_absorbed, absorbed=True))
    fails_with(ex.check_mla_forward(mla, absorbed=True), "built each head's keys")

    def scale_of_the_wide_keys(w, cfg, x, cos, sin):
        return mla_absorbed(w, cfg, x, cos, sin, scale=(cfg.kv_lora_rank + cfg.qk_rope_head_dim) ** -0.5)

    fails_with(ex.check_mla_forward(scale_of_the_wide_keys, absorbed=True), "* m^2, not 1/sqrt(")

    def keys_one_head_at_a_time(w, cfg, x, cos, sin):
        H, N, V, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q_nope, q_pe, c_kv, k_pe = mla_inputs(w, cfg, x, cos, sin)
        w_uk = w["kv_b_proj.weight"].view(H, N + V, C)[:, :N]
        for h in range(H):
            c_kv @ w_uk[h].T  # this head's keys, built and dropped: still forbidden
        return mla_absorbed(w, cfg, x, cos, sin)

    fails_with(ex.check_mla_forward(keys_one_head_at_a_time, absorbed=True), "built each head's keys")

    def values_expanded(w, cfg, x, cos, sin):
        H, N, V, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        _, _, c_kv, _ = mla_inputs(w, cfg, x, cos, sin)
        torch.einsum("bsc,hvc->bshv", c_kv, w["kv_b_proj.weight"].view(H, N + V, C)[:, N:])
        return mla_absorbed(w, cfg, x, cos, sin)

    fails_with(ex.check_mla_forward(values_expanded, absorbed=True), "expanded each head's values")


def absorbed_score(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
    q_latent = torch.einsum("thn,hnc->htc", q_nope, w_uk)  # W_UK^T q, per head
    return scale * (q_latent @ c_kv.T + torch.einsum("thr,sr->hts", q_pe, k_pe))


def test_the_absorbed_score_may_not_build_k_nope():
    passes(ex.check_absorbed_score(absorbed_score))

    def through_k_nope(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
        k_nope = torch.einsum("sc,hnc->hsn", c_kv, w_uk)  # [H, S, N]: the keys the exercise forbids
        return scale * (torch.einsum("thn,hsn->hts", q_nope, k_nope) + torch.einsum("thr,sr->hts", q_pe, k_pe))

    def through_k_nope_by_matmul(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
        k_nope_t = w_uk @ c_kv.T  # [H, N, S]: the same keys, transposed
        return scale * (q_nope.transpose(0, 1) @ k_nope_t + torch.einsum("thr,sr->hts", q_pe, k_pe))

    fails_with(ex.check_absorbed_score(through_k_nope), "built each head's keys")
    fails_with(ex.check_absorbed_score(through_k_nope_by_matmul), "built each head's keys")


# --- 04 and 09: the whole model from its weights ------------------------------------------------------------------


def route_bias_in_weights(x, weight, bias, cfg):
    choice = (x @ weight.T).sigmoid() + bias
    idx = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    w = choice.gather(-1, idx)
    return idx, w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor


def route_unscaled(x, weight, bias, cfg):
    idx, w = route(x, weight, bias, cfg)
    return idx, w / cfg.routed_scaling_factor


def test_model_from_weights():
    passes(ex.check_model_from_weights(k2))
    fails_with(ex.check_model_from_weights(lambda *a: k2(*a, tied=True)), "tied the head to the embedding")
    fails_with(ex.check_model_from_weights(lambda *a: k2(*a, final_norm=False)), "forgot the final norm")
    fails_with(ex.check_model_from_weights(lambda *a: k2(*a, router=route_bias_in_weights)),
               "correction bias is in your expert weights")
    fails_with(ex.check_model_from_weights(lambda *a: k2(*a, router=route_unscaled)), "routed_scaling_factor")


def test_model_from_weights_against_k2_nano():
    """The course's goal: from an empty cell to K2-nano's own logits (its trained, non-zero router bias included)."""
    from k2lab import load_nano

    model, tok = load_nano()
    ids = torch.tensor([tok.encode("def fib(n):")])
    passes(ex.check_model_from_weights(k2, model, ids))
    fails_with(ex.check_model_from_weights(lambda *a: k2(*a, router=route_bias_in_weights), model, ids),
               "correction bias is in your expert weights")


# --- 10: training -------------------------------------------------------------------------------------------------


def bias_update(bias, counts, u):
    return bias + u * torch.sign(counts.mean(-1, keepdim=True) - counts)


def test_bias_update_with_the_median_or_a_two_way_sign_fails():
    passes(ex.check_bias_update(bias_update))
    median = lambda b, c, u: b + u * torch.sign(c.median(-1, keepdim=True).values - c)  # noqa: E731
    middle = lambda b, c, u: b + u * torch.sign(c.quantile(0.5, dim=-1, keepdim=True) - c)  # noqa: E731
    two_way = lambda b, c, u: b + torch.where(c > c.mean(-1, keepdim=True), -u, u)  # noqa: E731
    fails_with(ex.check_bias_update(median), "median load")
    fails_with(ex.check_bias_update(middle), "median load")
    fails_with(ex.check_bias_update(two_way), "exactly at the mean load keeps its bias")


def test_attribution_without_eps_fails():
    def attribution(c, x_final, g, u, eps):
        return float((u * g * c).sum() / torch.sqrt(x_final.pow(2).mean() + eps))

    passes(ex.check_logit_attribution(attribution))
    no_eps = lambda c, x, g, u, eps: float((u * g * c).sum() / torch.sqrt(x.pow(2).mean()))  # noqa: E731
    eps_outside = lambda c, x, g, u, eps: float((u * g * c).sum() / (torch.sqrt(x.pow(2).mean()) + eps))  # noqa: E731
    fails_with(ex.check_logit_attribution(no_eps), "forgot the eps")
    fails_with(ex.check_logit_attribution(eps_outside), "eps goes inside the square root")


def newton_schulz(G, steps, quintic=True, normalise=True, transpose=True, transpose_back=True):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.norm() + 1e-7) if normalise else G
    tall = transpose and G.shape[0] > G.shape[1]
    X = X.T if tall else X
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X if quintic else 1.5 * X - 0.5 * A @ X
    return X.T if tall and transpose_back else X


def test_newton_schulz():
    passes(ex.check_newton_schulz(newton_schulz))
    fails_with(ex.check_newton_schulz(lambda g, n: newton_schulz(g, n, quintic=False)), "cubic iteration")
    fails_with(ex.check_newton_schulz(lambda g, n: newton_schulz(g, n, normalise=False)), "did not normalise G")
    fails_with(ex.check_newton_schulz(lambda g, n: newton_schulz(g, n, transpose=False)), "did not transpose")
    fails_with(ex.check_newton_schulz(lambda g, n: newton_schulz(g, n, transpose_back=False)),
               "not the result back")

    def exact(g, steps):
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        return u @ vh

    fails_with(ex.check_newton_schulz(exact), "exact U V^T")


def qk_clip(head, max_logit, tau, clip_below_tau=False, k_pe_too=False, q_pe_sqrt=False):
    gamma = tau / max_logit if clip_below_tau else min(1.0, tau / max_logit)
    out = dict(head)
    out["q_nope"] = head["q_nope"] * gamma**0.5
    out["k_nope"] = head["k_nope"] * gamma**0.5
    out["q_pe"] = head["q_pe"] * (gamma**0.5 if q_pe_sqrt or k_pe_too else gamma)
    if k_pe_too:
        out["k_pe"] = head["k_pe"] * gamma**0.5
    return out


def test_qk_clip():
    passes(ex.check_qk_clip(qk_clip))
    fails_with(ex.check_qk_clip(lambda h, m, t: qk_clip(h, m, t, k_pe_too=True)), "scaled the shared rotary key")
    fails_with(ex.check_qk_clip(lambda h, m, t: qk_clip(h, m, t, q_pe_sqrt=True)), "q_pe takes the whole gamma")
    fails_with(ex.check_qk_clip(lambda h, m, t: qk_clip(h, m, t, clip_below_tau=True)), "not above tau")
    fails_with(ex.check_qk_clip(lambda h, m, t: list(qk_clip(h, m, t).values())), "return a dict")


# --- every checker ------------------------------------------------------------------------------------------------


CHECKERS: dict[str, Callable] = {name: getattr(ex, name) for name in ex.__all__ if name.startswith("check_")}
CHECKERS["check_greedy"] = lambda fn: ex.check_greedy(fn, ex.small_k2(), torch.tensor([[1, 2, 3]]))  # takes a model


@pytest.mark.parametrize("name", CHECKERS)
def test_a_stub_a_crash_and_a_warning_stay_inside_the_verdict(name):
    check = CHECKERS[name]

    def stub(*args):
        raise NotImplementedError

    def crash(*args):
        raise ValueError("boom")

    def noisy(*args):
        warnings.warn("a library complains", UserWarning, stacklevel=1)
        raise NotImplementedError

    fails_with(check(stub), "not written yet")
    fails_with(check(crash), "raised ValueError: boom")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning that reached the cell would raise here
        fails_with(check(noisy), "not written yet")
