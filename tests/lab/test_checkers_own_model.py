"""The checkers of the exercises in which the learner builds, loads, decodes and trains their own K2 (issue #50):
group-limited routing (04a), FP8 dequantisation and the release as a state dict (08), MLA over the learner's own
cache and greedy generation with it (09), the next-token loss, AdamW's and Muon's steps and the training step (10).

Each right answer is written here from the exercise's definition, independently of k2lab; each wrong answer is a
small variation of it, written the way a learner would, and must fail WITH ITS REASON."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from learner import fails_with, passes

from k2lab import K2Config, K2Model
from k2lab.lab import exercises as ex

# --- 04a: group-limited routing ---------------------------------------------------------------------------------------


def group_router(s, bias, top_k, n_group, topk_group, *, score="top2", groups_by="choice", experts_by="choice",
                 strided=False, use_groups=True):
    """DeepSeek-V3's rule from its definition, with a switch for each mistake."""
    choice = s + bias
    N, E = s.shape
    size = E // n_group
    grouping = {"choice": choice, "s": s}[groups_by]
    members = torch.arange(E).view(size, n_group).T if strided else torch.arange(E).view(n_group, size)  # [G, E/G]
    grouped = grouping[:, members]  # [N, G, E/G]
    group_score = {"top2": grouped.topk(2, -1).values.sum(-1), "max": grouped.amax(-1), "all": grouped.sum(-1)}[score]
    kept = group_score.topk(topk_group, -1).indices  # [N, topk_group]
    allowed = torch.zeros(N, E, dtype=torch.bool)
    for row in range(N):
        allowed[row, members[kept[row]].flatten()] = True
    ranking = {"choice": choice, "s": s}[experts_by]
    if use_groups:
        ranking = ranking.masked_fill(~allowed, -math.inf)
    return ranking.topk(top_k, -1).indices


GROUP_MISTAKES = {
    "TWO best choice scores, not its best one": dict(score="max"),
    "two best choice scores, not of all its experts": dict(score="all"),
    "the groups are scored with the bias too": dict(groups_by="s"),
    "you left out the correction bias": dict(groups_by="s", experts_by="s"),
    "you chose the experts by s alone": dict(experts_by="s"),
    "CONSECUTIVE experts": dict(strided=True),
    "you ignored the groups": dict(use_groups=False),
}


def test_group_router_right_answers_pass():
    passes(ex.check_group_router(group_router))
    passes(ex.check_group_router(lambda *a: group_router(*a).flip(-1)))  # any order of the k slots


@pytest.mark.parametrize("reason", GROUP_MISTAKES)
def test_group_router_mistakes(reason):
    fails_with(ex.check_group_router(lambda *a: group_router(*a, **GROUP_MISTAKES[reason])), reason)


def test_group_router_returns_indices():
    fails_with(ex.check_group_router(lambda s, b, k, g, t: (s + b).topk(k, -1).values), "expert indices")
    fails_with(ex.check_group_router(lambda s, b, k, g, t: group_router(s, b, k, g, t)[:, :1]), "idx [N, k]")


# --- 08: FP8 dequantisation ---------------------------------------------------------------------------------------


def dequantize(weight, scale_inv, *, op="mul", spread="blocks", decode="float", dtype=torch.float32):
    A, B = weight.shape
    values = weight.float() if decode == "float" else weight.view(torch.uint8).float()
    if spread == "blocks":
        scales = scale_inv.repeat_interleave(128, 0)[:A].repeat_interleave(128, 1)[:, :B]
    elif spread == "tiled":
        scales = scale_inv.repeat(128, 128)[:A, :B]
    elif spread == "first":
        scales = scale_inv[0, 0]
    else:
        scales = torch.ones(())
    out = values * scales if op == "mul" else values / scales
    return out.to(dtype).float()


DEQUANT_MISTAKES = {
    "weight_scale_inv is MULTIPLIED": dict(op="div"),
    "you forgot the scales": dict(spread="none"),
    "as integers (a uint8 view)": dict(decode="uint8"),
    "repeat the whole grid": dict(spread="tiled"),
    "you rounded to bfloat16": dict(dtype=torch.bfloat16),
    "the first block's scale for every block": dict(spread="first"),
}


def test_dequantize_right_answer_passes():
    passes(ex.check_dequantize(dequantize))


@pytest.mark.parametrize("reason", DEQUANT_MISTAKES)
def test_dequantize_mistakes(reason):
    fails_with(ex.check_dequantize(lambda w, s: dequantize(w, s, **DEQUANT_MISTAKES[reason])), reason)


def test_dequantize_returning_e4m3_is_named():
    fails_with(ex.check_dequantize(lambda w, s: w), "you returned e4m3 values")


# --- 08: the release as a state dict ----------------------------------------------------------------------------


def release_to_state_dict(tensors, cfg, dtype, *, prefix=False, keep_scales=False, stack="number", axis=0,
                          scales=True, bias_dtype=torch.float32):
    def value(name):
        t = tensors[name].float()
        scale = tensors.get(name + "_scale_inv")
        if scale is not None and scales:
            t = dequantize(tensors[name], scale)
        return t.to(dtype)

    def key(name):
        return name if prefix else name.removeprefix("model.")

    out = {}
    for name in tensors:
        if ".mlp.experts." in name:
            continue
        if name.endswith("_scale_inv"):
            if keep_scales:
                out[key(name)] = tensors[name]
            continue
        out[key(name)] = tensors[name].to(bias_dtype) if name.endswith("correction_bias") else value(name)
    order = range(cfg.n_routed_experts)
    if stack == "names":  # as the names come: sorted as text
        order = sorted(order, key=str)
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                matrices = [value(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight") for e in order]
                if stack == "apart":
                    for e, m in zip(order, matrices, strict=True):
                        out[key(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight")] = m
                else:
                    out[key(f"model.layers.{i}.mlp.experts.{proj}")] = torch.stack(matrices, dim=axis)
    return out


RELEASE_MISTAKES = {
    "no leading `model.`": dict(prefix=True),
    "the scales are not weights of the model": dict(keep_scales=True),
    "sort as text (0, 1, 10, 11, 2": dict(stack="names"),
    "not one tensor per expert": dict(stack="apart"),
    "stacked along a new first axis": dict(axis=1),
    "you forgot the block scales": dict(scales=False),
    "the router's correction bias stays float32": dict(bias_dtype=torch.bfloat16),
}


def test_release_state_dict_right_answer_passes():
    passes(ex.check_release_state_dict(release_to_state_dict))


@pytest.mark.parametrize("reason", RELEASE_MISTAKES)
def test_release_state_dict_mistakes(reason):
    fails_with(ex.check_release_state_dict(
        lambda t, cfg, dtype: release_to_state_dict(t, cfg, dtype, **RELEASE_MISTAKES[reason])), reason)


def test_release_state_dict_ignoring_dtype_is_named():
    fails_with(ex.check_release_state_dict(lambda t, cfg, dtype: release_to_state_dict(t, cfg, torch.float32)),
               "asked for torch.bfloat16")


# --- 09: MLA over the learner's own cache ---------------------------------------------------------------------------


def rms(x, g, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def turn(x, cos, sin):
    x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # de-interleave, then rotate halves
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat([-b, a], -1) * sin


def cached_mla(w, cfg, hidden, cos, sin, cache, *, offset=True, mask=True, use_cache=True, rotate=True, norm=True,
               pe_first=False, keep="all", expand=False, scale=None):
    H, N, R, V, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    B, T, _ = hidden.shape
    eps = cfg.rms_norm_eps
    q = (rms(hidden @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], eps) @ w["q_b_proj.weight"].T)
    q = q.view(B, T, H, N + R)
    q_nope, q_pe = q[..., :N], turn(q[..., N:], cos[:, None], sin[:, None])
    kv_a = hidden @ w["kv_a_proj_with_mqa.weight"].T
    c_kv = rms(kv_a[..., :C], w["kv_a_layernorm.weight"], eps) if norm else kv_a[..., :C]
    stored_pe = kv_a[..., C:]
    k_pe = turn(stored_pe, cos, sin) if rotate else stored_pe.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    new = torch.cat([k_pe, c_kv] if pe_first else [c_kv, k_pe], -1)
    entries = torch.cat([cache, new], 1) if use_cache else new
    S = entries.shape[1]
    lat, kpe = (entries[..., R:], entries[..., :R]) if pe_first else (entries[..., :C], entries[..., C:])
    w_uk, w_uv = w["kv_b_proj.weight"].view(H, N + V, C).split([N, V], 1)
    if expand:  # the naive way: every head's keys and values from the whole cache
        k_nope = torch.einsum("bsc,hnc->bshn", lat, w_uk)
        v = torch.einsum("bsc,hvc->bshv", lat, w_uv)
        scores = torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum("bthr,bsr->bhts", q_pe, kpe)
    else:
        query = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w_uk), q_pe], -1)
        scores = torch.einsum("bthc,bsc->bhts", query, torch.cat([lat, kpe], -1))
    scores = scores * (cfg.softmax_scale if scale is None else scale)
    if mask:
        visible = torch.ones(T, S, dtype=torch.bool).tril(S - T if offset else 0)
        scores = scores.masked_fill(~visible, -math.inf)
    p = scores.softmax(-1)
    if expand:
        z = torch.einsum("bhts,bshv->bthv", p, v)
    else:
        z = torch.einsum("bthc,hvc->bthv", torch.einsum("bhts,bsc->bthc", p, lat), w_uv)
    out = z.flatten(2) @ w["o_proj.weight"].T
    returned = {"all": entries, "old": cache, "new": new}[keep]
    return out, returned


CACHE_MISTAKES = {
    "your causal mask has no offset": dict(offset=False),
    "attend to each other's futures": dict(mask=False),
    "you ignored the cache": dict(use_cache=False, keep="new"),
    "k_pe AFTER its rotation": dict(rotate=False),
    "c_KV after kv_a_layernorm": dict(norm=False),
    "you put k_pe first": dict(pe_first=True),
    "without the new tokens": dict(keep="old"),
    "only the new tokens' entries": dict(keep="new"),
    "you expanded the cached latents": dict(expand=True),
}


def test_cached_mla_right_answer_passes():
    passes(ex.check_cached_mla(cached_mla))


@pytest.mark.parametrize("reason", CACHE_MISTAKES)
def test_cached_mla_mistakes(reason):
    fails_with(ex.check_cached_mla(lambda *a: cached_mla(*a, **CACHE_MISTAKES[reason])), reason)


def test_cached_mla_wide_scale_is_named():
    cfg = K2Config.nano().replace(kv_lora_rank=40)
    wide = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) ** -0.5 * cfg.yarn_mscale**2
    fails_with(ex.check_cached_mla(lambda *a: cached_mla(*a, scale=wide)), "the scale stays")


def test_cached_mla_must_return_two_tensors():
    fails_with(ex.check_cached_mla(lambda *a: cached_mla(*a)[0]), "return two tensors")


# --- 09: greedy generation with the learner's cache -----------------------------------------------------------------


@pytest.fixture(scope="module")
def small_model():
    model = ex.small_k2()
    return model, torch.tensor([[5, 17, 2, 88, 41, 9]])


def generate_with_cache(model, state_dict, ids, new_tokens, *, shift=0, recompute=False, new_only=False):
    """Greedy decoding through k2lab's LatentCache, step by step (independent of k2lab.generate's loop)."""
    model.load_state_dict(state_dict)
    cache = model.new_cache(ids.shape[0])
    logits = model(ids, cache=cache)
    out = ids
    for step in range(new_tokens):
        next_id = logits[:, -1:].argmax(-1)
        out = torch.cat([out, next_id], 1)
        if recompute:
            logits = model(out)
        else:
            if shift and step == 0:
                cache.length += shift  # the next token one position too far: the mistake of a wrong offset
            logits = model(next_id, cache=cache)
    return out[:, ids.shape[1]:] if new_only else out


def test_cached_generate_right_answer_passes(small_model):
    model, ids = small_model
    passes(ex.check_cached_generate(lambda sd, cfg, i, n: generate_with_cache(model, sd, i, n), model, ids))


def test_cached_generate_mistakes(small_model):
    model, ids = small_model
    check = lambda fn: ex.check_cached_generate(fn, model, ids)  # noqa: E731
    fails_with(check(lambda sd, cfg, i, n: generate_with_cache(model, sd, i, n, new_only=True)),
               "you returned only the new tokens")
    fails_with(check(lambda sd, cfg, i, n: generate_with_cache(model, sd, i, n, recompute=True)),
               "positions through the model at one step")
    noise = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
    wrong_model = {n: t + 3 * noise if n == "lm_head.weight" else t for n, t in model.state_dict().items()}
    fails_with(check(lambda sd, cfg, i, n: generate_with_cache(model, wrong_model, i, n)),
               "the prompt's last logits already differ")


def test_cached_generate_names_the_first_step_that_differs_with_both_tokens(small_model):
    model, ids = small_model
    from k2lab import generate

    expected = generate(model, ids, max_new_tokens=6)

    def wrong_after_step_two(sd, cfg, i, n):
        out = expected.clone()
        out[0, i.shape[1] + 2] = (out[0, i.shape[1] + 2] + 1) % cfg.vocab_size
        return out

    verdict = ex.check_cached_generate(wrong_after_step_two, model, ids, new_tokens=6)
    fails_with(verdict, "step 2 is the first that differs")
    assert f"(id {int(expected[0, ids.shape[1] + 2])})" in verdict.message
    fails_with(verdict, "the decode path is wrong")


# --- 10: the next-token loss ----------------------------------------------------------------------------------------


def next_token_loss(logits, ids, pad_id, *, shift=1, mask="both", mean="pairs", base=None, softmax=False,
                    detach=False):
    if softmax:
        logits = logits.softmax(-1)
    real = ids != pad_id
    if shift == 1:
        pred, target = logits[:, :-1], ids[:, 1:]
        scored = {"both": real[:, :-1] & real[:, 1:], "targets": real[:, 1:], "inputs": real[:, :-1],
                  "none": torch.ones_like(real[:, 1:])}[mask]
    elif shift == 0:
        pred, target, scored = logits, ids, real
    else:
        pred, target, scored = logits[:, 1:], ids[:, :-1], real[:, :-1] & real[:, 1:]
    per = F.cross_entropy(pred.flatten(0, 1), target.flatten(), reduction="none").view(target.shape) * scored
    if mean == "pairs":
        loss = per.sum() / scored.sum()
    elif mean == "all":
        loss = per.sum() / scored.numel()
    elif mean == "sum":
        loss = per.sum()
    else:  # each row's mean, then the rows'
        loss = (per.sum(1) / scored.sum(1)).mean()
    if base == 2:
        loss = loss / math.log(2)
    return loss.detach() if detach else loss


LOSS_MISTAKES = {
    "no shift": dict(shift=0),
    "the shift goes the other way": dict(shift=-1),
    "you counted the pads": dict(mask="none"),
    "you ignored pad targets only (ignore_index)": dict(mask="targets"),
    "prediction of the first pad": dict(mask="inputs"),
    "you divided by every position": dict(mean="all"),
    "you summed the losses": dict(mean="sum"),
    "you averaged each row": dict(mean="rows"),
    "that is in bits": dict(base=2),
    "you applied a softmax before cross_entropy": dict(softmax=True),
    "your loss carries no gradient": dict(detach=True),
}


def test_next_token_loss_right_answers_pass():
    passes(ex.check_next_token_loss(next_token_loss))
    passes(ex.check_next_token_loss(lambda lg, ids, pad: F.cross_entropy(  # the mask as targets set to ignore_index
        lg[:, :-1].flatten(0, 1), torch.where((ids[:, :-1] != pad) & (ids[:, 1:] != pad), ids[:, 1:], -100).flatten())))


@pytest.mark.parametrize("reason", LOSS_MISTAKES)
def test_next_token_loss_mistakes(reason):
    fails_with(ex.check_next_token_loss(lambda *a: next_token_loss(*a, **LOSS_MISTAKES[reason])), reason)


# --- 10: AdamW's step -----------------------------------------------------------------------------------------------


def adamw(p, grad, state, lr, wd, betas=(0.9, 0.95), eps=1e-8, *, correct=True, eps_inside=False, coupled=False,
          decay="decoupled", square=True, count=True, average=True, return_update=False):
    b1, b2 = betas
    g = grad + wd * p if coupled else grad
    state["t"] = state.get("t", 0) + (1 if count else 0)
    t = max(state["t"], 1)
    state["m"] = b1 * state.get("m", 0) + ((1 - b1) if average else 1) * g
    state["v"] = b2 * state.get("v", 0) + (1 - b2) * (g * g if square else g.abs())
    m_hat, v_hat = (state["m"] / (1 - b1**t), state["v"] / (1 - b2**t)) if correct else (state["m"], state["v"])
    update = m_hat / ((v_hat + eps).sqrt() if eps_inside else v_hat.sqrt() + eps)
    if return_update:
        return update
    shrink = {"decoupled": 1 - lr * wd, "no lr": 1 - wd, "none": 1.0}["none" if coupled else decay]
    return p * shrink - lr * update


ADAMW_MISTAKES = {
    "you forgot the bias correction": dict(correct=False),
    "eps goes outside the square root": dict(eps_inside=True),
    "Adam with L2, coupled": dict(coupled=True),
    "you forgot the weight decay": dict(decay="none"),
    "not p (1 − wd)": dict(decay="no lr"),
    "not |g|": dict(square=False),
    "your step count does not advance": dict(count=False),
    "not β1 m + g": dict(average=False),
    "your defaults are torch's (0.9, 0.999)": dict(),
    "you returned the update": dict(return_update=True),
}


def test_adamw_step_right_answer_passes():
    passes(ex.check_adamw_step(adamw))


@pytest.mark.parametrize("reason", ADAMW_MISTAKES)
def test_adamw_step_mistakes(reason):
    switches = ADAMW_MISTAKES[reason]
    if "torch's" in reason:
        fn = lambda p, g, s, lr, wd, betas=(0.9, 0.999), eps=1e-8: adamw(p, g, s, lr, wd, betas, eps)  # noqa: E731
    else:
        fn = lambda p, g, s, lr, wd, betas=(0.9, 0.95), eps=1e-8: adamw(p, g, s, lr, wd, betas, eps, **switches)  # noqa: E731
    fails_with(ex.check_adamw_step(fn), reason)


# --- 10: Muon's step ------------------------------------------------------------------------------------------------


def newton_schulz(G, steps, dtype=torch.float32):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = (G / (G.norm() + 1e-7)).to(dtype)
    tall = G.shape[0] > G.shape[1]
    X = X.T if tall else X
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return (X.T if tall else X).float()


def muon(p, grad, state, lr, wd, momentum=0.95, *, nesterov=True, ema=False, factor="max", decay="decoupled",
         keep=True, use_momentum=True, flatten=False, ns_dtype=torch.float32):
    A, B = p.shape[-2:]
    g = grad + wd * p if decay == "coupled" else grad
    buf = momentum * state.get("b", torch.zeros_like(p)) + ((1 - momentum) if ema else 1) * g
    if keep:
        state["b"] = buf
    direction = (g + momentum * buf if nesterov else buf) if use_momentum else g
    if flatten:
        ortho = newton_schulz(direction.reshape(-1, B), 5, ns_dtype).view_as(p)
    else:
        ortho = torch.stack([newton_schulz(m, 5, ns_dtype) for m in direction.reshape(-1, A, B)]).view_as(p)
    scale = {"max": 0.2 * math.sqrt(max(A, B)), "min": 0.2 * math.sqrt(min(A, B)), "none": 1.0,
             "no 0.2": math.sqrt(max(A, B)), "product": 0.2 * math.sqrt(A * B)}[factor]
    shrink = {"decoupled": 1 - lr * wd, "no lr": 1 - wd, "none": 1.0, "coupled": 1.0}[decay]
    return p * shrink - lr * scale * ortho


MUON_MISTAKES = {
    "Nesterov: orthogonalise g + μ b": dict(nesterov=False),
    "not the average μ b + (1 − μ) g": dict(ema=True),
    "you forgot the RMS matching": dict(factor="none"),
    "the LARGER side, not the smaller": dict(factor="min"),
    "you left out the 0.2": dict(factor="no 0.2"),
    "not 0.2·√(A·B)": dict(factor="product"),
    "Muon's decay is decoupled": dict(decay="coupled"),
    "you forgot the weight decay": dict(decay="none"),
    "not p (1 − wd)": dict(decay="no lr"),
    "the momentum buffer does not last": dict(keep=False),
    "you orthogonalised the raw gradient (or a buffer that starts afresh": dict(use_momentum=False),
    "not the stack flattened to one matrix": dict(flatten=True),
}


def test_muon_step_right_answers_pass_newton_schulz_in_bfloat16_included():
    passes(ex.check_muon_step(muon))
    passes(ex.check_muon_step(lambda *a: muon(*a, ns_dtype=torch.bfloat16)))


@pytest.mark.parametrize("reason", MUON_MISTAKES)
def test_muon_step_mistakes(reason):
    fails_with(ex.check_muon_step(lambda *a: muon(*a, **MUON_MISTAKES[reason])), reason)


# --- 10: the training step ------------------------------------------------------------------------------------------


def train_step(params, opt_state, batch, cfg, lr, tau, bias_step, pad_id, *, all_adamw=False, muon_ends=False,
               decay_norms=False, embed_scale=10.0, clip=True, balance=True):
    """K2's recipe on a state dict, written here with k2lab's K2Model as the forward (a learner's my_k2 that is
    right computes the same) and the rules of the exercise; the switches make the usual mistakes."""
    model = K2Model(cfg, device="meta")
    counts, max_logits = [], []
    with torch.enable_grad():
        leaves = {n: t.detach().requires_grad_() for n, t in params.items() if not n.endswith("correction_bias")}
        hooks = [(lambda n: n.endswith("hook_max_logit"), lambda t, hook: max_logits.append(t.amax(0))),
                 (lambda n: n.endswith("hook_topk_idx"),
                  lambda t, hook: counts.append(torch.bincount(t.flatten(), minlength=cfg.n_routed_experts)))]
        with model.hooks(fwd_hooks=hooks):
            loss = torch.func.functional_call(model, {**params, **leaves}, (batch,), {"return_type": "loss"})
        grads = torch.autograd.grad(loss, list(leaves.values()))
    for (name, p), g in zip(leaves.items(), grads, strict=True):
        state = opt_state.setdefault(name, {})
        ends = name in ("embed_tokens.weight", "lm_head.weight")
        if p.dim() >= 2 and not all_adamw and (muon_ends or not ends):
            params[name] = muon(p.detach(), g, state, lr, 0.1)
        else:
            scale = embed_scale if name == "embed_tokens.weight" else 1.0
            wd = 0.1 if p.dim() >= 2 or decay_norms else 0.0
            params[name] = adamw(p.detach(), g, state, lr * scale, wd)
    maxes = torch.stack(max_logits)  # [L, H]
    if clip:
        H, N, R, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        gamma = (tau / maxes).clamp(max=1.0)
        for layer in range(cfg.num_hidden_layers):
            q = params[f"layers.{layer}.self_attn.q_b_proj.weight"].clone().view(H, N + R, -1)
            kv = params[f"layers.{layer}.self_attn.kv_b_proj.weight"].clone().view(H, N + V, -1)
            q[:, :N] *= gamma[layer].sqrt()[:, None, None]
            q[:, N:] *= gamma[layer][:, None, None]
            kv[:, :N] *= gamma[layer].sqrt()[:, None, None]
            params[f"layers.{layer}.self_attn.q_b_proj.weight"] = q.flatten(0, 1)
            params[f"layers.{layer}.self_attn.kv_b_proj.weight"] = kv.flatten(0, 1)
    if balance:
        names = [n for n in params if n.endswith("correction_bias")]
        for name, c in zip(names, counts, strict=True):
            c = c.float()
            params[name] = params[name] + bias_step * torch.sign(c.mean() - c)
    return loss.detach(), maxes


TRAIN_MISTAKES = {
    "you stepped every weight with AdamW": dict(all_adamw=True),
    "the embedding and the head step with AdamW, not Muon": dict(muon_ends=True),
    "the norms' weights take no weight decay": dict(decay_norms=True),
    "the embedding steps at 10 x lr": dict(embed_scale=1.0),
    "QK-Clip did not act": dict(clip=False),
    "the correction biases did not move": dict(balance=False),
}


def test_train_step_right_answer_passes():
    passes(ex.check_train_step(train_step))


@pytest.mark.parametrize("reason", TRAIN_MISTAKES)
def test_train_step_mistakes(reason):
    fails_with(ex.check_train_step(lambda *a: train_step(*a, **TRAIN_MISTAKES[reason])), reason)


def test_train_step_with_a_wrong_loss_is_told_before_any_update():
    def doubled_loss(*a):
        loss, maxes = train_step(*a)
        return loss * 2, maxes

    fails_with(ex.check_train_step(doubled_loss), "before any update")


# --- 10: a run beside k2lab's ---------------------------------------------------------------------------------------


def test_compare_runs_says_how_close_and_why():
    k2lab_losses = [9.0 - 0.02 * i for i in range(100)]
    close = [x + (1e-5 if i < 30 else 0.01) for i, x in enumerate(k2lab_losses)]
    verdict = ex.compare_runs(close, k2lab_losses, name="the test's run")
    passes(verdict)
    assert "for the first 30 steps" in verdict.message and "near a tie" in verdict.message
    fails_with(ex.compare_runs([x + 0.5 for x in k2lab_losses], k2lab_losses), "check_train_step names which")
    fails_with(ex.compare_runs([*k2lab_losses[:-1], float("nan")], k2lab_losses), "NaN or infinite at step 99")
    fails_with(ex.compare_runs(k2lab_losses[:10], k2lab_losses), "the same steps")
