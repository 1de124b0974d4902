"""YaRN: the rotary frequencies of Kimi K2 (DeepSeek-V3), computed once when the model is built.

K2 stretches a 4,096-token RoPE to 131,072 positions. YaRN keeps the fast-rotating frequency pairs (which
complete many turns inside the original context and so are already well trained) and divides the slow ones by
the stretch factor; a linear ramp joins the two. For K2's settings the ramp is a step: pairs 0..19 keep their
frequency, pairs 20..31 are divided by 32.

``RotaryTable`` turns these frequencies into cos and sin per position, once per device: a forward reads the rows of
its tokens' positions (``inputs.prepare_inputs``), and attention rotates the rotary part of its queries and keys with
them (``attention.apply_rotary``).
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


class RotaryTable:
    """cos and sin of every position's rotary angles, [N, R] each, kept per device and grown by doubling as positions
    are asked for (DeepSeek-V3's reference precomputes the same table for its whole context at once):

        angle[p, i] = p * inv_freq[i mod R/2]         (rotate-half layout: pair i is (x_i, x_{i + R/2}))
        cos[p] = cos(angle[p]) * scale,  sin[p] = sin(angle[p]) * scale

    ``inv_freq`` [R/2] and ``scale`` as ``inverse_frequencies`` and ``cos_sin_scale`` give them for a config."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, max_positions: int):
        self.inv_freq, self.scale, self.max_positions = inv_freq, scale, max_positions  # [R/2] float32
        self.tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (cos, sin) [N, R]

    @classmethod
    def for_config(cls, cfg: K2Config) -> RotaryTable:
        """K2's (YaRN's) table for ``cfg``."""
        return cls(inverse_frequencies(cfg), cos_sin_scale(cfg), cfg.max_position_embeddings)

    def grow(self, device: torch.device, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The table on ``device``, made to hold at least ``positions`` rows if it holds fewer (twice what it held, up
        to the model's positions) -> (cos, sin) [N, R]. Ordinary tensors, also when first made in inference mode, so
        that a table first made in inference mode can be differentiated through later."""
        held = self.tables[device][0].shape[0] if device in self.tables else 0
        if held >= positions:
            return self.tables[device]
        rows = min(max(positions, 2 * held, 64), max(self.max_positions, positions))
        with torch.inference_mode(False):
            angles = torch.arange(rows, dtype=torch.float32, device=device)[:, None] * self.inv_freq.to(device)
            angles = torch.cat((angles, angles), dim=-1)  # [N, R]
            self.tables[device] = (angles.cos() * self.scale, angles.sin() * self.scale)
        return self.tables[device]
