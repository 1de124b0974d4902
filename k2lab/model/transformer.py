"""The Kimi K2 language model: embedding, 61 pre-norm blocks (MLA + dense or MoE feed-forward), final norm,
untied head with float32 logits.

    x = embed(ids)
    for each block:  x = x + attn(rmsnorm(x));  x = x + ffn(rmsnorm(x))
    logits = lm_head(rmsnorm(x)).float()

Module paths mirror the checkpoint's tensor names without the leading ``model.``: the probe
``layers.3.self_attn.hook_kv_latent`` sits next to ``model.layers.3.self_attn.kv_a_proj_with_mqa.weight``.

Padded batches: ``attention_mask`` [B, T] (1 = token, 0 = pad) hides pads from every query and gives them no
position, so a padded row's real positions get the logits of that row run alone (left or right padding; the
latent cache remembers which cached positions were pads across decode steps).

The model holds whatever tokenizer is attached as ``model.tokenizer`` (``k2lab.load`` attaches the checkpoint
folder's own); then text goes in wherever ids do: ``model("def f(")``, ``model.to_tokens(texts)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..config import K2Config
from .attention import AttnImpl, LatentCache, MultiHeadLatentAttention, causal_mask
from .hooks import HookedModule, HookPoint
from .linear import Linear
from .loss import head_cross_entropy
from .moe import MoE, SwiGLU
from .norm import RMSNorm
from .rope import RotaryEmbedding

if TYPE_CHECKING:
    from ..tokenizer.tokenizer import K2Tokenizer

ReturnType = Literal["logits", "loss", "both"]
TextOrIds = torch.Tensor | str | Sequence[str]


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
                cache: LatentCache | None, attn_impl: AttnImpl, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        attn = self.self_attn(self.input_layernorm(x), rope, cos, sin, cache, self.layer, attn_impl, attn_mask)
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
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
            self.hook_logits = HookPoint()  # [B, T, V] float32
        if self.lm_head.weight.device.type != "meta":
            self.init_weights()
        if dtype is not None:
            self.to(dtype)
        self.name_hook_points()
        self.tokenizer: K2Tokenizer | None = None  # whatever is attached; k2lab.load attaches the checkpoint's own
        self._running = False  # a forward is under way (a hook that runs the model again would recurse)

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
            if isinstance(layer.mlp, MoE) and layer.mlp.gate.e_score_correction_bias is not None:
                layer.mlp.gate.e_score_correction_bias.zero_()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, batch_size: int = 1, capacity: int = 0) -> LatentCache:
        """An empty latent KV cache for this model (576 values per token per layer for K2), with storage for
        ``capacity`` positions reserved (it grows past them by doubling)."""
        devices = [layer.input_layernorm.weight.device for layer in self.layers]  # per block, for a device_map
        return LatentCache(self.config, batch_size, self.dtype, devices, num_layers=len(self.layers),
                           capacity=capacity)

    def forward(self, input_ids: TextOrIds, cache: LatentCache | None = None, attn_impl: AttnImpl = "auto", *,
                attention_mask: torch.Tensor | None = None, return_type: ReturnType = "logits",
                loss_per_token: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] (int), or text (a string, or a list of strings left-padded into a batch) through
        ``model.tokenizer`` -> by ``return_type``:

        - ``"logits"``: float32 logits [B, T, V];
        - ``"loss"``: the mean next-token cross-entropy in nats over the positions whose token and next token are
          both real (``attention_mask``); computed chunk by chunk from the final hidden states, as in training,
          so the [B, T, V] logits are never held (unless ``hook_logits`` is probed or ``loss_per_token``);
        - ``"both"``: (logits, loss).

        ``loss_per_token=True`` makes the loss [B, T - 1]: position t scores token t + 1, 0 where excluded.
        ``attention_mask`` [B, T]: 1 for a token, 0 for a pad (see the module docstring). With a cache, positions
        continue from what it holds and the new tokens' latents are appended to it. Under no_grad with nothing
        observing the model, the blocks run in inference mode (``last_hidden_state``); what is returned is ordinary.
        """
        if return_type not in ("logits", "loss", "both"):
            raise ValueError(f"return_type must be 'logits', 'loss' or 'both', got {return_type!r}")
        if loss_per_token and return_type == "logits":
            raise ValueError("loss_per_token=True asks for a loss: use return_type='loss' or 'both'")
        ids, attention_mask = self._ids_and_mask(input_ids, attention_mask)
        x = self.last_hidden_state(ids, cache, attn_impl, attention_mask=attention_mask)  # [B, T, D]
        if return_type == "logits":
            return self._logits(x)
        if ids.shape[1] < 2:
            raise ValueError(f"a next-token loss needs at least 2 tokens per row; got {ids.shape[1]}")
        targets = ids[:, 1:].to(x.device)  # [B, T-1]
        scored = torch.ones_like(targets, dtype=torch.bool)  # [B, T-1] token and target both real
        if attention_mask is not None:
            scored = (attention_mask[:, 1:] & attention_mask[:, :-1]).to(x.device)
            if not torch.compiler.is_compiling() and not scored.any():
                raise ValueError("no position has both a real token and a real next token (attention_mask)")
        logits = None
        if return_type == "both" or loss_per_token or self.hook_logits.active or not isinstance(self.lm_head,
                                                                                               nn.Linear):
            logits = self._logits(x)
            per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1).to(x.device), targets.flatten(),
                                        reduction="none").view_as(targets) * scored  # [B, T-1]
            loss = per_token if loss_per_token else per_token.sum() / scored.sum().clamp(min=1)
        else:
            weight = self.lm_head.weight
            hidden, targets = x[:, :-1].flatten(0, 1), targets.flatten()  # [N, D], [N]
            if attention_mask is not None:  # the scored positions only
                hidden, targets = hidden[scored.flatten()], targets[scored.flatten()]
            loss = head_cross_entropy(hidden.to(weight.device), weight, targets.to(weight.device)).to(self.device)
        return loss if logits is None or return_type == "loss" else (logits, loss)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.hook_logits(self.lm_head(x.to(self.lm_head.weight.device)).float())  # [B, T, V]
        return logits.to(self.device)  # where the ids were sent, as if the model were on one device

    def last_hidden_state(self, input_ids: torch.Tensor, cache: LatentCache | None = None,
                          attn_impl: AttnImpl = "auto", *, attention_mask: torch.Tensor | None = None
                          ) -> torch.Tensor:
        """The forward up to the head: the final normalised residual [B, T, D] (``norm.hook_out``), which the
        head turns into logits. Training feeds it to the head chunk by chunk (``k2lab.model.loss``).

        Under no_grad, when nothing observes the model (``is_observed``), the blocks run in inference mode, which
        also skips the bookkeeping that no_grad keeps on every op (version counters, a record of each view; docs/
        speed.md, "Inference mode"). The same arithmetic: the result is equal bit for bit, and it is copied out
        as an ordinary tensor, as is all that the cache keeps."""
        if torch.compiler.is_compiling():  # a compiled training step: no hook runs the model inside it
            return self._hidden(input_ids, cache, attn_impl, attention_mask)
        if self._running:
            raise RuntimeError("the model was called while its own forward is running, from a hook: every hook "
                               "fires again in the inner forward, so this would recurse without end. Record what "
                               "you need first (run_with_cache), then run the edited forward")
        self._running = True
        try:
            # Grad mode first: a training step never pays for the walk over the modules.
            if torch.is_grad_enabled() or torch.is_inference_mode_enabled() or self.is_observed():
                return self._hidden(input_ids, cache, attn_impl, attention_mask)
            with torch.inference_mode():
                hidden = self._hidden(input_ids, cache, attn_impl, attention_mask)
            return hidden.clone()  # outside inference mode: an ordinary tensor, which autograd may save later
        finally:
            self._running = False

    def _hidden(self, input_ids: torch.Tensor, cache: LatentCache | None, attn_impl: AttnImpl,
                attention_mask: torch.Tensor | None) -> torch.Tensor:
        ids = self._check_input(input_ids, cache)
        cos, sin, attn_mask = rotary_and_mask(self.rotary_emb, attention_mask, cache, *ids.shape, ids.device)
        x = self.embed_tokens.hook_out(self.embed_tokens(ids))  # [B, T, D]
        for layer in self.layers:
            # With a device_map, blocks live on several devices: the residual (and the rotary table) follow them.
            device = layer.input_layernorm.weight.device
            mask = attn_mask.to(device) if attn_mask is not None else None
            x = layer(x.to(device), self.rotary_emb, cos.to(device), sin.to(device), cache, attn_impl, mask)
        if cache is not None:
            cache.advance(ids.shape[1])
        return self.norm.hook_out(self.norm(x.to(self.norm.weight.device)))  # [B, T, D]

    # ---- text -------------------------------------------------------------------------------------------------------
    def _require_tokenizer(self, what: str) -> K2Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer and this model has none attached. Attach one with "
                             "model.tokenizer = k2lab.load_tokenizer(path_or_repo_id) (k2lab.load attaches it by "
                             "itself when the checkpoint folder holds tiktoken.model and tokenizer_config.json), "
                             "or pass token ids")
        return self.tokenizer

    def to_tokens(self, text: str | Sequence[str], padding_side: Literal["left", "right"] = "left",
                  return_mask: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Text -> ids [1, T] (one string) or [B, T] (a list, padded on ``padding_side``), on the model's device;
        with ``return_mask`` also the attention mask [B, T] (1 = token, 0 = pad). No BOS is added (K2 adds none)."""
        tok = self._require_tokenizer("to_tokens")
        if isinstance(text, str):
            ids = torch.tensor([tok.encode(text)], dtype=torch.long)
            mask = torch.ones_like(ids)
        else:
            ids, mask = tok.encode_padded(list(text), padding_side=padding_side)
        ids, mask = ids.to(self.device), mask.to(self.device)
        return (ids, mask) if return_mask else ids

    def to_str_tokens(self, text_or_ids: str | torch.Tensor | Sequence[int]) -> list[str] | list[list[str]]:
        """Each token as readable text (bytes that are not whole characters as <0xNN>): a list for a string or a
        [T] / [1, T] row of ids, a list of lists for a [B, T] batch."""
        tok = self._require_tokenizer("to_str_tokens")
        ids = tok.encode(text_or_ids) if isinstance(text_or_ids, str) else torch.as_tensor(text_or_ids).tolist()
        if ids and isinstance(ids[0], list):
            rows = [[tok.id_to_piece(i) for i in row] for row in ids]
            return rows[0] if len(rows) == 1 else rows
        return [tok.id_to_piece(i) for i in ids]

    def _ids_and_mask(self, input_ids: TextOrIds, attention_mask: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Text through the tokenizer (a list left-padded, with its mask); ids and the given mask as they are."""
        if not is_text(input_ids):
            try:
                ids = torch.as_tensor(input_ids)
            except (TypeError, ValueError, RuntimeError):
                return input_ids, None  # not ids at all: _check_input names the problem
            ids = ids[None] if ids.dim() == 1 else ids
            if attention_mask is None or ids.dim() != 2:  # bad ids are named by _check_input
                return ids, None
            return ids, check_attention_mask(attention_mask, *ids.shape)
        if attention_mask is not None:
            raise ValueError("attention_mask is made by the tokenizer for text input; pass ids to give your own")
        self._require_tokenizer("text input")
        ids, mask = self.to_tokens(input_ids, return_mask=True)
        return ids, (None if bool(mask.all()) else mask.bool())

    def _check_input(self, input_ids: torch.Tensor, cache: LatentCache | None) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            try:
                input_ids = torch.as_tensor(input_ids)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(f"input_ids must be integer token ids [B, T] (a tensor or nested lists of int), got "
                                f"{type(input_ids).__name__} {str(input_ids)[:60]}") from None
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex \
                or input_ids.dtype == torch.bool:
            raise ValueError(
                f"input_ids must be integer token ids [B, T]; got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        if input_ids.dtype not in (torch.int32, torch.int64):  # uint8, int16...: the embedding takes int32/int64
            input_ids = input_ids.long()
        if input_ids.shape[0] == 0:
            raise ValueError(f"input_ids has no rows ({tuple(input_ids.shape)}): at least one sequence is needed")
        if cache is not None:
            self._check_cache(cache)
        B, T = input_ids.shape
        if T == 0:
            raise ValueError("input_ids is empty: at least one token is needed")
        vocab = self.config.vocab_size
        # Reading the ids back is a sync that torch.compile would break its graph on; compiled callers (the
        # training run) feed ids they sampled from the tokenizer's own stream.
        if not torch.compiler.is_compiling():
            lo, hi = (bound.item() for bound in torch.aminmax(input_ids))
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

    def _check_cache(self, cache: LatentCache) -> None:
        """A cache made by ``new_cache`` of a model of this shape and dtype."""
        if not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a LatentCache from model.new_cache(batch_size), got {type(cache).__name__}")
        layers, width = len(self.layers), self.config.kv_lora_rank + self.config.qk_rope_head_dim
        if (len(cache._buffers), cache.width, cache.dtype) != (layers, width, self.dtype):
            raise ValueError(f"cache holds {len(cache._buffers)} layers of {cache.width} {cache.dtype} values per "
                             f"token, but this model needs {layers} layers of {width} {self.dtype}: another model "
                             f"made it; use model.new_cache(batch_size)")


def is_text(value: object) -> bool:
    """Whether a model input is text: a string, or a non-empty list or tuple of strings (a batch)."""
    return isinstance(value, str) or (isinstance(value, list | tuple) and len(value) > 0
                                      and all(isinstance(t, str) for t in value))


def rotary_and_mask(rope: RotaryEmbedding, attention_mask: torch.Tensor | None, cache: LatentCache | None,
                    B: int, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What every block of one forward of T new tokens shares: the rotary cos and sin ([T, R] each; [B, T, R]
    with pads) and the attention mask ([B, 1, T, S] bool; None when no key is a pad). The new tokens' mask is
    recorded in the ``cache``, which also remembers the pads of earlier steps. Also called by each pipeline stage
    (``k2lab.distributed``) on its own cache, so every rank builds the same positions and mask."""
    start = cache.length if cache is not None else 0
    keys = None  # [B, S] bool: which key positions (cached, then new) hold real tokens; None: no pads anywhere
    if attention_mask is not None or (cache is not None and cache.token_mask is not None):
        if attention_mask is None:  # decoding after a padded prefill: the new tokens are real
            new = torch.ones(B, T, dtype=torch.bool, device=device)
        else:
            new = check_attention_mask(attention_mask, B, T).to(device)
        keys = cache.key_mask(new) if cache is not None else new
    if keys is None:
        cos, sin = rope.cos_sin(torch.arange(start, start + T, device=device))  # [T, R] each, shared by every row
        return cos, sin, None
    # Pads take no position: a token's position counts the real tokens before it in its row.
    positions = (keys.cumsum(-1) - 1).clamp(min=0)[:, start:]  # [B, T]
    cos, sin = (t.view(B, T, -1) for t in rope.cos_sin(positions.flatten()))  # [B, T, R] each
    return cos, sin, padded_causal_mask(keys, T)  # [B, 1, T, S]


def check_attention_mask(attention_mask: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """``attention_mask`` [B, T] (or [T] for one row) of 0/1 or bool -> bool [B, T]; anything else raises."""
    mask = torch.as_tensor(attention_mask)
    mask = mask[None] if mask.dim() == 1 else mask
    if tuple(mask.shape) != (B, T) or mask.is_floating_point() or mask.is_complex():
        raise ValueError(f"attention_mask must be integer or bool [B, T] = {(B, T)} (1 = token, 0 = pad); got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    if mask.dtype != torch.bool and not torch.compiler.is_compiling() and ((mask != 0) & (mask != 1)).any():
        raise ValueError(f"attention_mask holds values other than 0 and 1: {sorted(mask.unique().tolist())[:5]}")
    return mask.bool()


def padded_causal_mask(keys: torch.Tensor, num_queries: int) -> torch.Tensor:
    """[B, 1, T, S] bool, True where query t (the last T of S positions) may see key s: causally, and only real
    tokens (``keys`` [B, S]). Every query also sees itself, so a pad's row is never empty: its softmax stays finite
    and its output, which nothing real reads, cannot turn into NaN and leak through a zero weight."""
    S = keys.shape[1]
    own = torch.arange(S, device=keys.device)[None, :] == torch.arange(S - num_queries, S, device=keys.device)[:, None]
    return ((causal_mask(num_queries, S, keys.device) & keys[:, None, :]) | own)[:, None]
