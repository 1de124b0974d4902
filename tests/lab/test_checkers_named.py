"""Issue #50's wrong answers, each written the way a learner wrote it: those that used to pass now fail with their
reason (a second config, an edge row, an input changed in place), the common mistakes it lists are named, no answer
gets a wrong reason, and an answer that calls k2lab's own implementation is told so. Right answers written
otherwise still pass beside each."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from learner import byte_sequences, fails_with, k2, learn_merges, pairs_in, passes

from k2lab.lab import exercises as ex
from k2lab.model.moe import Router

# --- 02: YaRN on DeepSeek-V2-Lite and a range that rounds outwards ------------------------------------------------


def yarn(cfg, *, rounding=(math.floor, math.ceil), m_from="mscale_all_dim"):
    R, theta, factor = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor
    base = 1.0 / theta ** (torch.arange(0, R, 2).double() / R)

    def d(beta):
        return R * math.log(cfg.original_max_position_embeddings / (2 * math.pi * beta)) / (2 * math.log(theta))

    low, high = max(rounding[0](d(cfg.beta_fast)), 0), min(rounding[1](d(cfg.beta_slow)), R - 1)
    high = high + 0.001 if high == low else high
    ramp = ((torch.arange(R // 2).double() - low) / (high - low)).clamp(0, 1)
    mscale = {"mscale_all_dim": cfg.mscale_all_dim, "mscale": cfg.mscale, "none": 1.0}[m_from]
    m = 0.1 * mscale * math.log(factor) + 1
    return base / factor * ramp + base * (1 - ramp), cfg.qk_head_dim**-0.5 * m**2


def test_yarn_that_rounds_or_takes_the_wrong_mscale_fails_on_the_second_configs():
    passes(ex.check_yarn_frequencies(yarn))
    fails_with(ex.check_yarn_frequencies(lambda c: yarn(c, rounding=(round, round))), "rounded OUTWARDS")
    fails_with(ex.check_yarn_frequencies(lambda c: yarn(c, m_from="none")), "you ignored mscale_all_dim")
    verdict = ex.check_yarn_frequencies(lambda c: yarn(c, m_from="mscale"))
    fails_with(verdict, "you took m from mscale")
    assert "made-up config" in verdict.message  # V2-Lite's mscale equals its mscale_all_dim: only this one shows it


def test_yarn_from_k2lab_itself_is_named():
    from k2lab.model.rope import inverse_frequencies

    fails_with(ex.check_yarn_frequencies(lambda c: (inverse_frequencies(c), c.softmax_scale)),
               "calls k2lab's own inverse_frequencies")


# --- 04a: the router on a second router with routed scaling 1.0 ---------------------------------------------------


def route(x, weight, bias, top_k, scaling, *, k=None, scale=None, over_all=False, sort_idx_only=False):
    s = (x @ weight.T).sigmoid()
    idx = (s + bias).topk(k or top_k, dim=-1).indices
    w = (s / s.sum(-1, keepdim=True) if over_all else s).gather(-1, idx)
    w = w if over_all else w / w.sum(-1, keepdim=True)
    if sort_idx_only:
        idx = idx.sort(-1).values
    return idx, w * (scaling if scale is None else scale)


def test_router_written_otherwise_passes():
    passes(ex.check_router(route))

    def both_sorted(*a):
        idx, w = route(*a)
        order = idx.argsort(-1)
        return idx.gather(-1, order), w.gather(-1, order)

    passes(ex.check_router(both_sorted))


@pytest.mark.parametrize(("wrong", "reason"), [
    (dict(scale=2.827), "use the `scaling` argument"),
    (dict(k=4), "use the top_k argument"),
    (dict(over_all=True), "renormalised over ALL experts"),
    (dict(sort_idx_only=True), "reordered the indices (sorted them, say) but not the weights"),
])
def test_router_numbers_written_in_and_renormalisation_slips_are_named(wrong, reason):
    fails_with(ex.check_router(lambda *a: route(*a, **wrong)), reason)


def test_a_router_that_calls_k2lab_router_is_named():
    def through_k2lab(x, weight, bias, top_k, scaling):
        from k2lab import K2Config

        router = Router(K2Config.nano().replace(n_routed_experts=weight.shape[0], num_experts_per_tok=top_k,
                                                routed_scaling_factor=scaling))
        router.load_state_dict({"weight": weight, "e_score_correction_bias": bias})
        idx, w = router(x[None])
        return idx[0], w[0]

    fails_with(ex.check_router(through_k2lab), "calls k2lab's own Router")


# --- 04b: SiLU after the product, swapped norms -------------------------------------------------------------------


def test_silu_after_the_product_is_named():
    fails_with(ex.check_swiglu(lambda x, g, u, d: F.silu((x @ g.T) * (x @ u.T)) @ d.T), "SiLU after the product")


def test_swapped_norms_are_named():
    def swapped(x, n1, attn, n2, ffn):
        mid = x + attn(n2(x))
        return mid + ffn(n1(mid))

    fails_with(ex.check_block(swapped), "you swapped the norms")


# --- 05: MaxVio on [31, 30, 30, 30, 30, 0] and a fractional mean --------------------------------------------------


def test_max_violation_by_distance_from_the_mean_or_integer_mean_fails():
    passes(ex.check_max_violation(lambda c: c.amax(-1) / c.float().mean(-1) - 1))
    fails_with(ex.check_max_violation(lambda c: (c - c.float().mean(-1, keepdim=True)).abs().amax(-1)
                                      / c.float().mean(-1)), "max |c - mean| / mean also counts the idlest expert")
    fails_with(ex.check_max_violation(lambda c: c.amax(-1) / (c.sum(-1) // c.shape[-1]) - 1), "integer division")


# --- 06: sum-of-squares DLA; 09: the logit lens without g ---------------------------------------------------------


def test_sum_of_squares_attribution_is_named():
    fails_with(ex.check_logit_attribution(lambda c, x, g, u, eps: float((u * g * c).sum() / torch.sqrt(
        x.pow(2).sum() + eps))), "sum of squares")


def test_the_logit_lens_without_g_is_named():
    passes(ex.check_logit_lens(lambda r, n, h: h(n(r))))
    fails_with(ex.check_logit_lens(lambda r, n, h: h(r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6))),
               "without the norm's weight g")


# --- 07: a patch hook must leave its source alone -----------------------------------------------------------------


def test_a_patch_built_inside_the_source_fails():
    def inside_source(act, source, positions):
        keep = [t for t in range(act.shape[1]) if t not in positions]
        source[:, keep] = act[:, keep]  # the right numbers, written into the other run's activation
        return source

    fails_with(ex.check_patch_hook(inside_source), "you changed your input `source` in place")


# --- 03: KV-cache bytes: no wrong reason for K and V counted apart ------------------------------------------------


def test_kv_cache_counted_for_keys_and_values_is_not_told_4_bytes_alone():
    def keys_and_values(cfg, tokens):
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return 2 * tokens * latent * 2 * cfg.num_hidden_layers  # a K cache and a V cache of the latent

    verdict = ex.check_kv_cache_bytes(keys_and_values)
    fails_with(verdict, "once for the keys and once for the values")
    fails_with(ex.check_kv_cache_bytes(lambda cfg, n: n * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
                                       * cfg.num_hidden_layers), "you counted c_KV twice")
    passes(ex.check_kv_cache_bytes(lambda cfg, n: torch.tensor(n * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2.0
                                                               * cfg.num_hidden_layers)))


# --- 10: the bias step, QK-Clip, Newton-Schulz --------------------------------------------------------------------


@pytest.mark.parametrize(("wrong", "reason"), [
    (lambda b, c, u: b + u * torch.tanh(c.mean(-1, keepdim=True) - c), "a smooth function of the imbalance"),
    (lambda b, c, u: b + u * torch.sign(c.sum(-1, keepdim=True) // c.shape[-1] - c), "integer division"),
    (lambda b, c, u: b.add_(u * torch.sign(c.mean(-1, keepdim=True) - c)), "you changed your input `b` in place"),
])
def test_bias_steps_that_passed_fail(wrong, reason):
    passes(ex.check_bias_update(lambda b, c, u: b + u * torch.sign(c.mean(-1, keepdim=True) - c)))
    passes(ex.check_bias_update(lambda b, c, u: b + torch.where(c > c.mean(-1, keepdim=True), -u,
                                                                 torch.where(c < c.mean(-1, keepdim=True), u, 0.0))))
    fails_with(ex.check_bias_update(wrong), reason)


def test_the_whole_gamma_on_k_nope_is_named():
    def on_k_nope(head, max_logit, tau):
        g = min(1.0, tau / max_logit)
        return {p: t * {"k_nope": g, "q_pe": g}.get(p, 1.0) for p, t in head.items()}

    fails_with(ex.check_qk_clip(on_k_nope), "whole gamma on k_nope")


def test_qk_clip_in_place_is_allowed():
    def in_place(head, max_logit, tau):
        g = min(1.0, tau / max_logit)
        head["q_nope"].mul_(g**0.5)
        head["k_nope"].mul_(g**0.5)
        head["q_pe"].mul_(g)
        return head

    passes(ex.check_qk_clip(in_place))


def newton_schulz(G, steps, dtype=None, normalised=True):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.to(dtype) if dtype is not None else G
    X = X / (X.norm() + 1e-7) if normalised else X
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def test_newton_schulz_in_bfloat16_is_accepted_and_says_so():
    verdict = ex.check_newton_schulz(lambda g, n: newton_schulz(g, n, torch.bfloat16))
    passes(verdict)
    assert "computed in bfloat16; this check compares in float32" in verdict.message
    passes(ex.check_newton_schulz(lambda g, n: newton_schulz(g, n, torch.bfloat16).float()))
    cubic = ex.check_newton_schulz(lambda g, n: newton_schulz(g.bfloat16(), n) * 0 + 1.5 * newton_schulz(
        g.bfloat16(), n) - newton_schulz(g.bfloat16(), n) * 0.5)  # an answer 1.0 times right: passes too
    passes(cubic)


def test_newton_schulz_wrong_in_bfloat16_is_named():
    verdict = ex.check_newton_schulz(lambda g, n: newton_schulz(g, n, torch.bfloat16, normalised=False))
    fails_with(verdict, "computed in bfloat16; this check compares in float32")


# --- 01: rank-BPE: no wrong reasons; BPE training: capitals --------------------------------------------------------


def test_rank_bpe_by_the_left_part_or_a_sweep_of_minima_is_not_told_first_pair():
    def by_left_part(ranks, piece):
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while pairs := pairs_in(ranks, parts):
            _, i = min((ranks[parts[i]], i) for _, i in pairs)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def sweep_of_minima(ranks, piece):
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while True:
            r = [ranks.get(parts[i] + parts[i + 1], math.inf) for i in range(len(parts) - 1)]
            lows = [i for i in range(len(r)) if r[i] < math.inf and (i == 0 or r[i] < r[i - 1])
                    and (i + 1 == len(r) or r[i] <= r[i + 1])]
            if not lows:
                return parts
            for i in reversed(lows):
                parts[i:i + 2] = [parts[i] + parts[i + 1]]

    for wrong, reason in ((by_left_part, "LEFT part's rank"), (sweep_of_minima, "in one sweep")):
        verdict = ex.check_bpe(wrong)
        fails_with(verdict, reason)
        assert "first mergeable pair" not in verdict.message


def test_bpe_training_that_lower_cases_fails():
    def lower_cased(texts, num_merges, pre_tokenize):
        words = Counter(piece for text in texts for piece in pre_tokenize(text.lower()))
        return learn_merges(byte_sequences(words), list(words.values()), num_merges)

    fails_with(ex.check_bpe_training(lower_cased), "you lower-cased the text")


# --- 09: a slip inside one piece of the whole model ---------------------------------------------------------------


def test_a_model_level_mla_slip_says_which_checker_to_run():
    from k2lab.lab.exercises.attention import _mla_variant

    for mask, reason in (("multiply", "multiplying the scores with tril"), ("none", "causal mask")):
        def attention(w, cfg, x, cos, sin, mask=mask):
            return _mla_variant(w, cfg, x, cos, sin, mask=mask)

        verdict = ex.check_model_from_weights(lambda *a, attention=attention: k2(*a, attention=attention))
        fails_with(verdict, "run check_mla_forward on your MLA")
        fails_with(verdict, reason)


def test_a_model_from_k2model_itself_is_named_and_pieces_are_noted():
    from k2lab import K2Model
    from k2lab.model import MultiHeadLatentAttention

    def load_state_dict(state_dict, cfg, ids):
        model = K2Model(cfg)
        model.load_state_dict(state_dict)
        return model(ids)

    def k2lab_attention(w, cfg, x, cos, sin):
        attn = MultiHeadLatentAttention(cfg)
        attn.load_state_dict(w)
        return attn(x, cos, sin, attn_impl="naive")

    fails_with(ex.check_model_from_weights(load_state_dict), "calls k2lab's own K2Model")
    passes(ex.check_model_from_weights(k2))
    verdict = ex.check_model_from_weights(lambda *a: k2(*a, attention=k2lab_attention))
    passes(verdict)
    assert "uses k2lab's MultiHeadLatentAttention (a stand-in for your own)" in verdict.message


# --- 00: greedy decoding: the first step that differs -------------------------------------------------------------


def test_greedy_says_the_first_step_that_differs_with_both_tokens():
    model, ids = ex.small_k2(), torch.tensor([[1, 2, 3]])

    def greedy(model, ids, n, wrong_step=None):
        for step in range(n):
            logits = model(ids)[:, -1]
            pick = logits.topk(2).indices[:, 1:] if step == wrong_step else logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, pick], dim=1)
        return ids

    passes(ex.check_greedy(greedy, model, ids))
    verdict = ex.check_greedy(lambda m, i, n: greedy(m, i, n, wrong_step=2), model, ids)
    fails_with(verdict, "the first 2 new tokens agree; step 3 differs: yours is")
    assert "k2lab.generate's" in verdict.message
    fails_with(ex.check_greedy(lambda m, i, n: greedy(m, i.flip(1), n), model, ids),
               "the prompt at the start of your answer differs")
