"""Checkers that judge how, not only what (issue #50): the absorbed forms may build no per-head key or value in any
layout, at any scale, by any slicing; the right answers written otherwise (another order, a loop over heads or
queries, one einsum in the right order) still pass. Each wrong answer is one a learner wrote that passed before."""

from __future__ import annotations

import torch
from learner import fails_with, mla, mla_absorbed, mla_inputs, passes

from k2lab.lab import exercises as ex

# --- 03: the absorbed score ---------------------------------------------------------------------------------------


def absorbed_score(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
    q_latent = torch.einsum("thn,hnc->htc", q_nope, w_uk)  # [H, T, C]: W_UK^T q, per head
    return scale * (q_latent @ c_kv.T + torch.einsum("thr,sr->hts", q_pe, k_pe))


def rotary(q_pe, k_pe):
    return torch.einsum("thr,sr->hts", q_pe, k_pe)


def test_absorbed_score_right_answers_written_otherwise_pass():
    passes(ex.check_absorbed_score(absorbed_score))

    def head_by_head(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
        rows = [(q_nope[:, h] @ w_uk[h]) @ c_kv.T for h in range(w_uk.shape[0])]  # [T, C] @ [C, S] per head
        return scale * (torch.stack(rows) + rotary(q_pe, k_pe))

    def query_by_query(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
        cols = [torch.einsum("hn,hnc,sc->hs", q_nope[t], w_uk, c_kv) if False else
                torch.einsum("hn,hnc->hc", q_nope[t], w_uk) @ c_kv.T for t in range(q_nope.shape[0])]
        return scale * (torch.stack(cols, 1) + rotary(q_pe, k_pe))

    def one_einsum_in_order(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
        return scale * (torch.einsum("thn,hnc,sc->hts", q_nope, w_uk, c_kv) + rotary(q_pe, k_pe))

    def scale_folded_into_the_query(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
        return absorbed_score(scale * q_nope, scale * q_pe, c_kv, k_pe, w_uk, 1.0)

    for answer in (head_by_head, query_by_query, scale_folded_into_the_query):
        passes(ex.check_absorbed_score(answer))
    if not torch.backends.opt_einsum.enabled or not torch.backends.opt_einsum.is_available():
        passes(ex.check_absorbed_score(one_einsum_in_order))  # torch contracts from the left: W_UK^T q first


def test_absorbed_score_keys_at_any_scale_or_position_by_position_fail():
    def keys_from_scaled_w_uk(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
        k_nope = torch.einsum("sc,hnc->hsn", c_kv, scale * w_uk)  # the keys, scaled: still every head's keys
        return torch.einsum("thn,hsn->hts", q_nope, k_nope) + scale * rotary(q_pe, k_pe)

    def keys_one_position_at_a_time(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
        cols = []
        for s in range(c_kv.shape[0]):
            k_s = torch.einsum("c,hnc->hn", c_kv[s], w_uk)  # [H, N]: every head's key at position s
            cols.append(torch.einsum("thn,hn->ht", q_nope, k_s))
        return scale * (torch.stack(cols, -1) + rotary(q_pe, k_pe))

    def keys_one_head_and_position_at_a_time(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
        H, S = w_uk.shape[0], c_kv.shape[0]
        out = torch.zeros(H, q_nope.shape[0], S)
        for h in range(H):
            for s in range(S):
                out[h, :, s] = q_nope[:, h] @ (w_uk[h] @ c_kv[s])  # w_uk[h] @ c_kv[s]: one key [N]
        return scale * (out + rotary(q_pe, k_pe))

    for wrong in (keys_from_scaled_w_uk, keys_one_position_at_a_time, keys_one_head_and_position_at_a_time):
        fails_with(ex.check_absorbed_score(wrong), "built each head's keys")


def test_one_einsum_contracted_in_the_wrong_order_is_told_what_torch_did():
    def one_einsum(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
        return scale * (torch.einsum("sc,hnc,thn->hts", c_kv, w_uk, q_nope) + rotary(q_pe, k_pe))

    verdict = ex.check_absorbed_score(one_einsum)
    fails_with(verdict, "torch contracted c_KV with W_UK first inside your einsum")
    assert verdict.mistake is not None


# --- 03: absorbed MLA ---------------------------------------------------------------------------------------------


def values_folded(w, cfg, x, cos, sin, key_scale=1.0, values_by_position=False):
    """Absorbed MLA whose values are folded (W_UV after the attention) but whose keys are built from
    ``key_scale * W_UK`` (any scale is still every head's keys), or whose values are expanded position by position."""
    H, N, V, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q_nope, q_pe, c_kv, k_pe = mla_inputs(w, cfg, x, cos, sin)
    w_uk, w_uv = w["kv_b_proj.weight"].view(H, N + V, C).split([N, V], dim=1)
    T = x.shape[1]
    if values_by_position:
        for s in range(T):
            torch.einsum("bc,hvc->bhv", c_kv[:, s], w_uv)  # every head's value at position s: forbidden
        return mla_absorbed(w, cfg, x, cos, sin)
    k_nope = torch.einsum("bsc,hnc->bshn", c_kv, key_scale * w_uk)
    scores = (torch.einsum("bthn,bshn->bhts", q_nope, k_nope) / key_scale
              + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)) * cfg.softmax_scale
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    latent_out = torch.einsum("bhts,bsc->bthc", scores.softmax(-1), c_kv)
    return torch.einsum("bthc,hvc->bthv", latent_out, w_uv).flatten(2) @ w["o_proj.weight"].T


def test_absorbed_mla_with_scaled_keys_or_values_by_position_fails():
    fails_with(ex.check_mla_forward(lambda *a: values_folded(*a, key_scale=0.5), absorbed=True),
               "built each head's keys")
    fails_with(ex.check_mla_forward(lambda *a: values_folded(*a, values_by_position=True), absorbed=True),
               "expanded each head's values")


def test_absorbed_mla_query_by_query_passes():
    """A decode-style loop over the queries: at position 0 the output of a head is exactly its value at key 0 (the
    one key it sees), which the watch must not take for building values."""

    def query_by_query(w, cfg, x, cos, sin):
        H, N, V, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q_nope, q_pe, c_kv, k_pe = mla_inputs(w, cfg, x, cos, sin)
        w_uk, w_uv = w["kv_b_proj.weight"].view(H, N + V, C).split([N, V], dim=1)
        outs = []
        for t in range(x.shape[1]):
            query = torch.cat([torch.einsum("bhn,hnc->bhc", q_nope[:, t], w_uk), q_pe[:, t]], -1)  # [B, H, C+R]
            keys = torch.cat([c_kv[:, : t + 1], k_pe[:, : t + 1]], -1)  # [B, t+1, C+R]: the cache so far
            pattern = (torch.einsum("bhc,bsc->bhs", query, keys) * cfg.softmax_scale).softmax(-1)
            latent = torch.einsum("bhs,bsc->bhc", pattern, c_kv[:, : t + 1])
            outs.append(torch.einsum("bhc,hvc->bhv", latent, w_uv).flatten(1))  # [B, H*V]
        return torch.stack(outs, 1) @ w["o_proj.weight"].T

    passes(ex.check_mla_forward(query_by_query, absorbed=True))


# --- 03: the causal mask ------------------------------------------------------------------------------------------


def test_a_causal_mask_made_by_multiplying_is_named():
    def times_tril(scores):
        T = scores.shape[-1]
        return scores * torch.ones(T, T).tril()

    fails_with(ex.check_mla_forward(lambda *a: mla(*a, mask=times_tril)), "multiplying the scores with tril")
