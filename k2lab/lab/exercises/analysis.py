"""05 to 09: reading the model. MaxVio (``check_max_violation``), direct logit attribution
(``check_logit_attribution``), a patching hook (``check_patch_hook``), KV-cache bytes (``check_kv_cache_bytes``, 03),
one MoE block's parameters (``check_moe_block_parameters``, 08) and the logit lens (``check_logit_lens``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...analysis.accounting import block_parameters, kv_cache_bytes
from ...analysis.routing import max_violation
from ...config import K2Config
from ...model.layers import RMSNorm
from .checking import Verdict, as_tensor, call, checker, compare, generator, named, same

# --- 05: MaxVio ---------------------------------------------------------------------------------------------------


@checker
def check_max_violation(fn: Callable) -> Verdict:
    """``fn(counts [L, E]) -> [L]``: MaxVio = max_e c_e / mean_e c_e - 1, against ``k2lab.routing.max_violation``.
    The counts are integers (``torch.bincount``'s), with rows whose mean is fractional (151 / 6) and one whose
    idlest expert is further from the mean than its busiest ([31, 30, 30, 30, 30, 0])."""
    counts = torch.tensor([[10, 30, 20, 20, 0, 40], [25, 25, 25, 25, 25, 25], [0, 0, 90, 30, 0, 30],
                           [31, 30, 30, 30, 30, 0]])
    expected = max_violation(counts).double()
    out, error = call(fn, counts.clone(), own={max_violation: "max_violation"})
    if error is not None:
        return error
    c = counts.double()
    mean, top = c.mean(-1), c.amax(-1)
    floored = (counts.sum(-1) // counts.shape[-1]).double()
    mistakes = [
        ("you forgot the - 1: MaxVio is 0 when balanced", top / mean),
        ("you gave a percentage; MaxVio is a fraction (0.5, not 50)", 100 * (top / mean - 1)),
        ("you divided by the total; MaxVio divides by the mean load", top / c.sum(-1) - 1),
        ("(max - min) / mean is a spread, not MaxVio: compare the busiest expert with the mean",
         (top - c.amin(-1)) / mean),
        ("that is the coefficient of variation (std / mean), not MaxVio", c.std(-1) / mean),
        ("that is the coefficient of variation (std / mean), not MaxVio", c.std(-1, correction=0) / mean),
        ("you reduced over the wrong dimension: one value per layer, over its experts",
         c.amax(0) / c.mean(0) - 1),
        ("max |c - mean| / mean also counts the idlest expert ([31, 30, 30, 30, 30, 0] gives 1.0 for its 0); MaxVio "
         "is about the busiest one: max c / mean - 1", (c - mean[:, None]).abs().amax(-1) / mean),
        ("your mean is rounded down (integer division, //): the mean load here is 151 / 6 = 25.17; divide with / "
         "(counts.float().mean(-1))", top / floored - 1),
        ("you divided by the median load; MaxVio divides by the mean", top / c.median(-1).values - 1),
    ]
    verdict = compare("MaxVio", out, expected, mistakes, axes={0: "layers (rows of counts)"})
    if verdict.ok or verdict.mistake is not None or as_tensor(out) is None or as_tensor(out).shape != expected.shape:
        return verdict
    answer = as_tensor(out).double()
    if abs(answer[1].item()) > 1e-6:
        return named(f"a balanced layer (every expert 25 tokens) has MaxVio 0; yours gives {answer[1].item():.4g}",
                     "MaxVio")
    doubled, error = call(fn, counts * 2, keep=False)
    if error is None and as_tensor(doubled) is not None and not same(as_tensor(doubled), answer, 1e-6, 1e-4):
        return named("MaxVio is a ratio of loads, so doubling every count must not change it, and yours changes: "
                     "divide the busiest expert's count by the mean of its own layer", "MaxVio")
    return verdict


# --- 06: direct logit attribution ---------------------------------------------------------------------------------


@checker
def check_logit_attribution(fn: Callable) -> Verdict:
    """``fn(component [D], x_final [D], norm_weight [D], unembed_row [D], eps) -> float``: one term's direct
    contribution to a logit, u · (g ⊙ c) / rms(x_L) with rms(x_L) = sqrt(mean(x_L²) + eps), the final norm's scale
    frozen at x_L. The check's stream is small beside its eps, so that leaving eps out (or putting it outside the
    square root) shows."""
    g = generator(9)
    D, eps = 16, 0.05
    parts = torch.randn(3, D, generator=g) * torch.tensor([[0.3], [0.2], [0.1]])  # mean(x_L²) about eps
    x_final = parts.sum(0)
    norm = RMSNorm(D, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    u, w = torch.randn(D, generator=g), norm.weight.detach()
    ms = x_final.pow(2).mean()
    rms = (ms + eps).sqrt()
    logit = (u * norm(x_final).detach()).sum()
    answers = []
    for c in parts:
        expected = (u * w * c).sum() / rms
        out, error = call(fn, c.clone(), x_final.clone(), w.clone(), u.clone(), eps)
        if error is not None:
            return error
        mistakes = [
            ("you forgot to divide by rms(x_L): the final norm scales every term by the same 1 / rms(x_L)",
             (u * w * c).sum()),
            ("you forgot the eps: rms(x_L) = sqrt(mean(x_L²) + eps), as the final RMSNorm computes it",
             (u * w * c).sum() / ms.sqrt()),
            ("the eps goes inside the square root: rms(x_L) = sqrt(mean(x_L²) + eps)",
             (u * w * c).sum() / (ms.sqrt() + eps)),
            ("you divided by the term's own rms; the norm's scale is frozen at the whole stream's, rms(x_L)",
             (u * w * c).sum() / (c.pow(2).mean() + eps).sqrt()),
            ("you forgot the norm's weight g", (u * c).sum() / rms),
            ("you used the sum of squares: rms(x_L) = sqrt(MEAN(x_L²) + eps), as RMSNorm computes it",
             (u * w * c).sum() / (x_final.pow(2).sum() + eps).sqrt()),
            ("you used the sum of squares without eps: rms(x_L) = sqrt(MEAN(x_L²) + eps)",
             (u * w * c).sum() / x_final.pow(2).sum().sqrt()),
            ("you divided by mean(x_L²) + eps, the mean square; divide by its square root",
             (u * w * c).sum() / (ms + eps)),
            ("you multiplied by rms(x_L); the final norm divides by it", (u * w * c).sum() * rms),
        ]
        verdict = compare("attribution", out, expected, mistakes)
        if not verdict.ok:
            return verdict if verdict.mistake is not None else _attribution_diagnosis(fn, parts, x_final, w, u, eps,
                                                                                       verdict)
        answers.append(float(out))
    return Verdict(True, f"direct logit attribution: right, and the terms sum to the logit ({sum(answers):.4f} = "
                         f"{logit.item():.4f})")


def _attribution_diagnosis(fn: Callable, parts: torch.Tensor, x_final: torch.Tensor, w: torch.Tensor,
                           u: torch.Tensor, eps: float, verdict: Verdict) -> Verdict:
    """Why an attribution is wrong, from what the learner's function does to the three terms and to a doubled one."""
    rms = (x_final.pow(2).mean() + eps).sqrt()
    answers = []
    for c in parts:
        out, error = call(fn, c.clone(), x_final.clone(), w.clone(), u.clone(), eps, keep=False)
        answers.append(as_tensor(out) if error is None else None)
    right = torch.stack([(u * w * c).sum() / rms for c in parts]).double()
    if all(a is not None and a.numel() == 1 for a in answers):
        ratio = torch.stack([a.double().reshape(()) for a in answers]) / right
        if ratio.std() < 1e-4 * ratio.abs().mean():
            return named(f"all three of your terms are {ratio.mean().item():.4g} times the right ones: the factor "
                         f"every term shares is wrong, 1 / rms(x_L) with rms(x_L) = sqrt(mean(x_L²) + eps)",
                         "attribution")
    doubled, error = call(fn, 2 * parts[0], x_final.clone(), w.clone(), u.clone(), eps, keep=False)
    if error is None and answers[0] is not None and as_tensor(doubled) is not None and not same(
            as_tensor(doubled).reshape(-1)[:1], 2 * answers[0].reshape(-1)[:1], 1e-6, 1e-4):
        return named("the attribution is linear in the component, u · (g ⊙ c) / rms(x_L) with the norm's scale "
                     "frozen at the whole stream's: doubling c (x_L kept) must double it, and yours does not",
                     "attribution")
    return verdict


# --- 07: a patching hook ------------------------------------------------------------------------------------------


@checker
def check_patch_hook(fn: Callable) -> Verdict:
    """``fn(activation [B, T, D], source [B, T, D], positions: list[int]) -> [B, T, D]``: the activation with the
    source's values at the given positions, as ``k2lab.interventions.patch`` writes them; the input unchanged."""
    g = generator(10)
    act, source, positions = torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 3, generator=g), [1, 3]
    expected = act.clone()
    expected[:, positions] = source[:, positions]
    out, error = call(fn, act.clone(), source.clone(), list(positions), in_place={
        0: "another probe or cache may hold that very tensor; clone it, then write into the copy",
        1: "the source is the other run's activation, which its cache may be asked for again; build your answer in a "
           "copy of the activation (activation.clone()) and read the source"})
    if error is not None:
        return error
    others = source.clone()
    others[:, positions] = act[:, positions]
    batch = act.clone()
    batch[positions[0]] = source[positions[0]]
    mistakes = [("you patched every position; only the given ones change", source),
                ("you patched every position but the given ones", others),
                ("you indexed the batch axis; positions are axis 1 of [B, T, D]", batch)]
    verdict = compare("patch hook", out, expected, mistakes, atol=0, rtol=0, axes={1: "positions", 0: "batch rows"})
    if (verdict.mistake or "").startswith("yours is right at positions"):
        return named(f"{verdict.mistake} (the ones to patch are {positions}: the source's values there, the "
                     f"activation's elsewhere, in every batch row)", "patch hook")
    return verdict


# --- 08: KV-cache bytes -------------------------------------------------------------------------------------------


def as_count(out: object) -> int | None:
    """The learner's count as an int: an int, an integral float, or a one-element tensor of either; else None."""
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    if isinstance(out, float) and out.is_integer():
        out = int(out)
    return out if isinstance(out, int) and not isinstance(out, bool) else None


@checker
def check_kv_cache_bytes(fn: Callable) -> Verdict:
    """``fn(cfg: K2Config, tokens: int) -> int``: bytes of the latent KV cache in bfloat16 over all layers,
    against ``k2lab.kv_cache_bytes``."""
    for cfg, name in ((K2Config.kimi_k2(), "Kimi K2"), (K2Config.nano(), "K2-nano")):
        for tokens in (1, 1000):
            expected = kv_cache_bytes(cfg, tokens)
            out, error = call(fn, cfg, tokens, own={kv_cache_bytes: "kv_cache_bytes"})
            where = f"{name}, {tokens} tokens"
            if error is not None:
                return error
            count = as_count(out)
            if count is None:
                got = f"a {type(out).__name__}" + (f" of shape {list(out.shape)}" if isinstance(out, torch.Tensor)
                                                   else f" ({out!r})" if isinstance(out, float) else "")
                return named(f"return the number of bytes as one int, got {got}", where)
            if count == expected:
                continue
            L, C, R = cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim
            mistakes = {
                tokens * (C + R) * 2: "you counted one layer; every layer has its own cache",
                tokens * (C + R) * 4 * L: "twice the right count: either 4 bytes per value (the cache is bfloat16, 2 "
                                          "bytes), or the latent counted twice, once for the keys and once for the "
                                          "values (MLA caches one c_KV and one k_pe per token, and makes both keys "
                                          "and values from them)",
                tokens * (2 * C + R) * 2 * L: "you counted c_KV twice, once for the keys and once for the values: "
                                              "MLA caches one latent per token, from which both are made",
                tokens * C * 2 * L: "you forgot the shared rotary key k_pe (qk_rope_head_dim values)",
                tokens * R * 2 * L: "you forgot the latent c_KV (kv_lora_rank values)",
                tokens * (C + R) * L: "1 byte per value: the cache is bfloat16, 2 bytes",
                kv_cache_bytes(cfg, tokens, layout="expanded"): "that is the expanded cache (every head's keys and "
                                                                "values); MLA caches the latent",
                tokens * (C + R) * 2 * L * 8: "you counted bits; the answer is in bytes (2 per bfloat16 value)",
            }
            if count in mistakes:
                return named(mistakes[count], where)
            return _kv_diagnosis(cfg, tokens, count, expected, where)
    return Verdict(True, f"KV-cache bytes: right for K2 ({kv_cache_bytes(K2Config.kimi_k2(), 1):,} per token) and nano")


def _kv_diagnosis(cfg: K2Config, tokens: int, count: int, expected: int, where: str) -> Verdict:
    """Why a KV-cache count is wrong: another width of the config in place of the latent's, or a factor of it."""
    L, C, R = cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    widths = {"q_lora_rank (the QUERY latent's width)": cfg.q_lora_rank, "hidden_size": cfg.hidden_size,
              "qk_nope_head_dim": cfg.qk_nope_head_dim, "v_head_dim": cfg.v_head_dim,
              "qk_head_dim (N + R)": cfg.qk_head_dim}
    for name, width in widths.items():
        for rotary in (R, 0):
            if width is not None and count == tokens * (width + rotary) * 2 * L:
                return named(f"you used {name} where the cache holds c_KV, kv_lora_rank = {C} values (plus k_pe, "
                             f"{R})", where)
    factors = {"num_attention_heads": cfg.num_attention_heads, "num_hidden_layers": L,
               "n_routed_experts": cfg.n_routed_experts}
    for name, factor in factors.items():
        if count == expected * factor:
            reason = ("the latent cache is shared by every head: one c_KV and one k_pe per token and layer"
                      if name == "num_attention_heads" else "count each layer once")
            return named(f"yours is {name} ({factor}) times the right count: {reason}", where)
    if count % expected == 0 or expected % count == 0:
        ratio = count / expected
        return named(f"yours is {ratio:g} times the right count: per token and layer the cache holds (C + R) = "
                     f"{C + R} values of 2 bytes", where)
    return Verdict(False, f"{where}: expected {expected:,}, got {count:,} (off by {count - expected:+,})")


# --- 08: one MoE block's parameters --------------------------------------------------------------------------------


def _moe_block_variants(cfg: K2Config) -> list[tuple[str, int]]:
    """The usual slips in counting one MoE block from its config, each with the count it gives."""
    D, H, N, R = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    C, Q, E, I, S, k = (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.n_routed_experts, cfg.moe_intermediate_size,
                        cfg.n_shared_experts, cfg.num_experts_per_tok)
    right = block_parameters(cfg, cfg.first_k_dense_replace)
    query = D * H * (N + R) if Q is None else D * Q + Q + Q * H * (N + R)
    latent_norms = C + (Q or 0)
    expert = 3 * D * I
    slips = [
        ("you forgot the correction bias: the router stores one float32 number per expert beside W_gate "
         "(e_score_correction_bias)", right - E),
        ("you forgot the block's two RMSNorms (input_layernorm and post_attention_layernorm, D each)", right - 2 * D),
        ("you forgot MLA's latent norms (kv_a_layernorm, and q_a_layernorm where there is a query latent)",
         right - latent_norms),
        ("you forgot the shared rotary key: kv_a_proj_with_mqa makes c_KV AND k_pe, D x (C + R)", right - D * R),
        ("you counted only the k experts a token uses; the block stores all E", right - (E - k) * expert),
        ("an expert is a SwiGLU: three matrices (gate, up, down), not two", right - E * D * I - S * D * I),
        ("you forgot the shared expert(s)", right - S * expert),
    ]
    if S > 1:
        slips.append(("this config has n_shared_experts > 1: count every shared expert", right - (S - 1) * expert))
    if Q is not None:
        slips.append(("K2 has a query latent: q_a_proj (D x q_lora_rank), its norm, then q_b_proj, not one "
                      "D x H(N + R) matrix", right - query + D * H * (N + R)))
    return [(message, count) for message, count in slips if count != right]


def _missing_component(cfg: K2Config, off: int) -> str | None:
    """When a count is off by exactly one weight matrix of the block (or two), which."""
    D, H, N, R, V = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                     cfg.v_head_dim)
    C, Q, E, I = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.n_routed_experts, cfg.moe_intermediate_size
    parts = {"o_proj (H·V x D)": H * V * D, "kv_b_proj's value rows (C x H·V)": C * H * V,
             "kv_b_proj's key rows (C x H·N)": C * H * N, "kv_a_proj_with_mqa (D x (C + R))": D * (C + R),
             "the router's W_gate (E x D)": E * D, "one expert (3 x D x I)": 3 * D * I,
             "the routed experts (E x 3 x D x I)": E * 3 * D * I, "one RMSNorm (D)": D}
    if Q is not None:
        parts |= {"q_a_proj (D x q_lora_rank)": D * Q, "q_b_proj (q_lora_rank x H·(N + R))": Q * H * (N + R),
                  "q_b_proj's rotary rows (q_lora_rank x H·R)": Q * H * R}
    else:
        parts |= {"q_proj (D x H·(N + R))": D * H * (N + R)}
    for (a, x), (b, y) in [((a, x), (a, 0)) for a, x in parts.items()] + [
            (p, q) for i, p in enumerate(parts.items()) for q in list(parts.items())[i + 1:]]:
        for sign, verb in ((-1, "short"), (1, "over")):
            if off == sign * (x + y):
                which = a if y == 0 else f"{a} and {b}"
                return (f"your count is {verb} by exactly {which}: {abs(off):,} parameters "
                        f"({'left out' if sign < 0 else 'counted twice or one too many'})")
    return None


@checker
def check_moe_block_parameters(fn: Callable) -> Verdict:
    """``fn(cfg: K2Config) -> int``: the parameters of one MoE block (its two norms, MLA with its latent norms, the
    router with its correction bias, every routed expert and the shared experts), against
    ``k2lab.analysis.accounting.block_parameters``, for K2, Moonlight (no query latent, two shared experts) and
    K2-nano."""
    configs = [("Kimi K2", K2Config.kimi_k2()), ("Moonlight", K2Config.moonlight()), ("K2-nano", K2Config.nano())]
    for name, cfg in configs:
        expected = block_parameters(cfg, cfg.first_k_dense_replace)
        out, error = call(fn, cfg, own={block_parameters: "block_parameters"})
        if error is not None and cfg.q_lora_rank is None and "NoneType" in error.message:
            return named("this config has no query latent (q_lora_rank is None): its query is one q_proj, "
                         "D x H(N + R), with no q_a_layernorm", name)
        if error is not None:
            return Verdict(False, f"{name}: {error.message}", mistake=error.mistake)
        count = as_count(out)
        if count == expected:
            continue
        if count is None:
            return named(f"return the count as an int, got {type(out).__name__} {out!r}", name)
        out = count
        for message, count in _moe_block_variants(cfg):
            if out == count:
                return named(message, name)
        component = _missing_component(cfg, out - expected)
        if component is not None:
            return named(component, name)
        return Verdict(False, f"{name}: expected {expected:,}, got {out:,} (off by {out - expected:+,})")
    return Verdict(True, f"one MoE block: right for K2 ({block_parameters(K2Config.kimi_k2(), 1):,}), Moonlight and "
                         f"K2-nano")


# --- 09: the logit lens -------------------------------------------------------------------------------------------


@checker
def check_logit_lens(fn: Callable) -> Verdict:
    """``fn(resid [T, D], norm, head) -> [T, V]``: the logits the model would give if it stopped at this residual
    (the final norm, then the head, in float32), as ``ActivationCache.logit_lens`` reads them."""
    g = generator(11)
    D, V = 12, 30
    norm, head = RMSNorm(D), torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
        head.weight.copy_(torch.randn(V, D, generator=g))
        resid = torch.randn(4, D, generator=g) * 5
        expected = head(norm(resid)).float()
        out, error = call(fn, resid.clone(), norm, head)
        if error is not None:
            return error
        eps = norm.eps if hasattr(norm, "eps") else 1e-6
        unweighted = resid * torch.rsqrt(resid.pow(2).mean(-1, keepdim=True) + eps)  # RMSNorm without its g
        mistakes = [("you forgot the final norm: the head reads RMSNorm(x), as after the last layer", head(resid)),
                    ("you normalised without the norm's weight g: call the final norm itself (norm(x)), whose "
                     "learned scale is part of what the head reads", head(unweighted)),
                    ("you normalised with LayerNorm (centred): the final norm is an RMSNorm, norm(x)",
                     head(torch.nn.functional.layer_norm(resid, resid.shape[-1:]) * norm.weight)),
                    ("you returned probabilities (softmax); return the logits", expected.softmax(-1)),
                    ("you returned log-probabilities; return the logits", expected.log_softmax(-1))]
        return compare("logit lens", out, expected, mistakes, atol=1e-4, axes={0: "positions"},
                       terms={"head(resid), the head of the un-normalised stream": head(resid)})
