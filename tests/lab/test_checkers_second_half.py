"""The second half of the course's checkers (04a to 10) against the wrong answers learners give (issue #39).

Each wrong answer is a small function written the way a learner would write it; each must fail WITH ITS REASON,
while the right answer (and an equivalent one written differently) passes. tests/lab/test_checkers_wrong_answers.py
covers the first half and the four answers a review saw pass; this file covers every mistake the second half's
checkers name, so that the closing note of the course can list them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from learner import fails_with, passes

from k2lab.lab import exercises as ex
from k2lab.lab.exercises.analysis import check_moe_block_parameters

# --- 04a: the router ----------------------------------------------------------------------------------------------


def route(x, weight, bias, top_k, scaling, *, scores="sigmoid", choose_by="s + bias", weights_from="s",
          renormalise=True, scale=True, lowest=False):
    logits = x @ weight.T
    s = logits.sigmoid() if scores == "sigmoid" else logits.softmax(-1)
    choice = {"s + bias": s + bias, "s": s, "logits + bias": logits + bias}[choose_by]
    idx = choice.topk(top_k, dim=-1, largest=not lowest).indices
    w = {"s": s, "s + bias": s + bias, "logits": logits}[weights_from].gather(-1, idx)
    if renormalise:
        w = w / w.sum(-1, keepdim=True)
    return idx, w * scaling if scale else w


ROUTER_MISTAKES = {
    "chose by s alone": dict(choose_by="s"),
    "added the bias to the logits": dict(choose_by="logits + bias"),
    "k LOWEST choice scores": dict(lowest=True),
    "softmax(logits) + bias": dict(scores="softmax"),
    "the bias is in your weights": dict(weights_from="s + bias"),
    "forgot to renormalise": dict(renormalise=False),
    "forgot the routed_scaling_factor": dict(scale=False),
    "weights are the raw logits": dict(weights_from="logits", renormalise=False, scale=False),
}


def test_router_right_answers_pass_in_any_slot_order_and_index_dtype():
    passes(ex.check_router(route))
    passes(ex.check_router(lambda *a: tuple(t.flip(-1) for t in route(*a))))
    passes(ex.check_router(lambda *a: (route(*a)[0].int(), route(*a)[1])))


@pytest.mark.parametrize("reason", ROUTER_MISTAKES)
def test_router_mistakes_each_get_their_reason(reason):
    fails_with(ex.check_router(lambda *a: route(*a, **ROUTER_MISTAKES[reason])), reason)


def test_router_returns_two_tensors():
    fails_with(ex.check_router(lambda *a: route(*a)[0]), "return two tensors")
    fails_with(ex.check_router(lambda *a: (route(*a)[0], None)), "is None")


# --- 04b: the block's pieces --------------------------------------------------------------------------------------


def rms_norm(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


RMS_MISTAKES = {
    "forgot the eps": lambda x, w, eps: w * x / x.pow(2).mean(-1, keepdim=True).sqrt(),
    "eps goes inside the square root": lambda x, w, eps: w * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps),
    "forgot the weight g": lambda x, w, eps: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps),
    "that is LayerNorm": lambda x, w, eps: w * F.layer_norm(x, x.shape[-1:], eps=eps),
    "divided by the mean square": lambda x, w, eps: w * x / (x.pow(2).mean(-1, keepdim=True) + eps),
    "sum of squares": lambda x, w, eps: w * x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps),
    "multiplied by the rms": lambda x, w, eps: w * x * torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps),
    "wrong dimension": lambda x, w, eps: w * x / torch.sqrt(x.pow(2).mean(0, keepdim=True) + eps),
}


@pytest.mark.parametrize("reason", RMS_MISTAKES)
def test_rms_norm_mistakes(reason):
    passes(ex.check_rms_norm(rms_norm))
    passes(ex.check_rms_norm(lambda x, w, eps: F.rms_norm(x, x.shape[-1:], w, eps)))
    fails_with(ex.check_rms_norm(RMS_MISTAKES[reason]), reason)


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


SWIGLU_MISTAKES = {
    "SiLU to the up projection": lambda x, g, u, d: swiglu(x, u, g, d),
    "ReLU instead of SiLU": lambda x, g, u, d: (F.relu(x @ g.T) * (x @ u.T)) @ d.T,
    "sigmoid instead of SiLU": lambda x, g, u, d: ((x @ g.T).sigmoid() * (x @ u.T)) @ d.T,
    "GELU instead of SiLU": lambda x, g, u, d: (F.gelu(x @ g.T) * (x @ u.T)) @ d.T,
    "left out the up projection": lambda x, g, u, d: F.silu(x @ g.T) @ d.T,
}


@pytest.mark.parametrize("reason", SWIGLU_MISTAKES)
def test_swiglu_mistakes(reason):
    passes(ex.check_swiglu(swiglu))
    fails_with(ex.check_swiglu(SWIGLU_MISTAKES[reason]), reason)


COMBINE_MISTAKES = {
    "forgot the shared expert": lambda s, o, w: (o * w[..., None]).sum(1),
    "forgot the weights": lambda s, o, w: s + o.sum(1),
    "averaged the slots": lambda s, o, w: s + (o * w[..., None]).mean(1),
    "renormalised the weights": lambda s, o, w: s + (o * (w / w.sum(-1, keepdim=True))[..., None]).sum(1),
}


@pytest.mark.parametrize("reason", COMBINE_MISTAKES)
def test_moe_combine_mistakes(reason):
    passes(ex.check_moe_combine(lambda s, o, w: s + torch.einsum("nkd,nk->nd", o, w)))
    fails_with(ex.check_moe_combine(COMBINE_MISTAKES[reason]), reason)


def block(x, n1, attn, n2, ffn):
    x = x + attn(n1(x))
    return x + ffn(n2(x))


BLOCK_MISTAKES = {
    "post-norm": lambda x, n1, a, n2, f: n2(n1(x + a(x)) + f(n1(x + a(x)))),
    "forgot the first residual": lambda x, n1, a, n2, f: a(n1(x)) + f(n2(a(n1(x)))),
    "forgot the second residual": lambda x, n1, a, n2, f: f(n2(x + a(n1(x)))),
    "parallel block": lambda x, n1, a, n2, f: x + a(n1(x)) + f(n2(x)),
    "wrote the normalised stream back": lambda x, n1, a, n2, f: block(n1(x), lambda t: t, a, n2, f),
    "input_norm twice": lambda x, n1, a, n2, f: block(x, n1, a, n1, f),
    "forgot the norms": lambda x, n1, a, n2, f: block(x, lambda t: t, a, lambda t: t, f),
    "attention reads x itself": lambda x, n1, a, n2, f: block(x, lambda t: t, a, n2, f),
    "the FFN reads the stream itself": lambda x, n1, a, n2, f: block(x, n1, a, lambda t: t, f),
}


@pytest.mark.parametrize("reason", BLOCK_MISTAKES)
def test_block_mistakes(reason):
    passes(ex.check_block(block))
    fails_with(ex.check_block(BLOCK_MISTAKES[reason]), reason)


# --- 05: MaxVio ---------------------------------------------------------------------------------------------------


def max_vio(counts):
    c = counts.double()
    return c.amax(-1) / c.mean(-1) - 1


MAXVIO_MISTAKES = {
    "forgot the - 1": lambda c: max_vio(c) + 1,
    "percentage": lambda c: 100 * max_vio(c),
    "divided by the total": lambda c: c.double().amax(-1) / c.double().sum(-1) - 1,
    "is a spread": lambda c: (c.double().amax(-1) - c.double().amin(-1)) / c.double().mean(-1),
    "coefficient of variation": lambda c: c.double().std(-1) / c.double().mean(-1),
    "wrong dimension": lambda c: max_vio(c.T),
}


@pytest.mark.parametrize("reason", MAXVIO_MISTAKES)
def test_max_violation_mistakes(reason):
    passes(ex.check_max_violation(max_vio))
    fails_with(ex.check_max_violation(MAXVIO_MISTAKES[reason]), reason)


def test_max_violation_of_integers_is_refused_by_torch_with_a_reason():
    fails_with(ex.check_max_violation(lambda c: c.amax(-1) / c.mean(-1) - 1), "raised RuntimeError")


# --- 06: direct logit attribution ---------------------------------------------------------------------------------


def dla(c, x, g, u, eps):
    return float((u * g * c).sum() / torch.sqrt(x.pow(2).mean() + eps))


DLA_MISTAKES = {
    "forgot to divide by rms(x_L)": lambda c, x, g, u, eps: float((u * g * c).sum()),
    "forgot the eps": lambda c, x, g, u, eps: float((u * g * c).sum() / x.pow(2).mean().sqrt()),
    "eps goes inside the square root":
        lambda c, x, g, u, eps: float((u * g * c).sum() / (x.pow(2).mean().sqrt() + eps)),
    "term's own rms": lambda c, x, g, u, eps: dla(c, c, g, u, eps),
    "forgot the norm's weight g": lambda c, x, g, u, eps: float((u * c).sum() / torch.sqrt(x.pow(2).mean() + eps)),
}


@pytest.mark.parametrize("reason", DLA_MISTAKES)
def test_logit_attribution_mistakes(reason):
    passes(ex.check_logit_attribution(dla))
    fails_with(ex.check_logit_attribution(DLA_MISTAKES[reason]), reason)


# --- 07: a patching hook ------------------------------------------------------------------------------------------


def patched(act, source, positions):
    out = act.clone()
    out[:, positions] = source[:, positions]
    return out


def in_place(act, source, positions):
    act[:, positions] = source[:, positions]
    return act


def others(act, source, positions):
    out = source.clone()
    out[:, positions] = act[:, positions]
    return out


def batch_axis(act, source, positions):
    out = act.clone()
    out[positions[0]] = source[positions[0]]
    return out


@pytest.mark.parametrize(("wrong", "reason"), [(in_place, "in place"), (lambda a, s, p: s.clone(), "every position;"),
                                               (others, "every position but the given ones"),
                                               (batch_axis, "indexed the batch axis")])
def test_patch_hook_mistakes(wrong, reason):
    passes(ex.check_patch_hook(patched))
    fails_with(ex.check_patch_hook(wrong), reason)


# --- 08: one MoE block's parameters -------------------------------------------------------------------------------


def moe_block(cfg, *, bias=True, norms=True, latent_norms=True, k_pe=True, all_experts=True, three=True,
              shared=True, every_shared=True, latent_query=None):
    D, H, N, R, V = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                     cfg.v_head_dim)
    C, Q, E, I, S = (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.n_routed_experts, cfg.moe_intermediate_size,
                     cfg.n_shared_experts)
    latent = Q is not None if latent_query is None else latent_query
    query = D * Q + Q * latent_norms + Q * H * (N + R) if latent else D * H * (N + R)
    attention = query + D * (C + R * k_pe) + C * latent_norms + C * H * (N + V) + H * V * D
    experts = (E if all_experts else cfg.num_experts_per_tok) * (3 if three else 2) * D * I
    shared_experts = (S if every_shared else 1) * (3 if three else 2) * D * I * shared
    return 2 * D * norms + attention + E * D + E * bias + experts + shared_experts


MOE_BLOCK_MISTAKES = {
    "forgot the correction bias": dict(bias=False),
    "two RMSNorms": dict(norms=False),
    "latent norms": dict(latent_norms=False),
    "forgot the shared rotary key": dict(k_pe=False),
    "only the k experts": dict(all_experts=False),
    "three matrices": dict(three=False),
    "forgot the shared expert": dict(shared=False),
    "count every shared expert": dict(every_shared=False),
    "K2 has a query latent": dict(latent_query=False),
}


@pytest.mark.parametrize("reason", MOE_BLOCK_MISTAKES)
def test_moe_block_parameters_mistakes(reason):
    passes(check_moe_block_parameters(moe_block))
    passes(check_moe_block_parameters(lambda cfg: float(moe_block(cfg))))  # 1.7e10 as a float is still exact
    fails_with(check_moe_block_parameters(lambda cfg: moe_block(cfg, **MOE_BLOCK_MISTAKES[reason])), reason)


def test_moe_block_parameters_without_a_query_latent():
    def assumes_a_latent(cfg):
        return moe_block(cfg) if cfg.q_lora_rank is not None else cfg.hidden_size * cfg.q_lora_rank

    fails_with(check_moe_block_parameters(assumes_a_latent), "no query latent")
    fails_with(check_moe_block_parameters(lambda cfg: str(moe_block(cfg))), "return the count as an int")


# --- 09: the logit lens -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("wrong", "reason"), [(lambda r, n, h: h(r), "forgot the final norm"),
                                               (lambda r, n, h: h(n(r)).softmax(-1), "probabilities"),
                                               (lambda r, n, h: h(n(r)).log_softmax(-1), "log-probabilities")])
def test_logit_lens_mistakes(wrong, reason):
    passes(ex.check_logit_lens(lambda r, n, h: h(n(r)).float()))
    fails_with(ex.check_logit_lens(wrong), reason)


# --- 09: the whole model from its weights -------------------------------------------------------------------------


def rotations(cfg, T, yarn=True):
    R = cfg.qk_rope_head_dim
    inv_freq = (1.0 / cfg.rope_theta ** (torch.arange(0, R, 2).float() / R)) if not yarn else None
    if yarn:
        from k2lab.model.rope import inverse_frequencies

        inv_freq = inverse_frequencies(cfg)
    angles = torch.arange(T).float()[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def mla(w, cfg, x, cos, sin):
    from k2lab.model.attention import MultiHeadLatentAttention

    attn = MultiHeadLatentAttention(cfg)
    attn.load_state_dict(w)
    return attn(x, cos, sin, attn_impl="naive")


def k2(sd, cfg, ids, *, router=route, shared=True, final_norm=True, tied=False, yarn=True):
    eps, (cos, sin) = cfg.rms_norm_eps, rotations(cfg, ids.shape[1], yarn)
    x = sd["embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        attn_w = {n.removeprefix(p + "self_attn."): t for n, t in sd.items() if n.startswith(p + "self_attn.")}
        x = x + mla(attn_w, cfg, rms_norm(x, sd[p + "input_layernorm.weight"], eps), cos, sin)
        h = rms_norm(x, sd[p + "post_attention_layernorm.weight"], eps)
        if i < cfg.first_k_dense_replace:
            x = x + swiglu(h, *(sd[p + f"mlp.{m}_proj.weight"] for m in ("gate", "up", "down")))
            continue
        flat = h.flatten(0, 1)
        idx, w = router(flat, sd[p + "mlp.gate.weight"], sd[p + "mlp.gate.e_score_correction_bias"],
                        cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        out = flat.new_zeros(*idx.shape, flat.shape[-1])
        for e in idx.unique().tolist():
            rows, slots = torch.where(idx == e)
            out[rows, slots] = swiglu(flat[rows], *(sd[p + f"mlp.experts.{m}_proj"][e] for m in ("gate", "up", "down")))
        moe = (w[..., None] * out).sum(1)
        if shared:
            moe = moe + swiglu(flat, *(sd[p + f"mlp.shared_experts.{m}_proj.weight"] for m in ("gate", "up", "down")))
        x = x + moe.view_as(h)
    x = rms_norm(x, sd["norm.weight"], eps) if final_norm else x
    return x @ (sd["embed_tokens.weight"] if tied else sd["lm_head.weight"]).T


MODEL_MISTAKES = {
    "tied the head": dict(tied=True),
    "forgot the final norm": dict(final_norm=False),
    "correction bias is in your expert weights": dict(router=lambda *a: route(*a, weights_from="s + bias")),
    "forgot routed_scaling_factor": dict(router=lambda *a: route(*a, scale=False)),
    "did not renormalise": dict(router=lambda *a: route(*a, renormalise=False)),
    "chose the experts by the sigmoid scores alone": dict(router=lambda *a: route(*a, choose_by="s")),
    "forgot the shared expert": dict(shared=False),
    "plain RoPE": dict(yarn=False),
}


@pytest.mark.parametrize("reason", MODEL_MISTAKES)
def test_model_from_weights_mistakes(reason):
    passes(ex.check_model_from_weights(k2))
    fails_with(ex.check_model_from_weights(lambda *a: k2(*a, **MODEL_MISTAKES[reason])), reason)


# --- 10: Newton-Schulz, QK-Clip, the bias step --------------------------------------------------------------------

A, B, C = 3.4445, -4.7750, 2.0315


def newton_schulz(G, steps, coeffs=(A, B, C), norm="fro", transpose=True, back=True, fixed_steps=None,
                  quintic=True):
    a, b, c = coeffs
    X = G / (torch.linalg.matrix_norm(G, ord=norm) + 1e-7) if norm else G
    tall = transpose and G.shape[0] > G.shape[1]
    X = X.T if tall else X
    for _ in range(steps if fixed_steps is None else fixed_steps):
        Am = X @ X.T
        X = a * X + (b * Am + c * Am @ Am) @ X if quintic else 1.5 * X - 0.5 * Am @ X
    return X.T if tall and back else X


def newton_schulz_right_gram(G, steps):
    """The same iteration written on the right, X (b A' + c A'^2) with A' = X^T X for a tall matrix: equal, and
    its Gram matrix is the small one too."""
    X = G / (G.norm() + 1e-7)
    for _ in range(steps):
        if X.shape[0] > X.shape[1]:
            Am = X.T @ X
            X = A * X + X @ (B * Am + C * Am @ Am)
        else:
            Am = X @ X.T
            X = A * X + (B * Am + C * Am @ Am) @ X
    return X


NS_MISTAKES = {
    "cubic iteration": dict(quintic=False),
    "did not normalise G": dict(norm=None),
    "spectral norm": dict(norm=2),
    "coefficients are in the wrong order": dict(coeffs=(C, B, A)),
    "did not transpose": dict(transpose=False),
    "not the result back": dict(back=False),
    "ignored `steps`": dict(fixed_steps=5),
}


@pytest.mark.parametrize("reason", NS_MISTAKES)
def test_newton_schulz_mistakes(reason):
    passes(ex.check_newton_schulz(newton_schulz))
    passes(ex.check_newton_schulz(newton_schulz_right_gram))
    passes(ex.check_newton_schulz(lambda g, n: newton_schulz(g.double(), n).float()))
    fails_with(ex.check_newton_schulz(lambda g, n: newton_schulz(g, n, **NS_MISTAKES[reason])), reason)


def test_newton_schulz_exact_svd_is_told_it_is_exact():
    def exact(g, steps):
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        return u @ vh

    fails_with(ex.check_newton_schulz(exact), "exact U V^T")


def qk_clip(head, max_logit, tau, **factors):
    gamma = min(1.0, tau / max_logit)
    rules = {"q_nope": gamma**0.5, "k_nope": gamma**0.5, "q_pe": gamma, "v": 1.0, "k_pe": 1.0}
    rules.update({part: f(gamma) for part, f in factors.items()})
    return {part: t * rules[part] for part, t in head.items()}


QK_MISTAKES = {
    "clipped a head whose max logit is not above tau": None,
    "scaled the shared rotary key": dict(k_pe=lambda g: g**0.5, q_pe=lambda g: g**0.5),
    "q_pe takes the whole gamma": dict(q_pe=lambda g: g**0.5),
    "gamma on both q_nope and k_nope": dict(q_nope=lambda g: g, k_nope=lambda g: g),
    "whole gamma on q_nope": dict(q_nope=lambda g: g, k_nope=lambda g: 1.0),
    "forgot the rotary part": dict(q_pe=lambda g: 1.0),
    "values are not clipped": dict(v=lambda g: g**0.5),
    "not max_logit / tau": dict(q_nope=lambda g: g**-0.5, k_nope=lambda g: g**-0.5, q_pe=lambda g: 1 / g),
    "nothing was clipped": dict(q_nope=lambda g: 1.0, k_nope=lambda g: 1.0, q_pe=lambda g: 1.0),
    "instead of q_pe": dict(q_pe=lambda g: 1.0, k_pe=lambda g: g),
}


@pytest.mark.parametrize("reason", QK_MISTAKES)
def test_qk_clip_mistakes(reason):
    passes(ex.check_qk_clip(qk_clip))
    if QK_MISTAKES[reason] is None:
        def wrong(head, max_logit, tau):
            g = tau / max_logit  # no min(1, .)
            return {p: t * {"q_nope": g**0.5, "k_nope": g**0.5, "q_pe": g}.get(p, 1.0) for p, t in head.items()}
    else:
        def wrong(head, max_logit, tau):
            return qk_clip(head, max_logit, tau, **QK_MISTAKES[reason])
    fails_with(ex.check_qk_clip(wrong), reason)


def test_qk_clip_shape_and_keys():
    fails_with(ex.check_qk_clip(lambda h, m, t: list(qk_clip(h, m, t).values())), "return a dict")
    fails_with(ex.check_qk_clip(lambda h, m, t: {p: v.T for p, v in qk_clip(h, m, t).items()}), "keeps its shape")


def bias_update(b, c, u):
    return b + u * torch.sign(c.mean(-1, keepdim=True) - c)


BIAS_MISTAKES = {
    "wrong sign": lambda b, c, u: b - u * torch.sign(c.mean(-1, keepdim=True) - c),
    "SIGN of the imbalance": lambda b, c, u: b + u * (c.mean(-1, keepdim=True) - c),
    "forgot u": lambda b, c, u: b + torch.sign(c.mean(-1, keepdim=True) - c),
    "returned the step": lambda b, c, u: u * torch.sign(c.mean(-1, keepdim=True) - c),
    "median load": lambda b, c, u: b + u * torch.sign(c.median(-1, keepdim=True).values - c),
    "exactly at the mean load keeps its bias": lambda b, c, u: b + torch.where(c > c.mean(-1, keepdim=True), -u, u),
    "averaged over the layers": lambda b, c, u: b + u * torch.sign(c.mean(0, keepdim=True) - c),
}


@pytest.mark.parametrize("reason", BIAS_MISTAKES)
def test_bias_update_mistakes(reason):
    passes(ex.check_bias_update(bias_update))
    fails_with(ex.check_bias_update(BIAS_MISTAKES[reason]), reason)
