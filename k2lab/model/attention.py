"""Multi-head latent attention (MLA), naive and absorbed, and the latent KV cache.

Shapes: B batch, T new positions, S all key positions (cache + new), H heads, D model width,
C = kv_lora_rank (512), R = qk_rope_head_dim (64), N = qk_nope_head_dim (128), V = v_head_dim (128).

Every token writes only two things to the cache: the normalised key-value latent c_KV [C] and ONE rotated
rotary key k_pe [R] shared by all heads: 576 values per token per layer for K2.

- naive: expand c_KV through kv_b_proj into per-head keys [N] and values [V] for the whole context, then
  ordinary attention over 192-wide keys (what HF transformers does, also at every decode step).
- absorbed: fold W_UK (kv_b_proj's key rows) into the query and W_UV (its value rows) into the output, so
  attention runs directly over the cached latents, as one multi-query attention with 576-wide keys and
  512-wide values. Nothing is expanded; decode reads the cache once.
Both give the same scores, pattern and per-head output z (hook_z) to float32 rounding, and fire the same probes.
- auto (the default): whichever of the two is faster for the call's shape (see ``choose_attn_impl``).

The naive path states attention as the maths does, softmax(q k^T * scale + mask) v, whenever a probe reads the
scores or the pattern, or the speed rooms are off (``K2Model.speed``); otherwise it hands q, k and v to PyTorch's fused
kernel (speed room ``speed/fused_attention.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..config import K2Config
from .layers import HookPoint, Linear, RMSNorm
from .speed.fused_attention import fused_attention, max_logit

AttnImpl = Literal["auto", "naive", "absorbed"]
"""The attention path a forward may ask for: "naive" (every head's keys and values expanded from the latent by
kv_b_proj), "absorbed" (kv_b_proj folded into the queries and the output: scores and values read the latent itself), or
"auto" (``choose_attn_impl`` picks the faster for the numbers of new and cached tokens)."""
ATTN_IMPLS = ("auto", "naive", "absorbed")


def choose_attn_impl(attn_impl: AttnImpl, num_new: int, num_cached: int, kv_lora_rank: int) -> str:
    """The path that runs for ``num_new`` new tokens after ``num_cached`` cached ones: ``attn_impl`` itself,
    or for "auto" the faster one for this shape.

    The naive path expands all S = num_cached + num_new positions through kv_b_proj (one large GEMM) and then
    runs the fused SDPA kernel over 192-wide keys; the absorbed path expands nothing but attends with
    576-wide keys and 512-wide values (K2), about three times the attention FLOPs per (query, key) pair. So:
    - no cache to reuse (prefill, training): naive, whose expansion covers only the new tokens anyway;
    - few new tokens over a cached context (decode, short chunks): absorbed, which reads the cache once
      instead of expanding it all every step;
    - many new tokens over a cache (chunked prefill): naive once the new tokens' extra attention work outweighs
      expanding the cache, measured at num_new > kv_lora_rank / 4 (docs/speed.md).
    """
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
    if attn_impl != "auto":
        return attn_impl
    return "absorbed" if num_cached > 0 and num_new <= kv_lora_rank // 4 else "naive"


class LatentCache:
    """The latent KV cache: per layer, [B, S, C + R] = c_KV (512) then rotated k_pe (64) for every token.

    Passed to the model's forward (state is explicit). Storage grows by doubling, so appending a decode step
    writes 576 values per layer instead of copying the context. ``capacity`` reserves storage for that many
    positions up front: a compiled decode step then never grows it inside its graph (``k2lab.generate`` reserves
    the prompt plus the new tokens).
    """

    def __init__(self, cfg: K2Config, batch_size: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | Sequence[torch.device | str] = "cpu", num_layers: int | None = None,
                 capacity: int = 0):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a whole number of rows >= 1, got {batch_size!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be a whole number of positions >= 0, got {capacity!r}")
        self.kv_lora_rank = cfg.kv_lora_rank
        self.width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.batch_size = batch_size
        num_layers = num_layers if num_layers is not None else cfg.num_hidden_layers
        # One device for all layers, or one per layer when a device_map spreads the blocks.
        devices = [device] * num_layers if isinstance(device, (str, torch.device)) else list(device)
        self.dtype, self.device = dtype, torch.device(devices[0])
        self.max_positions = cfg.max_position_embeddings
        self.length = 0  # positions already cached; new tokens continue from here
        self.token_mask: torch.Tensor | None = None  # [B, >= length] bool: real tokens (not pads); None: all real
        self.num_layers = num_layers
        self._buffers: list[torch.Tensor] = [self._storage(min(capacity, self.max_positions), d) for d in devices]

    def _storage(self, positions: int, device: torch.device | str) -> torch.Tensor:
        """An empty buffer [B, positions, C + R]. Always an ordinary tensor, also when made in inference mode (as
        ``k2lab.generate`` runs), so that the cache can be written to in either mode afterwards."""
        with torch.inference_mode(False):
            return torch.empty(self.batch_size, positions, self.width, dtype=self.dtype, device=device)

    @property
    def storage(self) -> list[torch.Tensor]:
        """Each layer's whole reserved buffer [B, capacity, C + R], unwritten positions included: what a static
        decode step (model/speed/static_decode.py) writes in place and a CUDA graph replays over."""
        return list(self._buffers)

    @property
    def nbytes(self) -> int:
        """Bytes of the latents held for the cached positions (what a decode step must read)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return len(self._buffers) * self.batch_size * self.length * self.width * itemsize

    def append(self, layer: int, entries: torch.Tensor) -> torch.Tensor:
        """Write the new tokens' entries [B, T, C + R] (latent, then rotated key) after the cached ones; return
        all positions' entries [B, S, C + R]: a view of the buffer whose rows are contiguous, which matmuls read
        in place."""
        buf = self._buffers[layer]
        start, end = self.length, self.length + entries.shape[1]
        if end > buf.shape[1]:  # grow by doubling
            grown = self._storage(max(end, 2 * buf.shape[1]), buf.device)
            grown[:, :start] = buf[:, :start]
            self._buffers[layer] = buf = grown
        buf[:, start:end] = entries
        return buf[:, :end]

    def key_mask(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """Record which new positions hold real tokens ([B, T] bool) -> which of all S key positions do [B, S]."""
        cached = (self.token_mask[:, : self.length] if self.token_mask is not None
                  else new_tokens.new_ones(self.batch_size, self.length))
        with torch.inference_mode(False):  # kept across calls: an ordinary tensor, whatever mode this call runs in
            self.token_mask = torch.cat([cached.to(new_tokens.device), new_tokens], dim=1)
        return self.token_mask

    def latents(self, layer: int) -> torch.Tensor:
        """The cached [B, length, C + R] entries of one layer."""
        return self._buffers[layer][:, : self.length]

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (to re-decode, branch or time a step repeatedly)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length {length} must lie in 0..{self.length}")
        self.length = length

    def advance(self, num_tokens: int) -> None:
        """Called by the model once every layer has written ``num_tokens`` new positions."""
        self.length += num_tokens

    def __repr__(self) -> str:
        return (f"LatentCache(batch={self.batch_size}, length={self.length}, layers={len(self._buffers)}, "
                f"{self.width} values/token/layer, {self.nbytes:,} bytes)")


def causal_mask(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """[T, S] True where query t (at position S - T + t) may see key s."""
    return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(num_keys - num_queries)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [..., R] by the angles whose cos and sin broadcast to it ([T, 1, R] for [B, T, H, R]; [T, R] for
    [B, T, R]). The checkpoint stores each head's rotary features as interleaved pairs (x0, x1), (x2, x3), ...:
    ``interleaved`` de-interleaves them (evens first, then odds) before the rotate-half rotation, which is the
    released layout bit for bit."""
    if interleaved:  # (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...)
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.to(x) + rotated_half * sin.to(x)).to(x.dtype)  # cos and sin follow x: its dtype, its device


class MultiHeadLatentAttention(nn.Module):
    """MLA as released. Module and parameter names mirror the checkpoint (``self_attn.q_a_proj`` ...)."""

    speed = True  # K2Model.speed: False writes the naive path's softmax out, as a probe on the scores does

    def __init__(self, cfg: K2Config):
        super().__init__()
        self.num_heads, self.nope_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.softmax_scale, self.q_lora_rank = cfg.softmax_scale, cfg.q_lora_rank
        self.interleaved = cfg.rope_interleave  # the checkpoint's rotary layout (apply_rotary)
        qk_dim, H = cfg.qk_head_dim, cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, H * qk_dim)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * qk_dim)
            self.hook_q_latent = HookPoint()  # [B, T, q_lora_rank] c_Q after its norm (only with a q latent)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = Linear(H * cfg.v_head_dim, cfg.hidden_size)

        self.hook_kv_latent = HookPoint()  # [B, T, C] c_KV after its norm: what the cache stores
        self.hook_q_nope = HookPoint()  # [B, T, H, N]
        self.hook_q_pe = HookPoint()  # [B, T, H, R] before rotation
        self.hook_rot_q_pe = HookPoint()  # [B, T, H, R] rotated
        self.hook_k_pe = HookPoint()  # [B, T, R] the one shared rotary key, before rotation
        self.hook_rot_k_pe = HookPoint()  # [B, T, R] rotated: what the cache stores
        self.hook_attn_scores = HookPoint()  # [B, H, T, S] scaled, masked pre-softmax logits (only when probed)
        # [B, H] each head's largest scaled logit over the positions it may see, detached: what QK-Clip watches.
        # Computed only when probed, without leaving the fused kernel; read-only (nothing downstream uses it).
        self.hook_max_logit = HookPoint()
        self.hook_max_logit.read_only = "hook_attn_scores"  # the scores it is the maximum of
        self.hook_pattern = HookPoint()  # [B, H, T, S] softmax of the scores (only when probed)
        self.hook_z = HookPoint()  # [B, T, H, V] per-head output before o_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                layer: int = 0, attn_impl: AttnImpl = "auto", attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. cos/sin [T, R], or [B, T, R] when positions differ per row (padding).
        ``attn_mask`` [B, 1, T, S] bool, True where a query may see a key; None: plain causal, over T == S positions
        or for one query (``inputs.prepare_inputs`` makes it)."""
        B, T, _ = x.shape
        impl = choose_attn_impl(attn_impl, T, cache.length if cache is not None else 0, self.kv_lora_rank)
        if self.q_lora_rank is None:
            q = self.q_proj(x)  # [B, T, H*(N+R)]
        else:
            q = self.q_b_proj(self.hook_q_latent(self.q_a_layernorm(self.q_a_proj(x))))  # through c_Q
        q = q.view(B, T, self.num_heads, self.nope_dim + self.rope_dim)  # [B, T, H, N+R]
        q_nope = self.hook_q_nope(q[..., : self.nope_dim])  # [B, T, H, N]
        q_pe = self.hook_q_pe(q[..., self.nope_dim :])  # [B, T, H, R]
        q_pe = self.hook_rot_q_pe(apply_rotary(q_pe, cos.unsqueeze(-2), sin.unsqueeze(-2), self.interleaved))

        kv_a = self.kv_a_proj_with_mqa(x)  # [B, T, C + R]
        kv_latent = self.hook_kv_latent(self.kv_a_layernorm(kv_a[..., : self.kv_lora_rank]))  # [B, T, C]
        k_pe = self.hook_k_pe(kv_a[..., self.kv_lora_rank :])  # [B, T, R]
        k_pe = self.hook_rot_k_pe(apply_rotary(k_pe, cos, sin, self.interleaved))
        entries = torch.cat((kv_latent, k_pe), dim=-1)  # [B, T, C + R]: what the cache stores per token
        if cache is not None:
            entries = cache.append(layer, entries)  # [B, S, C + R]

        attend = self.naive if impl == "naive" else self.absorbed
        z = self.hook_z(attend(q_nope, q_pe, entries, attn_mask))  # [B, T, H, V]
        return self.o_proj(z.flatten(2))  # [B, T, D]

    def pattern(self, scores: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Scaled scores [B, H, T, S] -> the softmax pattern, through the score, max-logit and pattern probes.
        ``mask`` as ``forward`` takes it."""
        T, S = scores.shape[-2:]
        if mask is not None or T > 1:
            scores = scores.masked_fill(~(mask if mask is not None else causal_mask(T, S, scores.device)), -torch.inf)
        scores = self.hook_attn_scores(scores)
        if self.hook_max_logit.active:
            self.hook_max_logit(scores.detach().amax(dim=(-2, -1)))
        return self.hook_pattern(F.softmax(scores, dim=-1, dtype=torch.float32).to(dtype))

    def naive(self, q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor,
              attn_mask: torch.Tensor | None) -> torch.Tensor:
        """Expand the latents [B, S, C + R] to per-head keys and values for all S positions, then plain attention
        of the queries q_nope [B, T, H, N], q_pe [B, T, H, R] (rotated) -> z [B, T, H, V]."""
        B, T, H, _ = q_nope.shape
        S = entries.shape[1]
        kv_latent, k_pe = entries.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [B, S, C], [B, S, R]
        kv = self.kv_b_proj(kv_latent).view(B, S, H, self.nope_dim + self.v_dim)  # [B, S, H, N+V]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)  # [B, H, T, N+R]
        k_pe = k_pe[:, :, None].expand(B, S, H, self.rope_dim)  # the one rotary key, seen by every head
        k = torch.cat((k_nope, k_pe), dim=-1).transpose(1, 2)  # [B, H, S, N+R]
        v = v.transpose(1, 2)  # [B, H, S, V]
        if not self.speed or self.hook_attn_scores.active or self.hook_pattern.active:  # the maths, written out
            pattern = self.pattern(q @ k.transpose(-1, -2) * self.softmax_scale, attn_mask, q.dtype)  # [B, H, T, S]
            return (pattern @ v).transpose(1, 2)  # [B, T, H, V]
        if self.hook_max_logit.active:
            mask = attn_mask if attn_mask is not None else causal_mask(T, S, q.device)
            self.hook_max_logit(max_logit(q, k, self.softmax_scale, mask))  # [B, H]
        return fused_attention(q, k, v, self.softmax_scale, attn_mask)  # [B, T, H, V] (speed/fused_attention.py)

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor,
                 attn_mask: torch.Tensor | None) -> torch.Tensor:
        """Attention over the latents [B, S, C + R] themselves: W_UK (kv_b_proj's key rows) folds into the query,
        W_UV (its value rows) into the output, so nothing is expanded per head. The scores are one multi-query
        attention whose keys are the cache's rows [c_KV ; k_pe] and whose query per head is [W_UK^T q_nope ; q_pe]:

            q_nope . k_nope = q_nope . (W_UK c_KV) = (W_UK^T q_nope) . c_KV

        The scale stays 192^-1/2 (times YaRN's m^2): the scores are the naive path's, computed in another order."""
        B, T, H, _ = q_nope.shape
        C = self.kv_lora_rank
        w_uk, w_uv = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, C).split(
            [self.nope_dim, self.v_dim], dim=1)  # [H, N, C], [H, V, C]
        q_latent = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)  # [B, T, H, C] W_UK^T q_nope
        query = torch.cat((q_latent, q_pe), dim=-1) * self.softmax_scale  # [B, T, H, C+R], the scale on the queries
        scores = torch.einsum("bthc,bsc->bhts", query, entries)  # [B, H, T, S] scaled
        pattern = self.pattern(scores, attn_mask, q_nope.dtype)  # [B, H, T, S]
        out_latent = torch.einsum("bhts,bsc->bthc", pattern, entries[..., :C])  # [B, T, H, C] over the c_KV rows
        return torch.einsum("bthc,hvc->bthv", out_latent, w_uv)  # [B, T, H, V] through W_UV
