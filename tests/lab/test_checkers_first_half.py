"""The first half of the course (notebooks 00-03): wrong answers that the checkers used to meet with a generic or a
misleading reason now get their own, and the right answers the notebooks' solution cells give still pass. Each wrong
answer is written the way a learner would write it (see tests/lab/test_checkers_wrong_answers.py for the others)."""

from __future__ import annotations

import math
from collections import Counter

import torch
from learner import byte_sequences, count_pairs, fails_with, learn_merges, merge_pair, pairs_in, passes, yarn

from k2lab import viz
from k2lab.lab import exercises as ex


def rms_norm(x, weight, eps):
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x, cos, sin):
    x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)  # the checkpoint's interleaved pairs -> halves
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


def causal(scores):
    T = scores.shape[-1]
    return scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))


def mla_inputs(w, cfg, x, cos, sin):
    H, N, R, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    B, T, _ = x.shape
    c_q = rms_norm(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], cfg.rms_norm_eps)
    q = (c_q @ w["q_b_proj.weight"].T).view(B, T, H, N + R)
    kv_a = x @ w["kv_a_proj_with_mqa.weight"].T
    c_kv = rms_norm(kv_a[..., :C], w["kv_a_layernorm.weight"], cfg.rms_norm_eps)
    return q[..., :N], rotate(q[..., N:], cos[:, None], sin[:, None]), c_kv, rotate(kv_a[..., C:], cos, sin)


def mla(w, cfg, x, cos, sin, scale=None):
    """Naive MLA from the weights (``scale`` None: the right one)."""
    H, N, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    B, T, _ = x.shape
    q_nope, q_pe, c_kv, k_pe = mla_inputs(w, cfg, x, cos, sin)
    kv = (c_kv @ w["kv_b_proj.weight"].T).view(B, T, H, N + V)
    scores = torch.einsum("bthn,bshn->bhts", q_nope, kv[..., :N]) + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
    pattern = causal(scores * (cfg.softmax_scale if scale is None else scale)).softmax(-1)
    return torch.einsum("bhts,bshv->bthv", pattern, kv[..., N:]).flatten(2) @ w["o_proj.weight"].T


def mla_absorbed(w, cfg, x, cos, sin, scale=None):
    """Absorbed MLA: one multi-query attention over [W_UK^T q_nope ; q_pe] . [c_KV ; k_pe]."""
    H, N, V, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q_nope, q_pe, c_kv, k_pe = mla_inputs(w, cfg, x, cos, sin)
    w_uk, w_uv = w["kv_b_proj.weight"].view(H, N + V, C).split([N, V], dim=1)
    query = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w_uk), q_pe], dim=-1)
    keys = torch.cat([c_kv, k_pe], dim=-1)
    scores = torch.einsum("bthc,bsc->bhts", query, keys) * (cfg.softmax_scale if scale is None else scale)
    latent_out = torch.einsum("bhts,bsc->bthc", causal(scores).softmax(-1), c_kv)
    return torch.einsum("bthc,hvc->bthv", latent_out, w_uv).flatten(2) @ w["o_proj.weight"].T


# --- 01: rank-BPE and BPE training --------------------------------------------------------------------------------


def test_bpe_that_breaks_ties_to_the_right_is_told_so():
    def rightmost_first(ranks, piece):
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while pairs := pairs_in(ranks, parts):
            lowest = min(rank for rank, _ in pairs)
            i = max(i for rank, i in pairs if rank == lowest)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    fails_with(ex.check_bpe(rightmost_first), "merge the LEFTMOST occurrence first")


def test_bpe_training_that_merges_the_first_occurrence_only_is_told_so():
    def merge_first(seq, pair):
        seq = list(seq)
        for i in range(len(seq) - 1):
            if (seq[i], seq[i + 1]) == pair:
                seq[i:i + 2] = [seq[i] + seq[i + 1]]
                break
        return seq

    def train(texts, num_merges, pre_tokenize):
        words = Counter(piece for text in texts for piece in pre_tokenize(text))
        sequences, weights, merges = byte_sequences(words), list(words.values()), []
        for _ in range(num_merges):
            counts = count_pairs(sequences, weights)
            pair = max(counts, key=counts.get)
            merges.append(pair)
            sequences = [merge_first(seq, pair) for seq in sequences]
        return merges

    verdict = ex.check_bpe_training(train)
    fails_with(verdict, "merged only the first occurrence")
    assert "never occurs" not in verdict.message  # the reason it used to get


def test_bpe_training_that_splits_on_whitespace_is_told_to_use_the_pre_tokenizer():
    def train(texts, num_merges, pre_tokenize):
        words = Counter(word for text in texts for word in text.split())
        return learn_merges(byte_sequences(words), list(words.values()), num_merges)

    fails_with(ex.check_bpe_training(train), "use the pre_tokenize function")


def test_bpe_training_as_the_notebook_writes_it_passes():
    """01's solution: a pair counter, a merge that replaces every occurrence, and the loop around them."""

    def train(texts, num_merges, pre_tokenize):
        words = Counter(piece for text in texts for piece in pre_tokenize(text))
        sequences = {tuple(bytes([b]) for b in word.encode()): n for word, n in words.items()}
        merges = []
        for _ in range(num_merges):
            counts = Counter()
            for seq, n in sequences.items():
                for pair in zip(seq[:-1], seq[1:], strict=True):
                    counts[pair] += n
            if not counts:
                break
            best = max(counts, key=counts.get)
            merges.append(best)
            sequences = {tuple(merge_pair(list(seq), best)): n for seq, n in sequences.items()}
        return merges

    passes(ex.check_bpe_training(train))


# --- 02: YaRN -----------------------------------------------------------------------------------------------------


def test_yarn_without_the_two_pi_is_told_so_not_a_wrong_scale():
    def without_two_pi(cfg):
        R, theta, factor = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor
        base = 1.0 / theta ** (torch.arange(0, R, 2).double() / R)

        def d(beta):
            return R * math.log(cfg.original_max_position_embeddings / beta) / (2 * math.log(theta))

        low, high = max(math.floor(d(cfg.beta_fast)), 0), min(math.ceil(d(cfg.beta_slow)), R - 1)
        high = high + 0.001 if high == low else high
        ramp = ((torch.arange(R // 2).double() - low) / (high - low)).clamp(0, 1)
        return base / factor * ramp + base * (1 - ramp), yarn(cfg)[1]

    verdict = ex.check_yarn_frequencies(without_two_pi)
    fails_with(verdict, "you left out the 2 pi")
    assert "wrong scale" not in verdict.message


def test_yarn_right_and_in_float32_passes():
    passes(ex.check_yarn_frequencies(yarn))
    passes(ex.check_yarn_frequencies(lambda cfg: (yarn(cfg)[0].float(), torch.tensor(yarn(cfg)[1]))))


# --- 03: MLA ------------------------------------------------------------------------------------------------------


def test_mla_scale_slips_each_get_their_reason():
    m = lambda cfg: cfg.yarn_mscale  # noqa: E731
    passes(ex.check_mla_forward(mla))
    passes(ex.check_mla_forward(mla_absorbed, absorbed=True))
    fails_with(ex.check_mla_forward(lambda w, c, x, co, si: mla(w, c, x, co, si, c.qk_head_dim**-0.5 * m(c))),
               "m goes in squared")
    fails_with(ex.check_mla_forward(
        lambda w, c, x, co, si: mla(w, c, x, co, si, c.qk_nope_head_dim**-0.5 * m(c) ** 2)),
        "not N^-1/2 * m^2")
    fails_with(ex.check_mla_forward(
        lambda w, c, x, co, si: mla_absorbed(w, c, x, co, si, scale=c.qk_nope_head_dim**-0.5 * m(c) ** 2),
        absorbed=True), "not N^-1/2 * m^2")


def test_mla_rotated_the_wrong_way_is_told_so():
    fails_with(ex.check_mla_forward(lambda w, c, x, co, si: mla(w, c, x, co, -si)), "rotated the wrong way")


# --- the token colours --------------------------------------------------------------------------------------------


def test_token_spans_set_their_own_text_colour():
    """JupyterLab's dark theme writes near-white text: on the pastel backgrounds the colour must be set, not
    inherited, for every token and its id."""
    html = viz.spans_html([("a", "1"), ("b", None)])
    assert html.count(f"color:{viz.tokens.TEXT}") == 2 and f"color:{viz.tokens.LABEL}" in html


def test_attention_pattern_labels_thin_out_instead_of_overlapping():
    """03's attention explorer: 44 tokens in one panel's height overlapped; beyond about 22 every k-th is labelled."""
    short, long = (viz.pattern_figure(torch.rand(2, T, T), [f"t{i}" for i in range(T)]) for T in (10, 44))
    assert short.layout.yaxis.dtick == 1 and long.layout.yaxis.dtick == 2


def test_an_answer_off_only_on_small_entries_is_not_called_a_wrong_scale():
    """Equal on its large entries and off on the small ones: the ratio on the large entries is 1, so no scale is
    wrong; the verdict gives the gap. A constant factor still gets its scale."""
    from k2lab.lab.exercises.checking import compare

    expected = torch.tensor([10.0, -20.0, 30.0, 0.02, -0.03])
    off_small = expected.clone()
    off_small[3:] = 0.5
    verdict = compare("out", off_small, expected)
    assert not verdict.ok and "wrong scale" not in verdict.message and "differs from k2lab by up to" in verdict.message
    fails_with(compare("out", expected * 2, expected), "wrong scale: yours is 2 times the right answer")
