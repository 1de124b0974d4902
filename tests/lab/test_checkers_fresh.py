"""Wrong answers written for this file only, after the checkers' mistake lists, the way a learner slips: none may pass
(0 wrong answers pass), whatever reason they get; a few right answers written oddly must pass. The share of these
rejections that name the mistake estimates what a learner whose mistakes the lists do not hold will see: it must be
at least 70% in each corpus, and tests/lab/conftest.py prints it apart from the known mistakes' (without xdist)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from learner import NOT_AN_ANSWER, byte_sequences, fails_with, k2, learn_merges, mla, mla_inputs, passes
from learner import route as route_by_config
from learner import yarn as learner_yarn

from k2lab.lab import exercises as ex


def rejected(verdict: ex.Verdict, corpus: str = "fresh") -> None:
    fails_with(verdict, "", corpus)


def rms(x, eps):
    return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


RMS = [
    lambda x, w, eps: x / x.norm(dim=-1, keepdim=True) * w,
    lambda x, w, eps: x / torch.sqrt(x.var(-1, keepdim=True) + eps) * w,
    lambda x, w, eps: x / torch.sqrt(x.pow(2).mean() + eps) * w,
    lambda x, w, eps: (x * w) / rms(x * w, eps),
    lambda x, w, eps: x / rms(x, eps) * w + x,
]
SWIGLU = [
    lambda x, g, u, d: (F.silu(x @ g.T) + (x @ u.T)) @ d.T,
    lambda x, g, u, d: (F.silu(x @ g.T) * F.silu(x @ u.T)) @ d.T,
    lambda x, g, u, d: F.silu((x @ g.T) * (x @ u.T) @ d.T),
]


def route(x, weight, bias, top_k, scaling, how):
    logits = x @ weight.T
    s = logits.sigmoid()
    if how == "bias in the sigmoid":
        idx = (logits + bias).sigmoid().topk(top_k, -1).indices
    elif how == "bias multiplies":
        idx = (s * (1 + bias)).topk(top_k, -1).indices
    else:
        idx = (s + bias).topk(top_k, -1).indices
    w = s.gather(-1, idx)
    if how == "softmax of the chosen":
        return idx, w.softmax(-1) * scaling
    if how == "scaled before sum":
        return idx, w * scaling / (w * scaling).sum(-1, keepdim=True)
    return idx, w / w.sum(-1, keepdim=True) * scaling


ROUTER = ["bias in the sigmoid", "bias multiplies", "softmax of the chosen", "scaled before sum"]
MAXVIO = [
    lambda c: (c.amax(-1) - c.float().mean(-1)) / c.amax(-1),
    lambda c: c.amax(-1) / c.amin(-1).clamp(min=1) - 1,
    lambda c: c.amax(-1) / c.float().mean() - 1,
]
BIAS = [
    lambda b, c, u: b + u * torch.sign(c.mean(-1, keepdim=True) - c) * (c != 0),
    lambda b, c, u: b + u * torch.sign(c.mean() - c),
    lambda b, c, u: b + u * torch.sign(c.mean(-1, keepdim=True) - c) / c.shape[-1],
]
DLA = [
    lambda c, x, g, u, eps: float((u * c).sum() * g.mean() / rms(x, eps)),
    lambda c, x, g, u, eps: float((u * g * c).sum() / torch.sqrt(x.var() + eps)),
    lambda c, x, g, u, eps: float((u * g * c).sum() / rms(x - c, eps)),
]


def patch_mean(act, source, positions):
    out = act.clone()
    out[:, positions] = source[:, positions].mean(0)
    return out


def patch_range(act, source, positions):
    out = act.clone()
    out[:, positions[0]:positions[-1] + 1] = source[:, positions[0]:positions[-1] + 1]
    return out


KV = [
    lambda cfg, n: n * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * cfg.num_hidden_layers
    * cfg.num_attention_heads,
    lambda cfg, n: n * (cfg.q_lora_rank + cfg.qk_rope_head_dim) * 2 * cfg.num_hidden_layers,
]
LENS = [
    lambda r, n, h: h(n(r) + r),
    lambda r, n, h: h(n(r)) / r.shape[-1] ** 0.5,
]


def absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, scale, slip):
    content = torch.einsum("thn,hnc->htc", q_nope, w_uk) @ c_kv.T
    rotary = torch.einsum("thr,sr->hts", q_pe, k_pe)
    if slip == "inverse scale":
        return (content + rotary) / scale
    if slip == "rotary transposed":
        return scale * (content + rotary.transpose(1, 2).reshape(rotary.shape))
    return scale * (content + rotary) ** 1.0 - scale * rotary * (slip == "no rotary, minus")


def mla_rotate_q_only(w, cfg, x, cos, sin):
    q_nope, q_pe, c_kv, k_pe = mla_inputs(w, cfg, x, cos, sin)
    H, N, V, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    B, T, _ = x.shape
    kv_a = x @ w["kv_a_proj_with_mqa.weight"].T
    raw_k_pe = kv_a[..., C:]  # not rotated
    kv = (c_kv @ w["kv_b_proj.weight"].T).view(B, T, H, N + V)
    scores = torch.einsum("bthn,bshn->bhts", q_nope, kv[..., :N]) + torch.einsum("bthr,bsr->bhts", q_pe, raw_k_pe)
    scores = (scores * cfg.softmax_scale).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhts,bshv->bthv", scores.softmax(-1), kv[..., N:]).flatten(2) @ w["o_proj.weight"].T


def yarn(cfg, slip):
    R, theta, factor = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor
    base = 1.0 / theta ** (torch.arange(0, R, 2).double() / R)

    def d(beta):
        return R * math.log(cfg.original_max_position_embeddings / (2 * math.pi * beta)) / (2 * math.log(theta))

    low, high = max(math.floor(d(cfg.beta_fast)), 0), min(math.ceil(d(cfg.beta_slow)), R - 1)
    width = high - low + (1 if slip == "width + 1" else 0) or 0.001
    ramp = ((torch.arange(R // 2).double() - low) / width).clamp(0, 1)
    m = 0.1 * cfg.mscale_all_dim * math.log(factor) + (0 if slip == "m without + 1" else 1)
    return base / factor * ramp + base * (1 - ramp), cfg.qk_head_dim**-0.5 * m**2


def newton_schulz(G, steps, slip):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.abs().max() if slip == "max-abs norm" else G.norm() + 1e-7)
    tall = G.shape[0] > G.shape[1]
    X = X.T if tall else X
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X if slip != "b and c swapped" else a * X + (c * A + b * A @ A) @ X
    return X.T if tall else X


def qk_clip_q_pe_sqrt_only(head, max_logit, tau):
    g = min(1.0, tau / max_logit)
    return {p: t * {"q_nope": g, "q_pe": g**0.5}.get(p, 1.0) for p, t in head.items()}


def greedy_last_token_only(model, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, model(ids[:, -1:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def greedy_sampled(model, ids, n):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        probs = model(ids)[:, -1].float().softmax(-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    return ids


def block_unnormalised_second_attention(x, n1, attn, n2, ffn):
    return x + attn(n1(x)) + ffn(n2(x + attn(x)))


def mi_two_cells(a, c):
    total = 0.0
    for x in (True, False):
        p = ((a == x) & (c == x)).double().mean().item()
        px, py = (a == x).double().mean().item(), (c == x).double().mean().item()
        total += p * math.log2(p / (px * py)) if p else 0.0
    return total


def mi_log10(a, c):
    total = 0.0
    for x in (True, False):
        for y in (True, False):
            p = ((a == x) & (c == y)).double().mean().item()
            px, py = (a == x).double().mean().item(), (c == y).double().mean().item()
            total += p * math.log10(p / (px * py)) if p else 0.0
    return total


def bpe_training_merging_first_corpus_occurrence(texts, num_merges, pre_tokenize):
    """Merges each learned pair only where it first occurs in the whole corpus."""
    words = Counter(piece for text in texts for piece in pre_tokenize(text))
    sequences, weights = byte_sequences(words), list(words.values())
    merges = []
    for _ in range(num_merges):
        counts = Counter()
        for seq, n in zip(sequences, weights, strict=True):
            for pair in zip(seq[:-1], seq[1:], strict=True):
                counts[pair] += n
        pair = max(counts, key=counts.get)
        merges.append(pair)
        for k, seq in enumerate(sequences):
            found = next((i for i in range(len(seq) - 1) if (seq[i], seq[i + 1]) == pair), None)
            if found is not None:
                sequences[k] = seq[:found] + [seq[found] + seq[found + 1]] + seq[found + 2:]
                break
    return merges


def bpe_training_ignoring_weights_after_the_first(texts, num_merges, pre_tokenize):
    words = Counter(piece for text in texts for piece in pre_tokenize(text))
    first = learn_merges(byte_sequences(words), list(words.values()), 1)
    rest = learn_merges(byte_sequences(words), [1] * len(words), num_merges)[1:]
    return first + rest


FRESH = [
    *((ex.check_rms_norm, fn) for fn in RMS),
    *((ex.check_swiglu, fn) for fn in SWIGLU),
    *((ex.check_router, lambda *a, how=how: route(*a, how)) for how in ROUTER),
    *((ex.check_max_violation, fn) for fn in MAXVIO),
    *((ex.check_bias_update, fn) for fn in BIAS),
    *((ex.check_logit_attribution, fn) for fn in DLA),
    (ex.check_patch_hook, patch_mean), (ex.check_patch_hook, patch_range),
    *((ex.check_kv_cache_bytes, fn) for fn in KV),
    *((ex.check_logit_lens, fn) for fn in LENS),
    *((ex.check_absorbed_score, lambda *a, slip=slip: absorbed(*a, slip))
      for slip in ("inverse scale", "rotary transposed", "no rotary, minus")),
    (ex.check_mla_forward, mla_rotate_q_only),
    *((ex.check_yarn_frequencies, lambda cfg, slip=slip: yarn(cfg, slip)) for slip in ("width + 1", "m without + 1")),
    *((ex.check_newton_schulz, lambda g, n, slip=slip: newton_schulz(g, n, slip))
      for slip in ("max-abs norm", "b and c swapped")),
    (ex.check_qk_clip, qk_clip_q_pe_sqrt_only),
    (lambda fn: ex.check_greedy(fn, ex.small_k2(), torch.tensor([[1, 2, 3]])), greedy_last_token_only),
    (lambda fn: ex.check_greedy(fn, ex.small_k2(), torch.tensor([[1, 2, 3]])), greedy_sampled),
    (ex.check_block, block_unnormalised_second_attention),
    (ex.check_mutual_information, mi_two_cells), (ex.check_mutual_information, mi_log10),
    (ex.check_bpe_training, bpe_training_merging_first_corpus_occurrence),
    (ex.check_bpe_training, bpe_training_ignoring_weights_after_the_first),
]


@pytest.mark.parametrize(("check", "wrong"), FRESH, ids=[f"{i:02d}" for i in range(len(FRESH))])
def test_a_fresh_wrong_answer_does_not_pass(check, wrong):
    rejected(check(wrong))


def test_right_answers_written_oddly_pass():
    passes(ex.check_rms_norm(lambda x, w, eps: w * x * torch.rsqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)))
    passes(ex.check_swiglu(lambda x, g, u, d: torch.einsum("ni,di->nd", F.silu(x @ g.T) * (x @ u.T), d)))
    passes(ex.check_max_violation(lambda c: (c.double() / c.double().mean(-1, keepdim=True)).amax(-1) - 1))
    passes(ex.check_bias_update(lambda b, c, u: b - u * torch.sign(c - c.mean(-1, keepdim=True))))
    passes(ex.check_logit_attribution(lambda c, x, g, u, eps: (u * g) @ c / rms(x, eps)))
    passes(ex.check_mla_forward(mla))
    passes(ex.check_mutual_information(
        lambda a, c: sum(p * math.log2(p / (pa * pc)) for p, pa, pc in (
            (((a == x) & (c == y)).double().mean().item(), (a == x).double().mean().item(),
             (c == y).double().mean().item()) for x in (0, 1) for y in (0, 1)) if p > 0)))

    def bpe_all_occurrences_at_once(ranks, piece):  # the lowest-ranked pair merged everywhere, left to right
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while True:
            found = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1]
                     in ranks]
            if not found:
                return parts
            best = min(found)[0]
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and ranks.get(parts[i] + parts[i + 1]) == best:
                    out.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            parts = out

    passes(ex.check_bpe(bpe_all_occurrences_at_once))


# --- a second corpus, written after the checkers' diagnoses and never used to tune them ------------------------------


def rotate_sin_cos_swapped(x, positions, inv_freq):
    angles = positions[:, None].float() * inv_freq
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * angles.sin() - b * angles.cos(), a * angles.cos() + b * angles.sin()], dim=-1)


def rotate_in_degrees(x, positions, inv_freq):
    angles = torch.rad2deg(positions[:, None].float() * inv_freq)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], dim=-1)


def purity_first_choice(active, chosen):
    first = chosen[active].float().argmax(-1)  # each token's first chosen expert only
    return (torch.bincount(first, minlength=chosen.shape[1]).max() / active.sum()).item()


def moe_block_without(cfg, what):
    D, H, N, R, V = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                     cfg.v_head_dim)
    C, Q, E, I, S = (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.n_routed_experts, cfg.moe_intermediate_size,
                     cfg.n_shared_experts)
    query = D * Q + Q + Q * H * (N + R) if Q is not None else D * H * (N + R)
    kv_b = C * H * (N + V) if what != "values" else C * H * N
    o_proj = H * V * D if what != "o_proj" else 0
    return 2 * D + query + D * (C + R) + C + kv_b + o_proj + E * D + E + (E + S) * 3 * D * I


def mla_values_are_keys(w, cfg, x, cos, sin):
    H, N, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    q_nope, q_pe, c_kv, k_pe = mla_inputs(w, cfg, x, cos, sin)
    B, T, _ = x.shape
    kv = (c_kv @ w["kv_b_proj.weight"].T).view(B, T, H, N + V)
    k_nope = kv[..., :N]
    scores = torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
    scores = (scores * cfg.softmax_scale).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhts,bshv->bthv", scores.softmax(-1), k_nope).flatten(2) @ w["o_proj.weight"].T


def absorbed_w_uk_reshaped(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
    H, N, C = w_uk.shape
    wrong = w_uk.reshape(H, C, N)  # a reshape where a transpose was meant
    q_latent = torch.einsum("thn,hcn->htc", q_nope, wrong)
    return scale * (q_latent @ c_kv.T + torch.einsum("thr,sr->hts", q_pe, k_pe))


def yarn_slip(cfg, slip):
    R, theta, factor = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor
    sign = 1 if slip == "theta to the plus" else -1
    base = theta ** (sign * torch.arange(0, R, 2).double() / R)

    def d(beta):
        return R * math.log(cfg.original_max_position_embeddings / (2 * math.pi * beta)) / (2 * math.log(theta))

    low, high = max(math.floor(d(cfg.beta_fast)), 0), min(math.ceil(d(cfg.beta_slow)), R - 1)
    high = high + 0.001 if high == low else high
    ramp = ((torch.arange(R // 2).double() - low) / (high - low)).clamp(0, 1)
    slow = base * factor if slip == "times the factor" else base / factor
    m = 0.1 * cfg.mscale_all_dim * math.log(factor) + 1
    return slow * ramp + base * (1 - ramp), cfg.qk_head_dim**-0.5 * m**2


def ns_slip(G, steps, slip):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.norm() ** 2 if slip == "norm squared" else G.norm() + 1e-7)
    tall = G.shape[0] > G.shape[1]
    X = X.T if tall else X
    for _ in range(steps + (1 if slip == "one more step" else 0)):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def greedy_second_to_last(model, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -2 if ids.shape[1] > 1 else -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def bpe_single_bytes_only(ranks, piece):
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while True:
        found = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                 if len(parts[i]) == len(parts[i + 1]) == 1 and parts[i] + parts[i + 1] in ranks]
        if not found:
            return parts
        _, i = min(found)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def bpe_training_sorted(texts, num_merges, pre_tokenize):
    words = Counter(piece for text in texts for piece in pre_tokenize(text))
    return sorted(learn_merges(byte_sequences(words), list(words.values()), num_merges))


def bpe_training_pairs_once_per_word(texts, num_merges, pre_tokenize):
    words = Counter(piece for text in texts for piece in pre_tokenize(text))
    sequences, weights, merges = byte_sequences(words), list(words.values()), []
    for _ in range(num_merges):
        counts = Counter()
        for seq, n in zip(sequences, weights, strict=True):
            for pair in set(zip(seq[:-1], seq[1:], strict=True)):  # a pair twice in a word counted once
                counts[pair] += n
        pair = max(counts, key=counts.get)
        merges.append(pair)
        sequences = [[*seq] for seq in sequences]
        for k, seq in enumerate(sequences):
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
                    out.append(seq[i] + seq[i + 1])
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            sequences[k] = out
    return merges


def k2_first_norms_everywhere(sd, cfg, ids):
    first = {name.replace("layers.0.", f"layers.{i}."): t for name, t in sd.items() if "layernorm" in name
             and name.startswith("layers.0.") for i in range(cfg.num_hidden_layers)}
    return k2({**sd, **first}, cfg, ids)


def k2_experts_unweighted(sd, cfg, ids):
    return k2(sd, cfg, ids, router=lambda x, w, b, cfg: (route_by_config(x, w, b, cfg)[0],
                                                            torch.ones_like(route_by_config(x, w, b, cfg)[1])))


HELD_OUT = [
    (ex.check_rotation, rotate_sin_cos_swapped), (ex.check_rotation, rotate_in_degrees),
    (ex.check_moe_combine, lambda s, o, w: s * w.sum(-1, keepdim=True) + (o * w[..., None]).sum(1)),
    (ex.check_moe_combine, lambda s, o, w: s + o.sum(1) * w.sum(-1, keepdim=True)),
    (ex.check_feature_purity, purity_first_choice),
    (ex.check_feature_purity, lambda a, c: (c[a].float().sum(0).mean() / a.sum()).item()),
    (ex.check_moe_block_parameters, lambda cfg: moe_block_without(cfg, "o_proj")),
    (ex.check_moe_block_parameters, lambda cfg: moe_block_without(cfg, "values")),
    (ex.check_rms_norm, lambda x, w, eps: x / torch.sqrt(x.pow(2).mean((-2, -1), keepdim=True) + eps) * w),
    (ex.check_rms_norm, lambda x, w, eps: x * w),
    (ex.check_swiglu, lambda x, g, u, d: (torch.tanh(x @ g.T) * (x @ u.T)) @ d.T),
    (ex.check_router, lambda x, w, b, k, s: (lambda idx, wt: (idx, wt / k))(*route(x, w, b, k, s, "right"))),
    (ex.check_router, lambda x, w, b, k, s: (lambda idx: (idx, (x @ w.T).gather(-1, idx) / (x @ w.T).gather(
        -1, idx).sum(-1, keepdim=True) * s))((x @ w.T).sigmoid().add(b).topk(k, -1).indices)),
    (ex.check_max_violation, lambda c: c.max() / c.float().mean(-1) - 1),
    (ex.check_bias_update, lambda b, c, u: b + u * (c < c.mean(-1, keepdim=True)).float()),
    (ex.check_logit_attribution, lambda c, x, g, u, eps: float((u * g * x).sum() / rms(x, eps))),
    (ex.check_logit_attribution, lambda c, x, g, u, eps: float((u * g * c).sum() / rms(x, eps) * x.numel() ** 0.5)),
    (ex.check_patch_hook, lambda a, s, p: (lambda out: (out.__setitem__((0, p), s[0, p]), out)[1])(a.clone())),
    (ex.check_kv_cache_bytes, lambda cfg, n: (n - 1) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
     * cfg.num_hidden_layers),
    (ex.check_logit_lens, lambda r, n, h: h(n(r) * 2)),
    (ex.check_absorbed_score, absorbed_w_uk_reshaped),
    (ex.check_mla_forward, mla_values_are_keys),
    *((ex.check_yarn_frequencies, lambda cfg, slip=slip: yarn_slip(cfg, slip))
      for slip in ("theta to the plus", "times the factor")),
    *((ex.check_newton_schulz, lambda g, n, slip=slip: ns_slip(g, n, slip)) for slip in ("norm squared",
                                                                                        "one more step")),
    (ex.check_qk_clip, lambda h, m, t: {p: v * {"q_nope": min(1, t / m) ** 0.5, "k_nope": min(1, t / m) ** 0.5,
                                                "q_pe": min(1, t / m), "v": min(1, t / m)}.get(p, 1.0)
                                        for p, v in h.items()}),
    (lambda fn: ex.check_greedy(fn, ex.small_k2(), torch.tensor([[1, 2, 3]])), greedy_second_to_last),
    (ex.check_block, lambda x, n1, a, n2, f: (lambda h: h + f(n2(h)))(n1(x + a(x)))),
    (ex.check_mutual_information, lambda a, c: -mi_two_cells(a, c) - mi_two_cells(a, ~c)),
    (ex.check_bpe, bpe_single_bytes_only),
    (ex.check_bpe_training, bpe_training_sorted),
    (ex.check_bpe_training, bpe_training_pairs_once_per_word),
    (ex.check_model_from_weights, k2_first_norms_everywhere),
    (ex.check_model_from_weights, k2_experts_unweighted),
]


@pytest.mark.parametrize(("check", "wrong"), HELD_OUT, ids=[f"{i:02d}" for i in range(len(HELD_OUT))])
def test_a_held_out_wrong_answer_does_not_pass(check, wrong):
    rejected(check(wrong), "held out")


def test_held_out_right_answers_written_oddly_pass():
    passes(ex.check_swiglu(lambda x, g, u, d: ((x @ g.T) * (x @ g.T).sigmoid() * (x @ u.T)) @ d.T))
    passes(ex.check_router(lambda x, w, b, k, s: (lambda idx: (idx, (lambda sc: sc / sc.sum(-1, keepdim=True) * s)(
        (x @ w.T).sigmoid().gather(-1, idx))))(((x @ w.T).sigmoid() + b).softmax(-1).topk(k, -1).indices)))
    passes(ex.check_moe_combine(lambda s, o, w: s + (o * w[..., None]).mean(1) * o.shape[1]))
    # each expert against the mean of the OTHERS: sign((S - c) / (E - 1) - c) = sign(S - E c), the same sign
    passes(ex.check_bias_update(lambda b, c, u: b + u * torch.sign((c.sum(-1, keepdim=True) - c) / (c.shape[-1] - 1)
                                                                   - c)))
    passes(ex.check_mutual_information(lambda a, c: sum(
        p * math.log(p / (pa * pc)) for p, pa, pc in (
            (((a == x) & (c == y)).double().mean().item(), (a == x).double().mean().item(),
             (c == y).double().mean().item()) for x in (0, 1) for y in (0, 1)) if p > 0) / math.log(2)))


# --- a third corpus, written after the second's diagnoses, measured once and not tuned on -------------------------


def rotate_off_by_one(x, positions, inv_freq):
    angles = (positions[:, None].float() + 1) * inv_freq
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], dim=-1)


def mla_scaled_after_softmax(w, cfg, x, cos, sin):
    H, N, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    q_nope, q_pe, c_kv, k_pe = mla_inputs(w, cfg, x, cos, sin)
    B, T, _ = x.shape
    kv = (c_kv @ w["kv_b_proj.weight"].T).view(B, T, H, N + V)
    scores = torch.einsum("bthn,bshn->bhts", q_nope, kv[..., :N]) + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    pattern = scores.softmax(-1) * cfg.softmax_scale
    return torch.einsum("bhts,bshv->bthv", pattern, kv[..., N:]).flatten(2) @ w["o_proj.weight"].T


def ns_wide_transposed(G, steps):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.norm() + 1e-7)
    wide = G.shape[0] < G.shape[1]  # the condition the wrong way round
    X = X.T if wide else X
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if wide else X


def greedy_sliding_window(model, ids, n):
    out = ids
    for _ in range(n):
        window = out[:, -ids.shape[1]:]  # only the last T tokens
        out = torch.cat([out, model(window)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out


def mi_from_counts(a, c):
    total = 0.0
    for x in (True, False):
        for y in (True, False):
            n = ((a == x) & (c == y)).sum().item()
            nx, ny = (a == x).sum().item(), (c == y).sum().item()
            total += n * math.log2(n / (nx * ny)) if n else 0.0
    return total


def bpe_stop_at_two(ranks, piece):
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 2:
        found = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]
        if not found:
            break
        _, i = min(found)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def bpe_training_reversed_pairs(texts, num_merges, pre_tokenize):
    words = Counter(piece for text in texts for piece in pre_tokenize(text))
    return [(b, a) for a, b in learn_merges(byte_sequences(words), list(words.values()), num_merges)]


def k2_embedding_scaled(sd, cfg, ids):
    return k2({**sd, "embed_tokens.weight": sd["embed_tokens.weight"] * cfg.hidden_size**0.5}, cfg, ids)


def moe_block_two_matrix_routed(cfg):
    D, H, N, R, V = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                     cfg.v_head_dim)
    C, Q, E, I, S = (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.n_routed_experts, cfg.moe_intermediate_size,
                     cfg.n_shared_experts)
    query = D * Q + Q + Q * H * (N + R) if Q is not None else D * H * (N + R)
    return (2 * D + query + D * (C + R) + C + C * H * (N + V) + H * V * D + E * D + E + E * 2 * D * I
            + S * 3 * D * I)


HELD_OUT_2 = [
    (ex.check_rms_norm, lambda x, w, eps: x / (x.abs().mean(-1, keepdim=True) + eps) * w),
    (ex.check_rms_norm, lambda x, w, eps: (x * w) / x.pow(2).mean(-1, keepdim=True).sqrt() + eps),
    (ex.check_swiglu, lambda x, g, u, d: 0.5 * (F.silu(x @ g.T) * (x @ u.T)) @ d.T),
    (ex.check_router, lambda x, w, b, k, s: (lambda idx: (idx, (x @ w.T).sigmoid().gather(-1, idx) / (
        x @ w.T).sigmoid().gather(-1, idx).amax(-1, keepdim=True) * s))(((x @ w.T).sigmoid() + b).topk(k, -1).indices)),
    (ex.check_router, lambda x, w, b, k, s: (lambda idx: (idx, (x @ w.T).sigmoid().gather(-1, idx) / (
        x @ w.T).sigmoid().gather(-1, idx).sum(-1, keepdim=True) * s))(b.expand(x.shape[0], -1).topk(k, -1).indices)),
    (ex.check_max_violation, lambda c: (c.amax(-1) - c.amin(-1)) / c.amax(-1).float()),
    (ex.check_bias_update, lambda b, c, u: b * (1 + u * torch.sign(c.mean(-1, keepdim=True) - c))),
    (ex.check_logit_attribution, lambda c, x, g, u, eps: float((u * g * g * c).sum() / rms(x, eps))),
    (ex.check_patch_hook, lambda a, s, p: (lambda out: (out.__setitem__((slice(None), p[0]), s[:, p[0]]), out)[1])(
        a.clone())),
    (ex.check_kv_cache_bytes, lambda cfg, n: n * cfg.kv_lora_rank * 4 * cfg.num_hidden_layers),
    (ex.check_moe_block_parameters, moe_block_two_matrix_routed),
    (ex.check_logit_lens, lambda r, n, h: h(n(r).flip(-1))),
    (ex.check_absorbed_score, lambda qn, qp, ckv, kp, wuk, sc: sc * (
        torch.einsum("thn,hnc->htc", qn, wuk) @ ckv.T + torch.einsum("tr,sr->ts", qp.sum(1), kp)[None])),
    (ex.check_mla_forward, mla_scaled_after_softmax),
    (ex.check_yarn_frequencies, lambda cfg: learner_yarn(cfg, log=math.log10)),  # the wrong logarithm
    (ex.check_newton_schulz, ns_wide_transposed),
    (ex.check_qk_clip, lambda h, m, t: {p: v * {"q_nope": min(1, t / m) ** 0.5, "k_pe": min(1, t / m) ** 0.5,
                                                "q_pe": min(1, t / m)}.get(p, 1.0) for p, v in h.items()}),
    (lambda fn: ex.check_greedy(fn, ex.small_k2(), torch.tensor([[1, 2, 3]])), greedy_sliding_window),
    (ex.check_block, lambda x, n1, a, n2, f: x + f(n2(x + a(n1(x))))),
    (ex.check_mutual_information, mi_from_counts),
    (ex.check_feature_purity, lambda a, c: (c[a].float().sum(0).max() / c[a].float().sum()).item()),
    (ex.check_bpe, bpe_stop_at_two),
    (ex.check_bpe_training, bpe_training_reversed_pairs),
    (ex.check_model_from_weights, k2_embedding_scaled),
    (ex.check_rotation, rotate_off_by_one),
]


@pytest.mark.parametrize(("check", "wrong"), HELD_OUT_2, ids=[f"{i:02d}" for i in range(len(HELD_OUT_2))])
def test_a_second_held_out_wrong_answer_does_not_pass(check, wrong):
    rejected(check(wrong), "held out 2")


@pytest.mark.parametrize("corpus", ["fresh", "held out", "held out 2"])
def test_most_rejections_of_unseen_wrong_answers_name_the_mistake(corpus):
    """Issue 50's bar: at least 70% of the rejections of wrong answers the checkers were not written against name the
    mistake (a stub's or a crash's verdict is not a rejection of an answer, and is left out)."""
    answers = {"fresh": FRESH, "held out": HELD_OUT, "held out 2": HELD_OUT_2}[corpus]
    verdicts = [check(wrong) for check, wrong in answers]
    rejections = [v for v in verdicts if not v.ok and not any(text in v.message for text in NOT_AN_ANSWER)]
    unnamed = [v.message.splitlines()[0] for v in rejections if v.mistake is None]
    assert len(rejections) >= 0.9 * len(answers), [v.message for v in verdicts if v not in rejections]
    assert len(unnamed) <= 0.3 * len(rejections), unnamed
