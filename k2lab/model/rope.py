"""YaRN: the rotary frequencies of Kimi K2 (DeepSeek-V3), computed once when the model is built.

K2 stretches a 4,096-token RoPE to 131,072 positions. YaRN keeps the fast-rotating frequency pairs (which
complete many turns inside the original context and so are already well trained) and divides the slow ones by
the stretch factor; a linear ramp joins the two. For K2's settings the ramp is a step: pairs 0..19 keep their
frequency, pairs 20..31 are divided by 32.

The model turns these frequencies into cos and sin per position (``K2Model.rotary_and_mask``), and attention
rotates the rotary part of its queries and keys with them (``attention.apply_rotary``).
"""

from __future__ import annotations

import math

import torch

from ..config import K2Config, yarn_get_mscale


def yarn_correction_dim(num_rotations: float, dim: int, base: float, original_max_pos: int) -> float:
    """The (fractional) pair index whose wavelength fits ``num_rotations`` turns into the original context."""
    return dim * math.log(original_max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(cfg: K2Config) -> tuple[int, int]:
    """Pair indices (low, high) between which YaRN ramps from 'keep' to 'divide by factor'. K2: (19, 20)."""
    dim, base, orig = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.original_max_position_embeddings
    low = math.floor(yarn_correction_dim(cfg.beta_fast, dim, base, orig))
    high = math.ceil(yarn_correction_dim(cfg.beta_slow, dim, base, orig))
    return max(low, 0), min(high, dim - 1)


def yarn_ramp(cfg: K2Config) -> torch.Tensor:
    """Per pair, the share of the interpolated (divided) frequency: 0 keeps the original, 1 divides fully. [R/2]"""
    low, high = yarn_correction_range(cfg)
    high = high + 0.001 if low == high else high  # avoid a zero-width ramp
    pairs = torch.arange(cfg.qk_rope_head_dim // 2, dtype=torch.float32, device="cpu")
    return ((pairs - low) / (high - low)).clamp(0, 1)


def inverse_frequencies(cfg: K2Config) -> torch.Tensor:
    """Angular frequency of each rotary pair, in radians per position. [R/2] (32 for K2)"""
    dim = cfg.qk_rope_head_dim
    base_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)  # [R/2]
    if cfg.rope_type != "yarn":
        return base_freq
    ramp = yarn_ramp(cfg)
    return base_freq / cfg.rope_factor * ramp + base_freq * (1 - ramp)


def cos_sin_scale(cfg: K2Config) -> float:
    """Factor on cos and sin: mscale(f, mscale) / mscale(f, mscale_all_dim); exactly 1.0 for K2."""
    if cfg.rope_type != "yarn":
        return 1.0
    return yarn_get_mscale(cfg.rope_factor, cfg.mscale) / yarn_get_mscale(cfg.rope_factor, cfg.mscale_all_dim)
