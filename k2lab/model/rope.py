"""Rotary position embedding with YaRN frequency scaling, as Kimi K2 (DeepSeek-V3) releases it.

K2 stretches a 4,096-token RoPE to 131,072 positions. YaRN keeps the fast-rotating frequency pairs (which
complete many turns inside the original context and so are already well trained) and divides the slow ones by
the stretch factor; a linear ramp joins the two. For K2's settings the ramp is a step: pairs 0..19 keep their
frequency, pairs 20..31 are divided by 32.
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


class RotaryEmbedding:
    """Holds the YaRN frequencies (computed once) and rotates the rotary part of queries and keys. No weights.

    The checkpoint stores each head's 64 rotary features as interleaved pairs (x0, x1), (x2, x3), ...
    ``rotate`` de-interleaves them (evens first, then odds) and applies the usual rotate-half rotation, which is
    the released layout bit for bit. With ``rope_interleave=False`` the features are already split in halves.
    """

    def __init__(self, cfg: K2Config):
        self.interleaved = cfg.rope_interleave
        self.scale = cos_sin_scale(cfg)
        # Computed once on the CPU; copied once to each device it is used on. Not a module buffer, so a
        # model built on the meta device or loaded with assign=True never holds an uninitialised table.
        self.inv_freq = inverse_frequencies(cfg)  # [R/2]
        self._on_device = {self.inv_freq.device: self.inv_freq}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for integer positions [T] -> two [T, R] tensors (float32, each pair's angle twice)."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            with torch.inference_mode(False):  # kept: an ordinary tensor even when first made in inference mode
                inv_freq = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, R/2]
        angles = torch.cat((angles, angles), dim=-1)  # [T, R]
        return angles.cos() * self.scale, angles.sin() * self.scale

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [..., R] by cos/sin that broadcast to it ([T, 1, R] for [B, T, H, R]; [T, R] for [B, T, R])."""
        if self.interleaved:  # (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...)
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        half = x.shape[-1] // 2
        rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos.to(x.dtype) + rotated_half * sin.to(x.dtype)).to(x.dtype)
