"""03: multi-head latent attention. The absorbed score (``check_absorbed_score``) and MLA's whole forward from its
weights, naive or absorbed (``check_mla_forward``). The absorbed forms may not expand the latent into per-head keys
or values; a ``Watch`` sees whether they did."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import torch

from ...config import K2Config
from ...model import MultiHeadLatentAttention
from ...model.attention import apply_rotary, causal_mask
from ...model.rope import cos_sin_scale, inverse_frequencies
from .checking import Verdict, Watch, as_tensor, call, checker, compare, generator, gives, named

BUILT_KEYS = ("you built each head's keys k_nope = W_UK c_KV; the absorbed form never expands the latent: fold W_UK "
              "into the query, (W_UK^T q_nope) · c_KV")
BUILT_VALUES = ("you expanded each head's values W_UV c_KV; the absorbed form attends over c_KV itself and applies "
                "W_UV to the output")


def _einsum_order() -> str:
    """What to say when torch built the keys inside one many-operand einsum, for the einsum this torch runs."""
    if torch.backends.opt_einsum.enabled and torch.backends.opt_einsum.is_available():
        how = "opt_einsum (installed here) picks the cheapest order, and that is this one: write two einsums"
    else:
        how = ("torch contracts an einsum's operands from the left: put q_nope and W_UK first, or write two "
               "einsums")
    return (f"torch contracted c_KV with W_UK first inside your einsum, which builds every head's keys: a "
            f"three-operand einsum is done two operands at a time; {how} (W_UK^T q_nope first, then with c_KV)")


def _forbidden_expansion(watch: Watch, what: str) -> Verdict | None:
    """A verdict when the learner's absorbed code built per-head keys or values (saying so when torch built them
    inside one einsum)."""
    for message in (BUILT_KEYS, BUILT_VALUES):
        if message in watch.found:
            if message == BUILT_KEYS and (watch.inside.get(message) or "").startswith("einsum of ") and \
                    watch.inside[message] != "einsum of 2":
                return named(_einsum_order(), what)
            return named(message, what)
    return None


# --- the absorbed score -------------------------------------------------------------------------------------------


@checker
def check_absorbed_score(fn: Callable) -> Verdict:
    """``fn(q_nope [T, H, N], q_pe [T, H, R], c_kv [S, C], k_pe [S, R], w_uk [H, N, C], scale) -> [H, T, S]``:
    the pre-softmax scores through the latent, without building each head's keys (no mask). A key built anyway
    fails the check, even when the scores are right: all heads at once or one head (or one position) at a time, in
    any layout and at any scale (keys from ``scale * W_UK`` are keys too), however spelled."""
    g = generator(3)
    T, S, H, N, R, C = 3, 5, 4, 8, 6, 10
    q_nope, q_pe = torch.randn(T, H, N, generator=g), torch.randn(T, H, R, generator=g)
    c_kv, k_pe = torch.randn(S, C, generator=g), torch.randn(S, R, generator=g)
    w_uk, scale = torch.randn(H, N, C, generator=g), 0.37
    k_nope = torch.einsum("sc,hnc->hsn", c_kv, w_uk)  # [H, S, N]: the naive path's expanded keys
    content = torch.einsum("thn,hsn->hts", q_nope, k_nope)
    rotary = torch.einsum("thr,sr->hts", q_pe, k_pe)
    expected = scale * (content + rotary)
    watch = Watch().forbid(BUILT_KEYS, k_nope, loop_dims=(0, 1), position_dim=1)
    with watch:
        out, error = call(fn, q_nope.clone(), q_pe.clone(), c_kv.clone(), k_pe.clone(), w_uk.clone(), scale,
                          own={MultiHeadLatentAttention: "MultiHeadLatentAttention"})
    if error is not None:
        return error
    expanded = _forbidden_expansion(watch, "absorbed score")
    if expanded is not None:
        return expanded
    mistakes = [
        ("the scores are [H, S, T]; rows must be queries t and columns keys s: [H, T, S]", expected.transpose(1, 2)),
        ("you left out the rotary part q_pe · k_pe", scale * content),
        ("you left out the content part (W_UK^T q_nope) · c_KV", scale * rotary),
        ("you forgot the softmax scale", content + rotary),
        ("the scale applies to the sum: you scaled only the content part", scale * content + rotary),
        ("the scale applies to the sum: you scaled only the rotary part", content + scale * rotary),
        ("you applied the scale twice", scale**2 * (content + rotary)),
        ("the scores are [H, T, S], per head; yours are [T, H, S]", expected.transpose(0, 1)),
    ]
    verdict = compare("absorbed score", out, expected, mistakes, atol=1e-4, axes={1: "queries", 2: "keys"})
    if verdict.ok or verdict.mistake is not None:
        return verdict
    # One part switched off at a time: with q_pe zero the scores are the content part alone, with q_nope zero the
    # rotary part alone; whichever comes out right is not the one that is wrong.
    parts = {"content": ("content part, scale * (W_UK^T q_nope) · c_KV", scale * content),
             "rotary": ("rotary part, scale * q_pe · k_pe", scale * rotary)}
    for zeroed, good, bad in ((1, "content", "rotary"), (0, "rotary", "content")):
        args = [q_nope.clone(), q_pe.clone(), c_kv.clone(), k_pe.clone(), w_uk.clone(), scale]
        args[zeroed] = torch.zeros_like(args[zeroed])  # q_pe zero: the content part alone; q_nope zero: the rotary
        if gives(fn, args, parts[good][1], atol=1e-4):
            return named(f"your {parts[good][0]} is right (run alone, the other query zeroed), so your "
                         f"{parts[bad][0]}, is wrong ([H, T, S]: rows t, columns s)", "absorbed score")
    return verdict


# --- MLA from the weights -----------------------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _mla_variant(w: dict[str, torch.Tensor], cfg: K2Config, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 q_norm: bool = True, kv_norm: bool = True, rope_first_in_q: bool = False, k_pe_first: bool = False,
                 values_first: bool = False, deinterleave: bool = True, rotate: bool = True,
                 mask: str = "-inf", scale: float | None = None, softmax_over_queries: bool = False,
                 o_proj: bool = True, sin_sign: float = 1.0) -> torch.Tensor:
    """MLA written out from the weights, with a switch for each usual mistake (the defaults are the right forward);
    the checker's source of wrong answers. ``mask``: "-inf" (right), "none", "multiply" (scores times the lower
    triangle, zeros where -inf belongs) or "after softmax" (the pattern times the triangle, not renormalised);
    ``sin_sign`` -1 rotates the wrong way. x [B, T, D], cos/sin [T, R] -> [B, T, D]."""
    H, N, R, V, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    B, T, _ = x.shape
    c_q = x @ w["q_a_proj.weight"].T
    c_q = _rms_norm(c_q, w["q_a_layernorm.weight"], cfg.rms_norm_eps) if q_norm else c_q
    q = (c_q @ w["q_b_proj.weight"].T).view(B, T, H, N + R)
    q_nope, q_pe = (q[..., R:], q[..., :R]) if rope_first_in_q else (q[..., :N], q[..., N:])
    kv_a = x @ w["kv_a_proj_with_mqa.weight"].T  # [B, T, C + R]
    latent, k_pe = (kv_a[..., R:], kv_a[..., :R]) if k_pe_first else (kv_a[..., :C], kv_a[..., C:])
    latent = _rms_norm(latent, w["kv_a_layernorm.weight"], cfg.rms_norm_eps) if kv_norm else latent
    kv = (latent @ w["kv_b_proj.weight"].T).view(B, T, H, N + V)
    k_nope, v = (kv[..., V:], kv[..., :V]) if values_first else (kv[..., :N], kv[..., N:])
    sin = sin * sin_sign
    if rotate:
        q_pe = apply_rotary(q_pe, cos[:, None], sin[:, None], interleaved=deinterleave)
        k_pe = apply_rotary(k_pe, cos, sin, interleaved=deinterleave)
    scores = torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
    scores = scores * (cfg.softmax_scale if scale is None else scale)
    allowed = causal_mask(T, T, x.device)  # [T, S]
    if mask == "-inf":
        scores = scores.masked_fill(~allowed, -torch.inf)
    elif mask == "multiply":
        scores = scores * allowed
    pattern = scores.softmax(dim=-2 if softmax_over_queries else -1).nan_to_num()
    if mask == "after softmax":
        pattern = pattern * allowed
    z = torch.einsum("bhts,bshv->bthv", pattern, v).flatten(2)  # [B, T, H*V]
    return z @ w["o_proj.weight"].T if o_proj else z


def _random_attention(cfg: K2Config, seed: int) -> MultiHeadLatentAttention:
    """An MLA with random weights under which every usual mistake shows: norm weights far from one, a latent whose
    rms is far from one (so that a forgotten norm changes it), rotary rows large enough to matter."""
    g = generator(seed)
    attn = MultiHeadLatentAttention(cfg)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "layernorm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        attn.kv_a_proj_with_mqa.weight[: cfg.kv_lora_rank] *= 3.0
    return attn.eval()


def _mla_inputs(cfg: K2Config, batch: int, positions: torch.Tensor, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [B, T, D] and the rotary cos, sin [T, R] as ``k2lab.model.prepare_inputs`` makes them: each pair's angle
    position * inv_freq[i], written for x_i and x_{i+R/2} (the rotate-half layout), times YaRN's cos/sin factor."""
    hidden = torch.randn(batch, len(positions), cfg.hidden_size, generator=generator(seed))
    angles = positions.float()[:, None] * inverse_frequencies(cfg)  # [T, R/2]
    angles = torch.cat((angles, angles), dim=-1)  # [T, R]
    return hidden, angles.cos() * cos_sin_scale(cfg), angles.sin() * cos_sin_scale(cfg)


def mla_slips(cfg: K2Config) -> list[tuple[str, dict]]:
    """The usual MLA slips for ``cfg``: (what went wrong, the ``_mla_variant`` switches that make it)."""
    qk, wide, m2 = cfg.qk_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.yarn_mscale**2
    return [
        ("you forgot kv_a_layernorm: c_KV is the NORMALISED latent", dict(kv_norm=False)),
        ("you forgot q_a_layernorm: c_Q is normalised before q_b_proj", dict(q_norm=False)),
        ("each head's query is [nope (N) | rope (R)]: you took the rotary part first", dict(rope_first_in_q=True)),
        ("kv_a_proj_with_mqa gives [c_KV (C) | k_pe (R)]: you took k_pe first", dict(k_pe_first=True)),
        ("kv_b_proj gives per head [k_nope (N) | v (V)]: you took the values first", dict(values_first=True)),
        ("you rotated the stored rotary features as they are: de-interleave them first ((x0, x1, x2, ...) -> "
         "(x0, x2, ..., x1, x3, ...)), then rotate halves", dict(deinterleave=False)),
        ("you did not rotate q_pe and k_pe", dict(rotate=False)),
        ("you forgot the causal mask: position t may only see keys 0..t", dict(mask="none")),
        ("you made the causal mask by multiplying the scores with tril: a masked score becomes 0, not -inf, and "
         "exp(0) = 1 still gives the future keys weight; fill them with -inf before the softmax "
         "(scores.masked_fill(~mask, -inf))", dict(mask="multiply")),
        ("you masked the pattern after the softmax without renormalising: each row no longer sums to 1; mask the "
         "scores with -inf before the softmax", dict(mask="after softmax")),
        (f"you forgot YaRN's m^2 in the scale: it is {qk}^-1/2 * m^2", dict(scale=qk**-0.5)),
        (f"m goes in squared (once for the query, once for the key): the scale is {qk}^-1/2 * m^2",
         dict(scale=qk**-0.5 * cfg.yarn_mscale)),
        (f"a head's query-key width is N + R = {qk} (content and rotary parts): the scale is {qk}^-1/2 * m^2, not "
         f"N^-1/2 * m^2", dict(scale=cfg.qk_nope_head_dim**-0.5 * m2)),
        ("you rotated the wrong way: the rotation is x * cos + rotate_half(x) * sin, with rotate_half(x) = "
         "[-x2, x1] for the halves x1, x2", dict(sin_sign=-1.0)),
        (f"the scale stays {qk}^-1/2 * m^2 in the absorbed form: the scores are the same numbers, summed in another "
         f"order; the {wide}-wide keys do not change them", dict(scale=wide**-0.5 * m2)),
        (f"the scale is {qk}^-1/2 * m^2, not 1/sqrt({wide}): the scores are the naive ones, whatever the width of "
         f"the absorbed keys", dict(scale=wide**-0.5)),
        ("you took the softmax over the queries; it runs over the keys (the last axis)",
         dict(softmax_over_queries=True)),
        ("you forgot o_proj: the heads' outputs go through o_proj into the residual", dict(o_proj=False)),
    ]


def mla_mistakes(w: dict[str, torch.Tensor], cfg: K2Config, hidden: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The usual MLA slips for these weights and inputs, each with the output it gives [B, T, D]."""
    with torch.no_grad():
        return [(message, _mla_variant(w, cfg, hidden, cos, sin, **switches)) for message, switches in mla_slips(cfg)]


def mixing(verdict: Verdict) -> Verdict:
    """A verdict right at position 0 alone, with what that says: at position 0 a query sees only its own key and
    turns by angle 0, so what differs later is what mixes or turns positions."""
    if verdict.mistake is not None and verdict.mistake.startswith("yours is right at positions 0 and wrong at"):
        return named(f"{verdict.mistake}: at position 0 a query sees only its own key and turns by angle 0, so what "
                     f"is wrong mixes or turns positions (the causal mask, the rotation of q_pe AND k_pe, the "
                     f"scale, the softmax's axis)", verdict.message.split(": ", 1)[0])
    return verdict


# K2-nano with a wider latent, so that C + R (56) differs from N + R (48) and a scale from the wrong width shows; and
# a second config with other widths, two heads and DeepSeek-V2-Lite's YaRN temperature (mscale = mscale_all_dim =
# 0.707), so that an answer with K2-nano's numbers written in fails.
MLA_CONFIGS = [("K2-nano", K2Config.nano().replace(kv_lora_rank=40)),
               ("a second config (2 heads, V2-Lite's mscale)", K2Config.nano().replace(
                   num_attention_heads=2, qk_nope_head_dim=24, v_head_dim=20, kv_lora_rank=28, q_lora_rank=36,
                   mscale=0.707, mscale_all_dim=0.707))]


@checker
def check_mla_forward(fn: Callable, absorbed: bool = False) -> Verdict:
    """``fn(weights: dict[str, Tensor], cfg: K2Config, hidden [B, T, D], cos [T, R], sin [T, R]) -> [B, T, D]``:
    multi-head latent attention from its weights, equal to ``k2lab.MultiHeadLatentAttention``.

    ``weights`` holds the module's tensors under their checkpoint names (``q_a_proj.weight``,
    ``q_a_layernorm.weight``, ``q_b_proj.weight``, ``kv_a_proj_with_mqa.weight``, ``kv_a_layernorm.weight``,
    ``kv_b_proj.weight``, ``o_proj.weight``); the config gives the widths and ``rms_norm_eps``. cos and sin are for
    the rotate-half layout (each pair's angle for x_i and x_{i+R/2}) after the checkpoint's interleaved rotary
    features are de-interleaved; the queries attend causally (position t sees 0..t); the softmax scale is
    ``cfg.softmax_scale``. Checked on K2-nano's widths and on a second config (two heads, other widths,
    DeepSeek-V2-Lite's YaRN temperature).

    ``absorbed=True`` checks the absorbed form, one multi-query attention over [W_UK^T q_nope ; q_pe] ·
    [c_KV ; k_pe] with W_UV applied after: it must never build per-head keys or values, in any layout, at any
    scale, whole or a batch row, head or position at a time (the check watches every tensor your code makes), and
    it keeps the scale (N + R)^-1/2 * m^2, since the scores are the same numbers."""
    what = "absorbed MLA" if absorbed else "MLA forward"
    verdict = Verdict(True, what)
    for name, cfg in MLA_CONFIGS:
        attn = _random_attention(cfg, seed=13)
        hidden, cos, sin = _mla_inputs(cfg, batch=2, positions=torch.arange(7), seed=14)
        w = {key: t.detach().clone() for key, t in attn.state_dict().items()}
        with torch.no_grad():
            expected = attn(hidden, cos, sin, attn_impl="naive")
            H, N, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            latent = _rms_norm((hidden @ w["kv_a_proj_with_mqa.weight"].T)[..., : cfg.kv_lora_rank],
                               w["kv_a_layernorm.weight"], cfg.rms_norm_eps)
            kv = (latent @ w["kv_b_proj.weight"].T).unflatten(-1, (H, N + V))  # [B, S, H, N+V]: what naive expands
        watch = None
        if absorbed:  # each piece a loop over batch rows (0), positions (1) or heads (2) would make
            watch = (Watch().forbid(BUILT_KEYS, kv[..., :N], (0, 1, 2), position_dim=1)
                     .forbid(BUILT_KEYS, kv, (0, 1, 2), position_dim=1)
                     .forbid(BUILT_VALUES, kv[..., N:], (0, 1, 2), position_dim=1))
        with watch if watch is not None else nullcontext(), torch.no_grad():
            out, error = call(fn, dict(w), cfg, hidden.clone(), cos.clone(), sin.clone(),
                              own={MultiHeadLatentAttention: "MultiHeadLatentAttention"})
        if error is not None:
            return error
        where = what if name == MLA_CONFIGS[0][0] else f"{what}, {name}"
        expanded = _forbidden_expansion(watch, where) if absorbed else None
        if expanded is not None:
            return expanded
        verdict = compare(where, out, expected, partial(mla_mistakes, w, cfg, hidden, cos, sin), atol=1e-4,
                          axes={1: "positions"})
        if not verdict.ok and verdict.mistake is None and as_tensor(out) is not None \
                and as_tensor(out).shape == expected.shape:
            return named("position 0 is wrong too, where each query sees only its own key and turns by angle 0, so "
                         "the slip is not (only) in the mask, the rotation or the scale: look at the projections, "
                         "the latent norms, the split of each head into [nope | rope] and [k_nope | v], the values "
                         "and o_proj", where)
        if not verdict.ok:
            return mixing(verdict)
    configs = " and ".join(name for name, _ in MLA_CONFIGS)
    built = ", and no per-head key or value was built" if absorbed else ""
    return Verdict(True, f"{what}: matches k2lab on {configs}{built}")
