"""02: positions. The rotation (``check_rotation``) and YaRN's frequencies and softmax scale
(``check_yarn_frequencies``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

from ...config import K2Config, yarn_get_mscale
from ...model.attention import apply_rotary
from ...model.rope import inverse_frequencies, yarn_correction_dim, yarn_correction_range, yarn_ramp
from .checking import Verdict, call, checker, compare, generator, named

# --- the rotation -------------------------------------------------------------------------------------------------


def _rotate_halves(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+R/2}) by angles [T, R/2]."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], dim=-1)


def _rotate_neighbours(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_2i, x_2i+1) by angles [T, R/2], keeping the interleaved layout."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], -1).flatten(-2)


def _keeps_lengths(out: torch.Tensor, x: torch.Tensor, pairs: Literal["halves", "neighbours"]) -> bool:
    """Whether ``out`` keeps the length of each pair of ``x``: "halves" (x_i, x_{i+R/2}) or "neighbours" (x_2i,
    x_2i+1). A rotation of those pairs does, by any angles."""
    if pairs == "halves":
        (a, b), (c, d) = out.double().chunk(2, -1), x.double().chunk(2, -1)
    else:
        a, b, c, d = out.double()[..., 0::2], out.double()[..., 1::2], x.double()[..., 0::2], x.double()[..., 1::2]
    return torch.allclose(a**2 + b**2, c**2 + d**2, rtol=1e-3, atol=1e-4)


@checker
def check_rotation(fn: Callable) -> Verdict:
    """``fn(x [T, R], positions [T], inv_freq [R/2]) -> [T, R]``: rotate each pair (x_i, x_{i+R/2}) by the angle
    position * inv_freq[i] (the rotate-half layout, which k2lab uses after de-interleaving the checkpoint's pairs).
    Checked against ``k2lab.model.attention.apply_rotary`` with K2-nano's frequencies."""
    inv_freq = inverse_frequencies(K2Config.nano())  # [R/2]
    positions = torch.tensor([0, 1, 2, 7, 100, 3000])
    x = torch.randn(len(positions), 16, generator=generator(2))
    angles = positions[:, None].float() * inv_freq  # [T, R/2]
    both = torch.cat((angles, angles), dim=-1)  # [T, R]: each pair's angle on x_i and on x_{i+R/2}
    expected = apply_rotary(x, both.cos(), both.sin(), interleaved=False)
    out, error = call(fn, x.clone(), positions.clone(), inv_freq.clone(), own={apply_rotary: "apply_rotary"})
    if error is not None:
        return error
    neighbours = "you paired neighbours (x_0, x_1), (x_2, x_3), ...; here the pairs are (x_i, x_{i+R/2})"
    mistakes = [
        ("you rotated the wrong way: the sine's sign is flipped (x_i' = x_i cos - x_{i+R/2} sin)",
         _rotate_halves(x, -angles)),
        (neighbours, _rotate_neighbours(x, angles)),
        ("every row turned by the same angles: multiply each pair's frequency by the row's position",
         _rotate_halves(x, inv_freq.expand_as(angles))),
        ("nothing was rotated", x),
        ("the angle is position * inv_freq, not position / inv_freq",
         _rotate_halves(x, positions[:, None].float() / inv_freq)),
    ]
    verdict = compare("rotation", out, expected, mistakes, atol=1e-4)
    scaled = (verdict.mistake or "").startswith("wrong scale")
    if verdict.ok or (verdict.mistake is not None and not scaled) or not isinstance(out, torch.Tensor) \
            or out.shape != x.shape:
        return verdict
    out = out.detach().cpu()
    if _keeps_lengths(out, x, "halves"):
        message = "it is a rotation of the right pairs, by other angles than position * inv_freq[i]"
        return named(f"{verdict.message.removeprefix('rotation: ')}; {message}", "rotation")
    if _keeps_lengths(out, x, "neighbours"):  # a rotation, of the wrong pairs (in any direction, by any angles)
        return named(neighbours, "rotation")
    also = "a rotation keeps each pair's length and yours does not"
    return Verdict(False, f"{verdict.message}; also, {also}", mistake=verdict.mistake or also)


# --- YaRN ---------------------------------------------------------------------------------------------------------

DEEPSEEK_V3_ROPE = dict(rope_theta=10_000.0, rope_factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, max_position_embeddings=163_840)
"""DeepSeek-V3's rotary settings (its config.json): beta_fast 32 makes the ramp between the kept and the divided
frequencies a real ramp (pairs 10..23), where K2's beta_fast 1 makes it a step (pairs 19 | 20)."""
# DeepSeek-V2-Lite's (its config.json): V3's ramp, and a YaRN temperature taken with mscale = mscale_all_dim = 0.707,
# so that m = 0.1 * 0.707 * ln(40) + 1 (an m that ignores mscale_all_dim shows).
DEEPSEEK_V2_LITE_ROPE = DEEPSEEK_V3_ROPE | dict(mscale=0.707, mscale_all_dim=0.707)
# Not a released config: K2's theta and factor with V3's beta_fast 32, so that d(beta_fast) = 8.91 (a fraction of .5
# or more: rounding goes up where floor goes down) and d(beta_slow) = 19.16 (rounding goes down where ceil goes up),
# and mscale 0.8 beside mscale_all_dim 0.6, so that an m taken from mscale (or from neither) shows.
ROUNDING_ROPE = dict(beta_fast=32.0, beta_slow=1.0, mscale=0.8, mscale_all_dim=0.6)


def _yarn_mistakes(cfg: K2Config) -> list[tuple[str, torch.Tensor]]:
    """The usual wrong inverse frequencies for ``cfg``, each with what went wrong."""
    R, f = cfg.qk_rope_head_dim, cfg.rope_factor
    base = 1.0 / cfg.rope_theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)  # [R/2] plain RoPE
    pairs = torch.arange(R // 2, dtype=torch.float64)
    low, high = yarn_correction_range(cfg)
    width = max(high - low, 1e-3)

    def blend(ramp: torch.Tensor) -> torch.Tensor:  # ramp 1: divided by the factor; 0: kept
        return base / f * ramp + base * (1 - ramp)

    def exact(beta: float) -> float:
        return yarn_correction_dim(beta, R, cfg.rope_theta, cfg.original_max_position_embeddings)

    def without_two_pi(beta: float) -> float:  # d(beta) with turns counted as radians: L / beta, not L / (2 pi beta)
        return exact(beta / (2 * math.pi))

    no_pi_low, no_pi_high = max(math.floor(without_two_pi(cfg.beta_fast)), 0), math.ceil(without_two_pi(cfg.beta_slow))
    no_pi_width = max(no_pi_high - no_pi_low, 1e-3)
    swapped = cfg.replace(beta_fast=cfg.beta_slow, beta_slow=cfg.beta_fast)
    rounded_low, rounded_high = max(round(exact(cfg.beta_fast)), 0), min(round(exact(cfg.beta_slow)), R - 1)
    rounded_width = max(rounded_high - rounded_low, 1e-3)
    return [
        ("you rounded the correction range to the nearest integer; it is rounded OUTWARDS: low = "
         "floor(d(beta_fast)), high = ceil(d(beta_slow))",
         blend(((pairs - rounded_low) / rounded_width).clamp(0, 1))),
        ("d(beta) counts turns, and one turn is 2 pi radians: pair i's wavelength is 2 pi / theta_i positions, so "
         "d(beta) = R ln(L / (2 pi beta)) / (2 ln theta); you left out the 2 pi",
         blend(((pairs - no_pi_low) / no_pi_width).clamp(0, 1))),
        ("plain RoPE: YaRN divides the slow pairs' frequencies by the factor", base),
        ("you divided every frequency by the factor: that is position interpolation; YaRN keeps the fast pairs",
         base / f),
        ("your ramp runs the wrong way: pairs below the correction range keep their frequency (ramp 0), pairs above "
         "it are divided by the factor (ramp 1)", blend(1 - ((pairs - low) / width).clamp(0, 1))),
        ("you swapped beta_fast and beta_slow: low = floor(d(beta_fast)), high = ceil(d(beta_slow))",
         blend(yarn_ramp(swapped).double())),
        ("you indexed the ramp by dimension (0, 2, 4, ...); it runs over the pair index i = 0 .. R/2 - 1",
         blend(((2 * pairs - low) / width).clamp(0, 1))),
        ("you forgot to clamp the ramp to [0, 1]", blend((pairs - low) / width)),
        ("the correction range is rounded outwards: low = floor(d(beta_fast)), high = ceil(d(beta_slow))",
         blend(((pairs - exact(cfg.beta_fast)) / max(exact(cfg.beta_slow) - exact(cfg.beta_fast), 1e-3)).clamp(0, 1))),
        ("you made the ramp a step at high; between low and high it is linear",
         blend((pairs >= high).double())),
    ]


def _scale_mistakes(cfg: K2Config) -> list[tuple[str, float]]:
    """The usual wrong softmax scales for ``cfg``; those that this config cannot tell from the right one (m taken
    from mscale where mscale equals mscale_all_dim, say) are left out, so that no other slip is given their reason."""
    qk, m = cfg.qk_head_dim, yarn_get_mscale(cfg.rope_factor, cfg.mscale_all_dim)
    absorbed = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    from_mscale = yarn_get_mscale(cfg.rope_factor, cfg.mscale)
    slips = [
        ("you forgot YaRN's m: the scale is (N + R)^-1/2 * m^2", qk**-0.5),
        ("m goes in squared: q and k are each multiplied by m, so their product by m^2", qk**-0.5 * m),
        ("the head width is N + R (content and rotary parts): scale by (N + R)^-1/2, not N^-1/2",
         cfg.qk_nope_head_dim**-0.5 * m**2),
        (f"the scale stays (N + R)^-1/2 = {qk}^-1/2, even where the absorbed keys are C + R = {absorbed} wide",
         absorbed**-0.5 * m**2),
        ("you divided by m^2; YaRN multiplies the logits by m^2", qk**-0.5 / m**2),
    ]
    if cfg.mscale_all_dim != 1.0:
        slips.append((f"you ignored mscale_all_dim: m = 0.1 * mscale_all_dim * ln(factor) + 1, and mscale_all_dim is "
                      f"{cfg.mscale_all_dim:g} here", qk**-0.5 * yarn_get_mscale(cfg.rope_factor, 1.0) ** 2))
    if cfg.mscale != cfg.mscale_all_dim:
        slips += [
            (f"you took m from mscale ({cfg.mscale:g}); the softmax's temperature takes mscale_all_dim "
             f"({cfg.mscale_all_dim:g}): m = 0.1 * mscale_all_dim * ln(factor) + 1 (mscale goes into the factor on "
             f"cos and sin, m(mscale) / m(mscale_all_dim))", qk**-0.5 * from_mscale**2),
            ("you used m(mscale) / m(mscale_all_dim), the factor on cos and sin; the softmax scale takes "
             "m = m(mscale_all_dim), squared", qk**-0.5 * (from_mscale / m) ** 2),
        ]
    return slips


@checker
def check_yarn_frequencies(fn: Callable) -> Verdict:
    """``fn(cfg: K2Config) -> (inv_freq [R/2], softmax_scale: float)``: YaRN's rotary frequencies and the softmax
    scale, against ``k2lab.model.rope`` and ``K2Config.softmax_scale``, for K2's config, DeepSeek-V3's
    (``DEEPSEEK_V3_ROPE``: a real ramp), DeepSeek-V2-Lite's (``DEEPSEEK_V2_LITE_ROPE``: mscale_all_dim 0.707) and a
    made-up one (``ROUNDING_ROPE`` on K2: d(beta) with fractions on both sides of .5, mscale unlike mscale_all_dim).

    With d(beta) = R ln(L / (2 pi beta)) / (2 ln theta) (L the original context), the correction range is
    low = floor(d(beta_fast)), high = ceil(d(beta_slow)); the ramp r_i = clamp((i - low) / (high - low), 0, 1) over the
    pair index i; inv_freq_i = base_i / factor * r_i + base_i * (1 - r_i) with base_i = theta^(-2i/R). The scale is
    (N + R)^-1/2 * m^2 with m = 0.1 * mscale_all_dim * ln(factor) + 1."""
    configs = [("K2", K2Config.kimi_k2()), ("DeepSeek-V3", K2Config.kimi_k2().replace(**DEEPSEEK_V3_ROPE)),
               ("DeepSeek-V2-Lite", K2Config.kimi_k2().replace(**DEEPSEEK_V2_LITE_ROPE)),
               ("a made-up config (K2 with beta_fast 32, mscale 0.8, mscale_all_dim 0.6)",
                K2Config.kimi_k2().replace(**ROUNDING_ROPE))]
    own = {inverse_frequencies: "inverse_frequencies", yarn_ramp: "yarn_ramp",
           K2Config.softmax_scale: "K2Config.softmax_scale", K2Config.yarn_mscale: "K2Config.yarn_mscale"}
    for name, cfg in configs:
        out, error = call(fn, cfg, own=own)
        if error is not None:
            return error
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            return named("return two things, (inv_freq [R/2], softmax_scale)", name)
        inv_freq, scale = out
        low, high = yarn_correction_range(cfg)
        verdict = compare(f"{name}'s inverse frequencies", inv_freq, inverse_frequencies(cfg).double(),
                          _yarn_mistakes(cfg), atol=1e-12, rtol=1e-5, axes={0: "pairs"})
        if (verdict.mistake or "").startswith("yours is right at pairs"):
            verdict = named(f"{verdict.mistake} (here low = {low}, high = {high}: pairs up to low keep their "
                            f"frequency, pairs from high on are divided by the factor, the ramp (i - low) / (high - "
                            f"low) blends those between)", f"{name}'s inverse frequencies")
        if not verdict.ok:
            return verdict
        try:
            scale = float(scale)
        except (TypeError, ValueError, RuntimeError):
            return named(f"return one number, got a {type(scale).__name__}", f"{name}'s softmax scale")
        verdict = compare(f"{name}'s softmax scale", torch.tensor(scale, dtype=torch.float64),
                          torch.tensor(cfg.softmax_scale, dtype=torch.float64),
                          [(message, torch.tensor(value)) for message, value in _scale_mistakes(cfg)],
                          atol=0, rtol=1e-6)
        if not verdict.ok and verdict.mistake is None and scale > 0:
            implied = (scale * cfg.qk_head_dim**0.5) ** 0.5  # the m of a scale (N + R)^-1/2 * m^2
            return named(f"yours is (N + R)^-1/2 * m^2 with m = {implied:.6g}; YaRN's temperature is m = 0.1 * "
                         f"mscale_all_dim * ln(factor) + 1 = {cfg.yarn_mscale:.6g}", f"{name}'s softmax scale")
        if not verdict.ok:
            return verdict
    k2, v3 = (yarn_correction_range(cfg) for _, cfg in configs[:2])
    return Verdict(True, f"YaRN: frequencies and softmax scale match k2lab for K2 (range {k2}, a step), "
                         f"DeepSeek-V3 (range {v3}, a ramp), DeepSeek-V2-Lite (m from mscale_all_dim 0.707) and a "
                         f"made-up config whose range rounds outwards; K2's scale {configs[0][1].softmax_scale:.8f}")
