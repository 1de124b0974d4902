"""The Kimi K2 language model: embedding, 61 pre-norm blocks (MLA + dense or MoE feed-forward), final norm,
untied head with float32 logits.

    x = embed(ids)
    for each block:  x = x + attn(rmsnorm(x));  x = x + ffn(rmsnorm(x))
    logits = lm_head(rmsnorm(x)).float()

Module paths mirror the checkpoint's tensor names without the leading ``model.``: the probe
``layers.3.self_attn.hook_kv_latent`` sits next to ``model.layers.3.self_attn.kv_a_proj_with_mqa.weight``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import K2Config
from .attention import AttnImpl, LatentCache, MultiHeadLatentAttention
from .hooks import HookedModule, HookPoint
from .moe import MoE, SwiGLU
from .norm import RMSNorm
from .rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    """One pre-norm block. Layer index < first_k_dense_replace: dense SwiGLU; otherwise MoE."""

    def __init__(self, cfg: K2Config, layer: int):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.hook_resid_pre = HookPoint()  # [B, T, D] block input
        self.hook_attn_out = HookPoint()  # [B, T, D] attention's write to the residual
        self.hook_resid_mid = HookPoint()  # [B, T, D] after attention
        self.hook_mlp_out = HookPoint()  # [B, T, D] feed-forward's write (routed + shared for MoE)
        self.hook_resid_post = HookPoint()  # [B, T, D] block output

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache | None, attn_impl: AttnImpl) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        attn = self.self_attn(self.input_layernorm(x), rope, cos, sin, cache, self.layer, attn_impl)
        x = self.hook_resid_mid(x + self.hook_attn_out(attn))
        return self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.post_attention_layernorm(x))))


class K2Model(HookedModule):
    """Kimi K2. ``model(ids)`` -> float32 logits [B, T, V].

    >>> model = K2Model(K2Config.mini())
    >>> cache = model.new_cache(batch_size=1)
    >>> logits = model(ids, cache=cache)           # prefill; then one token at a time
    """

    def __init__(self, cfg: K2Config, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.config = cfg
        with torch.device(device or "cpu"):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.embed_tokens.hook_out = HookPoint()  # [B, T, D] token embeddings
            self.rotary_emb = RotaryEmbedding(cfg)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.norm.hook_out = HookPoint()  # [B, T, D] final normalised residual
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.hook_logits = HookPoint()  # [B, T, V] float32
        if self.lm_head.weight.device.type != "meta":
            self.init_weights()
        if dtype is not None:
            self.to(dtype)
        self.name_hook_points()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """Random weights for demos and training: normal(0, std) matrices, unit norms, zero router bias."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.gate.e_score_correction_bias.zero_()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, batch_size: int = 1) -> LatentCache:
        """An empty latent KV cache for this model (576 values per token per layer for K2)."""
        devices = [layer.input_layernorm.weight.device for layer in self.layers]  # per block, for a device_map
        return LatentCache(self.config, batch_size, self.dtype, devices, num_layers=len(self.layers))

    def forward(self, input_ids: torch.Tensor, cache: LatentCache | None = None,
                attn_impl: AttnImpl = "auto") -> torch.Tensor:
        """input_ids [B, T] (int) -> logits [B, T, V] float32. With a cache, positions continue from
        ``cache.length`` and the new tokens' latents are appended to it."""
        x = self.last_hidden_state(input_ids, cache, attn_impl)  # [B, T, D]
        logits = self.hook_logits(self.lm_head(x.to(self.lm_head.weight.device)).float())  # [B, T, V]
        return logits.to(self.device)  # where the ids were sent, as if the model were on one device

    def last_hidden_state(self, input_ids: torch.Tensor, cache: LatentCache | None = None,
                          attn_impl: AttnImpl = "auto") -> torch.Tensor:
        """The forward up to the head: the final normalised residual [B, T, D] (``norm.hook_out``), which the
        head turns into logits. Training feeds it to the head chunk by chunk (``k2lab.loss``)."""
        ids = self._check_input(input_ids, cache)
        B, T = ids.shape
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + T, device=ids.device)
        cos, sin = self.rotary_emb.cos_sin(positions)  # [T, R] each, shared by every layer
        x = self.embed_tokens.hook_out(self.embed_tokens(ids))  # [B, T, D]
        for layer in self.layers:
            # With a device_map, blocks live on several devices: the residual (and the rotary table) follow them.
            device = layer.input_layernorm.weight.device
            x = layer(x.to(device), self.rotary_emb, cos.to(device), sin.to(device), cache, attn_impl)
        if cache is not None:
            cache.advance(T)
        return self.norm.hook_out(self.norm(x.to(self.norm.weight.device)))  # [B, T, D]

    def _check_input(self, input_ids: torch.Tensor, cache: LatentCache | None) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(
                f"input_ids must be integer token ids [B, T]; got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        B, T = input_ids.shape
        if T == 0:
            raise ValueError("input_ids is empty: at least one token is needed")
        vocab = self.config.vocab_size
        # Reading the ids back is a sync that torch.compile would break its graph on; compiled callers (the
        # training run) feed ids they sampled from the tokenizer's own stream.
        if not torch.compiler.is_compiling():
            lo, hi = input_ids.min().item(), input_ids.max().item()
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside the vocabulary of {vocab} (valid ids: 0..{vocab - 1})")
        start = cache.length if cache is not None else 0
        if start + T > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {start + T} positions ({start} cached + {T} new) exceeds "
                f"max_position_embeddings={self.config.max_position_embeddings}"
            )
        if cache is not None and cache.batch_size != B:
            raise ValueError(f"cache holds {cache.batch_size} rows but input_ids has {B}")
        return input_ids.to(self.device)
