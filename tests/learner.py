"""What the checkers' tests share (tests/lab/test_checkers_*.py): asserting a verdict, a learner's own BPE (the right
rule written from its definition: count pairs, merge the most frequent, repeat) and a learner's own MLA from its
weights, naive and absorbed, for the wrong answers to vary."""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn.functional as F

from k2lab.lab import exercises as ex


def passes(verdict: ex.Verdict) -> None:
    assert isinstance(verdict, ex.Verdict)
    assert verdict.ok and repr(verdict).startswith("✓"), verdict.message


# Every rejection a test asserts, for tests/lab/conftest.py's count of how many name the mistake (a stub, a crash or
# a checker given no function is not a wrong answer, and is left out).
# Rejections of wrong answers written apart from the checkers' mistake lists are kept under their corpus's name
# (test_checkers_fresh.py: "fresh", written before the checkers' diagnoses; "held out", written after them and never
# used to tune them).
REJECTED: dict[str, list[ex.Verdict]] = {"known mistakes": []}
NOT_AN_ANSWER = ("not written yet", "your function raised", "fn must be your function")


def fails_with(verdict: ex.Verdict, reason: str, corpus: str = "known mistakes") -> None:
    assert isinstance(verdict, ex.Verdict)
    assert not verdict.ok and repr(verdict).startswith("✗"), verdict.message
    assert reason in verdict.message, verdict.message
    if not any(text in verdict.message for text in NOT_AN_ANSWER):
        REJECTED.setdefault(corpus, []).append(verdict)


def pairs_in(ranks, parts):
    """(rank, position) of every adjacent pair of ``parts`` whose merge ``ranks`` knows."""
    return [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]


def byte_sequences(words):
    return [[bytes([b]) for b in word.encode()] for word in words]


def count_pairs(sequences, weights):
    counts = Counter()
    for seq, n in zip(sequences, weights, strict=True):
        for pair in zip(seq[:-1], seq[1:], strict=True):
            counts[pair] += n
    return counts


def merge_pair(seq, pair):
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(seq[i] + seq[i + 1])
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def learn_merges(sequences, weights, num_merges, pick=max):
    """``num_merges`` merges, each of the pair ``pick`` chooses by count (max: the most frequent)."""
    merges = []
    for _ in range(num_merges):
        counts = count_pairs(sequences, weights)
        pair = pick(counts, key=counts.get)
        merges.append(pair)
        sequences = [merge_pair(seq, pair) for seq in sequences]
    return merges


# --- MLA from its weights, as the learner writes it (03) ----------------------------------------------------------


def rms_norm(x, weight, eps):
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate_half(x, cos, sin, deinterleave=True):
    if deinterleave:  # the checkpoint's pairs (x0, x1), (x2, x3), ... -> evens first, then odds
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


def mla_inputs(w, cfg, x, cos, sin, kv_norm=True, deinterleave=True):
    """The queries' parts, the normalised latent c_KV and the rotated shared key, as the learner computes them."""
    H, N, R, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    B, T, _ = x.shape
    c_q = rms_norm(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], cfg.rms_norm_eps)
    q = (c_q @ w["q_b_proj.weight"].T).view(B, T, H, N + R)
    q_nope, q_pe = q[..., :N], rotate_half(q[..., N:], cos[:, None], sin[:, None], deinterleave)
    kv_a = x @ w["kv_a_proj_with_mqa.weight"].T
    c_kv = rms_norm(kv_a[..., :C], w["kv_a_layernorm.weight"], cfg.rms_norm_eps) if kv_norm else kv_a[..., :C]
    return q_nope, q_pe, c_kv, rotate_half(kv_a[..., C:], cos, sin, deinterleave)


def causal(scores):
    T = scores.shape[-1]
    return scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))


def mla(w, cfg, x, cos, sin, kv_norm=True, deinterleave=True, mask=causal):
    H, N, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    B, T, _ = x.shape
    q_nope, q_pe, c_kv, k_pe = mla_inputs(w, cfg, x, cos, sin, kv_norm, deinterleave)
    kv = (c_kv @ w["kv_b_proj.weight"].T).view(B, T, H, N + V)
    k_nope, v = kv[..., :N], kv[..., N:]
    scores = torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
    pattern = mask(scores * cfg.softmax_scale).softmax(-1)
    return torch.einsum("bhts,bshv->bthv", pattern, v).flatten(2) @ w["o_proj.weight"].T


def mla_absorbed(w, cfg, x, cos, sin, scale=None):
    H, N, V, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q_nope, q_pe, c_kv, k_pe = mla_inputs(w, cfg, x, cos, sin)
    w_uk, w_uv = w["kv_b_proj.weight"].view(H, N + V, C).split([N, V], dim=1)
    query = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w_uk), q_pe], dim=-1)  # [W_UK^T q_nope ; q_pe]
    keys = torch.cat([c_kv, k_pe], dim=-1)  # [c_KV ; k_pe]: one key per position, shared by every head
    scores = torch.einsum("bthc,bsc->bhts", query, keys) * (cfg.softmax_scale if scale is None else scale)
    latent_out = torch.einsum("bhts,bsc->bthc", causal(scores).softmax(-1), c_kv)
    return torch.einsum("bthc,hvc->bthv", latent_out, w_uv).flatten(2) @ w["o_proj.weight"].T


# --- the whole K2 from its state dict, with the learner's pieces (09) ----------------------------------------


def yarn(cfg, log=math.log):
    """YaRN's inverse frequencies [R/2] and softmax scale, as the learner writes them in 02 (``log=math.log10``: the
    slip of the wrong logarithm)."""
    R, theta, factor = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor
    base = 1.0 / theta ** (torch.arange(0, R, 2).double() / R)

    def d(beta):
        return R * log(cfg.original_max_position_embeddings / (2 * math.pi * beta)) / (2 * math.log(theta))

    low, high = max(math.floor(d(cfg.beta_fast)), 0), min(math.ceil(d(cfg.beta_slow)), R - 1)
    high = high + 0.001 if high == low else high
    ramp = ((torch.arange(R // 2).double() - low) / (high - low)).clamp(0, 1)
    m = 0.1 * cfg.mscale_all_dim * math.log(factor) + 1
    return base / factor * ramp + base * (1 - ramp), cfg.qk_head_dim**-0.5 * m**2


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def route(x, weight, bias, cfg):
    s = (x @ weight.T).sigmoid()
    idx = (s + bias).topk(cfg.num_experts_per_tok, dim=-1).indices
    w = s.gather(-1, idx)
    return idx, w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor


def moe(x, sd, p, cfg, router=route):
    idx, weights = router(x, sd[p + "gate.weight"], sd[p + "gate.e_score_correction_bias"], cfg)
    out = swiglu(x, sd[p + "shared_experts.gate_proj.weight"], sd[p + "shared_experts.up_proj.weight"],
                 sd[p + "shared_experts.down_proj.weight"])
    gate, up, down = (sd[p + f"experts.{name}"] for name in ("gate_proj", "up_proj", "down_proj"))
    for slot in range(idx.shape[-1]):
        for n, e in enumerate(idx[..., slot].flatten().tolist()):
            b, t = divmod(n, x.shape[1])
            out[b, t] += weights[b, t, slot] * swiglu(x[b, t], gate[e], up[e], down[e])
    return out


def k2(sd, cfg, ids, router=route, final_norm=True, tied=False, attention=mla):
    """The whole K2 from its state dict, with the learner's pieces (``attention``: their MLA from its weights)."""
    x = sd["embed_tokens.weight"][ids]
    T = ids.shape[1]
    angles = torch.arange(T).float()[:, None] * yarn(cfg)[0].float()  # the learner's own YaRN, from exercise 2
    angles = torch.cat([angles, angles], dim=-1)  # YaRN's factor on cos and sin is 1 for K2's mscale settings
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        attn_w = {name[len(p + "self_attn."):]: t for name, t in sd.items() if name.startswith(p + "self_attn.")}
        h = rms_norm(x, sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        x = x + attention(attn_w, cfg, h, angles.cos(), angles.sin())
        h = rms_norm(x, sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        if i < cfg.first_k_dense_replace:
            x = x + swiglu(h, sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"],
                           sd[p + "mlp.down_proj.weight"])
        else:
            x = x + moe(h, sd, p + "mlp.", cfg, router)
    if final_norm:
        x = rms_norm(x, sd["norm.weight"], cfg.rms_norm_eps)
    return x @ (sd["embed_tokens.weight"] if tied else sd["lm_head.weight"]).T
