"""The exercises' check functions: a right solution (written here from the formulas, independently of k2lab) passes,
and each typical mistake gets its own message."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from learner import fails_with

from k2lab import K2Config
from k2lab.lab import exercises as ex


def verdict_of(check, fn, *args):
    verdict = check(fn, *args)
    assert isinstance(verdict, ex.Verdict)
    return verdict


def assert_fails_with(check, fn, text, *args):
    fails_with(verdict_of(check, fn, *args), text)


def test_unwritten_stub_and_crash_and_none_are_reported():
    def stub(x, weight, eps):
        raise NotImplementedError

    assert_fails_with(ex.check_rms_norm, stub, "not written yet")
    assert_fails_with(ex.check_rms_norm, lambda x, w, eps: x.foo(), "raised AttributeError")
    assert_fails_with(ex.check_rms_norm, lambda x, w, eps: None, "returned None")


# --- RMSNorm


def rms_norm(x, weight, eps):
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_rms_norm():
    verdict = verdict_of(ex.check_rms_norm, rms_norm)
    assert verdict.ok and repr(verdict).startswith("✓")
    ms = lambda x: x.pow(2).mean(-1, keepdim=True)  # noqa: E731
    cases = {
        "forgot the eps": lambda x, w, eps: w * x / ms(x).sqrt(),
        "forgot the weight": lambda x, w, eps: x / (ms(x) + eps).sqrt(),
        "LayerNorm": lambda x, w, eps: w * F.layer_norm(x, x.shape[-1:], eps=eps),
        "eps goes inside": lambda x, w, eps: w * x / (ms(x).sqrt() + eps),
        "wrong dimension": lambda x, w, eps: w * x / (x.pow(2).mean(0, keepdim=True) + eps).sqrt(),
        "sum of squares": lambda x, w, eps: w * x / (x.pow(2).sum(-1, keepdim=True) + eps).sqrt(),
        "wrong shape": lambda x, w, eps: (w * x / (ms(x) + eps).sqrt())[0],
        "wrong scale": lambda x, w, eps: 2 * rms_norm(x, w, eps),
    }
    for text, fn in cases.items():
        assert_fails_with(ex.check_rms_norm, fn, text)


# --- the rotation


def rotate(x, positions, inv_freq):
    angles = positions[:, None].float() * inv_freq  # [T, R/2]
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], dim=-1)


def test_rotation():
    assert verdict_of(ex.check_rotation, rotate).ok
    flipped = lambda x, p, f: rotate(x, -p, f)  # noqa: E731

    def neighbours(x, p, f):
        angles = p[:, None].float() * f
        a, b = x[:, 0::2], x[:, 1::2]
        return torch.stack([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], -1).flatten(1)

    assert_fails_with(ex.check_rotation, flipped, "wrong way")
    assert_fails_with(ex.check_rotation, neighbours, "paired neighbours")
    assert_fails_with(ex.check_rotation, lambda x, p, f: rotate(x, torch.ones_like(p), f), "same angles")
    assert_fails_with(ex.check_rotation, lambda x, p, f: 1.5 * rotate(x, p, f), "keeps each pair's length")


# --- the absorbed score


def absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
    q_latent = torch.einsum("thn,hnc->htc", q_nope, w_uk)  # W_UK^T q, per head
    return scale * (q_latent @ c_kv.T + torch.einsum("thr,sr->hts", q_pe, k_pe))


def test_absorbed_score():
    assert verdict_of(ex.check_absorbed_score, absorbed).ok

    def content_only(q_nope, q_pe, c_kv, k_pe, w_uk, scale):
        return scale * torch.einsum("thn,hnc->htc", q_nope, w_uk) @ c_kv.T

    assert_fails_with(ex.check_absorbed_score, content_only, "left out the rotary part")
    assert_fails_with(ex.check_absorbed_score, lambda *a: absorbed(*a[:5], 1.0), "forgot the softmax scale")
    assert_fails_with(ex.check_absorbed_score, lambda *a: absorbed(*a).transpose(1, 2), "[H, S, T]")


# --- the router


def route(x, weight, bias, top_k, scaling, *, sigmoid=True, bias_in_choice=True, bias_in_weights=False,
          renormalise=True):
    logits = x @ weight.T
    s = logits.sigmoid() if sigmoid else logits.softmax(-1)
    idx = (s + bias if bias_in_choice else s).topk(top_k, dim=-1).indices
    w = (s + bias if bias_in_weights else s).gather(-1, idx)
    if renormalise:
        w = w / w.sum(-1, keepdim=True)
    return idx, w * scaling


def test_router():
    assert verdict_of(ex.check_router, route).ok
    reversed_slots = lambda *a: tuple(t.flip(-1) for t in route(*a))  # noqa: E731
    assert verdict_of(ex.check_router, reversed_slots).ok  # the order of the slots is free
    assert_fails_with(ex.check_router, lambda *a: route(*a, bias_in_choice=False), "chose by s alone")
    assert_fails_with(ex.check_router, lambda *a: route(*a, sigmoid=False), "softmax")
    assert_fails_with(ex.check_router, lambda *a: route(*a, bias_in_weights=True), "bias is in your weights")
    assert_fails_with(ex.check_router, lambda *a: route(*a, renormalise=False), "forgot to renormalise")
    assert_fails_with(ex.check_router, lambda *a: route(*a[:4], 1.0), "routed_scaling_factor")
    assert_fails_with(ex.check_router, lambda *a: route(*a)[0], "return two tensors")


# --- the block's parts


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def test_swiglu():
    assert verdict_of(ex.check_swiglu, swiglu).ok
    assert_fails_with(ex.check_swiglu, lambda x, g, u, d: swiglu(x, u, g, d), "SiLU to the up projection")
    assert_fails_with(ex.check_swiglu, lambda x, g, u, d: (F.relu(x @ g.T) * (x @ u.T)) @ d.T, "ReLU")
    assert_fails_with(ex.check_swiglu, lambda x, g, u, d: F.silu(x @ g.T) @ d.T, "left out the up projection")


def test_moe_combine():
    combine = lambda shared, out, w: shared + torch.einsum("nkd,nk->nd", out, w)  # noqa: E731
    assert verdict_of(ex.check_moe_combine, combine).ok
    assert_fails_with(ex.check_moe_combine, lambda s, o, w: combine(s, o, w) - s, "forgot the shared expert")
    assert_fails_with(ex.check_moe_combine, lambda s, o, w: s + o.sum(1), "forgot the weights")
    assert_fails_with(ex.check_moe_combine, lambda s, o, w: s + (o * w[..., None]).mean(1), "averaged")


def test_block():
    def block(x, norm1, attn, norm2, ffn):
        x = x + attn(norm1(x))
        return x + ffn(norm2(x))

    assert verdict_of(ex.check_block, block).ok

    def post_norm(x, norm1, attn, norm2, ffn):
        x = norm1(x + attn(x))
        return norm2(x + ffn(x))

    def parallel(x, norm1, attn, norm2, ffn):
        return x + attn(norm1(x)) + ffn(norm2(x))

    assert_fails_with(ex.check_block, post_norm, "post-norm")
    assert_fails_with(ex.check_block, parallel, "parallel block")
    assert_fails_with(ex.check_block, lambda x, n1, a, n2, f: block(x, n1, a, n1, f), "input_norm twice")


# --- MaxVio


def test_max_violation():
    def max_vio(counts):
        c = counts.double()
        return c.amax(-1) / c.mean(-1) - 1

    assert verdict_of(ex.check_max_violation, max_vio).ok
    assert_fails_with(ex.check_max_violation, lambda c: max_vio(c) + 1, "forgot the - 1")
    assert_fails_with(ex.check_max_violation, lambda c: 100 * max_vio(c), "percentage")
    assert_fails_with(ex.check_max_violation, lambda c: max_vio(c.T), "wrong dimension")


# --- direct logit attribution


def test_logit_attribution():
    def dla(c, x_final, g, u, eps):
        return float((u * g * c).sum() / torch.sqrt(x_final.pow(2).mean() + eps))

    assert verdict_of(ex.check_logit_attribution, dla).ok
    assert_fails_with(ex.check_logit_attribution, lambda c, x, g, u, eps: float((u * g * c).sum()), "rms(x_L)")
    own = lambda c, x, g, u, eps: dla(c, c, g, u, eps)  # noqa: E731
    assert_fails_with(ex.check_logit_attribution, own, "term's own rms")


# --- patching, KV-cache bytes, logit lens, bias update, BPE, greedy


def test_patch_hook():
    def patched(act, source, positions):
        out = act.clone()
        out[:, positions] = source[:, positions]
        return out

    def in_place(act, source, positions):
        act[:, positions] = source[:, positions]
        return act

    assert verdict_of(ex.check_patch_hook, patched).ok
    assert_fails_with(ex.check_patch_hook, in_place, "in place")
    assert_fails_with(ex.check_patch_hook, lambda a, s, p: s.clone(), "every position")


def test_kv_cache_bytes():
    def latent(cfg: K2Config, tokens: int) -> int:
        return tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * cfg.num_hidden_layers

    assert verdict_of(ex.check_kv_cache_bytes, latent).ok
    assert_fails_with(ex.check_kv_cache_bytes, lambda c, n: latent(c, n) // c.num_hidden_layers, "one layer")
    assert_fails_with(ex.check_kv_cache_bytes, lambda c, n: 2 * latent(c, n), "bfloat16")
    assert_fails_with(ex.check_kv_cache_bytes, lambda c, n: n * c.kv_lora_rank * 2 * c.num_hidden_layers, "rotary")


def test_logit_lens():
    assert verdict_of(ex.check_logit_lens, lambda r, norm, head: head(norm(r)).float()).ok
    assert_fails_with(ex.check_logit_lens, lambda r, norm, head: head(r), "forgot the final norm")


def test_bias_update():
    update = lambda b, c, u: b + u * torch.sign(c.mean(-1, keepdim=True) - c)  # noqa: E731
    assert verdict_of(ex.check_bias_update, update).ok
    assert_fails_with(ex.check_bias_update, lambda b, c, u: b - u * torch.sign(c.mean(-1, keepdim=True) - c),
                      "wrong sign")
    assert_fails_with(ex.check_bias_update, lambda b, c, u: b + u * (c.mean(-1, keepdim=True) - c), "SIGN")


def test_bpe():
    def bpe(ranks, piece):
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while True:
            pairs = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                     if parts[i] + parts[i + 1] in ranks]
            if not pairs:
                return parts
            _, i = min(pairs)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]

    def first_pair(ranks, piece):
        parts = [piece[i:i + 1] for i in range(len(piece))]
        i = 0
        while i < len(parts) - 1:
            if parts[i] + parts[i + 1] in ranks:
                parts[i:i + 2] = [parts[i] + parts[i + 1]]
                i = 0
            else:
                i += 1
        return parts

    assert verdict_of(ex.check_bpe, bpe).ok
    assert_fails_with(ex.check_bpe, first_pair, "LOWEST rank")
    assert_fails_with(ex.check_bpe, lambda r, p: [x.decode() for x in bpe(r, p)], "not str")


@pytest.fixture(scope="module")
def tiny_model():
    from k2lab import K2Model

    model = K2Model(K2Config.mini().replace(num_hidden_layers=2, vocab_size=64, bos_token_id=None,
                                            eos_token_id=None))
    model.init_weights(std=0.2, seed=0)
    return model.eval()


def test_greedy(tiny_model):
    ids = torch.tensor([[1, 2, 3, 4]])

    def greedy(model, ids, n):
        for _ in range(n):
            next_id = model(ids)[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            ids = torch.cat([ids, next_id], dim=1)
        return ids

    with torch.no_grad():
        assert verdict_of(ex.check_greedy, greedy, tiny_model, ids).ok
        assert_fails_with(ex.check_greedy, lambda m, i, n: greedy(m, i, n)[:, i.shape[1]:], "only the new tokens",
                          tiny_model, ids)
