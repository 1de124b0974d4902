"""The Kimi K2 language model: embedding, 61 pre-norm blocks (MLA + dense or MoE feed-forward), final norm,
untied head with float32 logits.

    x = embed(ids)
    for each block:  x = x + attn(rmsnorm(x));  x = x + ffn(rmsnorm(x))
    logits = lm_head(rmsnorm(x)).float()

Module paths mirror the checkpoint's tensor names without the leading ``model.``: the probe
``layers.3.self_attn.hook_kv_latent`` sits next to ``model.layers.3.self_attn.kv_a_proj_with_mqa.weight``.

Padded batches: ``attention_mask`` [B, T] (1 = token, 0 = pad) hides pads from every query and gives them no
position, so a padded row's real positions get the logits of that row run alone (left or right padding; the
latent cache remembers which cached positions were pads across decode steps). Ids given without a mask get the one
TransformerLens infers: the attached tokenizer's [PAD] tokens at a row's edges are pads (``infer_attention_mask``).

The model holds whatever tokenizer is attached as ``model.tokenizer`` (``k2lab.load`` attaches the checkpoint
folder's own); then text goes in wherever ids do: ``model("def f(")``, ``model.to_tokens(texts)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..config import K2Config
from .attention import ATTN_IMPLS, AttnImpl, LatentCache, MultiHeadLatentAttention, causal_mask
from .hooks import HookedModule, HookPoint
from .layers import Linear, RMSNorm, SwiGLU
from .loss import head_cross_entropy
from .moe import MoE
from .rope import cos_sin_scale, inverse_frequencies


class Tokenizer(Protocol):
    """What the model and ``generate`` ask of an attached tokenizer (``k2lab.load_tokenizer`` makes one); the model
    package names no tokenizer class, so that it imports no tokenizer code."""

    vocab_size: int
    special_tokens: dict[str, int]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def encode_padded(self, texts: list[str], padding_side: str = "left") -> tuple[torch.Tensor, torch.Tensor]: ...
    def id_to_piece(self, token_id: int) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...


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
        self.input_layernorm.hook_out = HookPoint()  # [B, T, D] attention's normalised input
        self.post_attention_layernorm.hook_out = HookPoint()  # [B, T, D] the feed-forward's (MoE's) normalised input
        self.hook_resid_pre = HookPoint()  # [B, T, D] block input
        self.hook_attn_out = HookPoint()  # [B, T, D] attention's write to the residual
        self.hook_resid_mid = HookPoint()  # [B, T, D] after attention
        self.hook_mlp_out = HookPoint()  # [B, T, D] feed-forward's write (routed + shared for MoE)
        self.hook_resid_post = HookPoint()  # [B, T, D] block output

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                attn_impl: AttnImpl = "auto", attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.hook_resid_pre(x)  # [B, T, D]
        attn_in = self.input_layernorm.hook_out(self.input_layernorm(x))  # [B, T, D]
        attn = self.self_attn(attn_in, cos, sin, cache, self.layer, attn_impl, attn_mask)
        x = self.hook_resid_mid(x + self.hook_attn_out(attn))
        mlp_in = self.post_attention_layernorm.hook_out(self.post_attention_layernorm(x))  # [B, T, D]
        return self.hook_resid_post(x + self.hook_mlp_out(self.mlp(mlp_in)))


class K2Model(HookedModule):
    """Kimi K2. ``model(ids)`` -> float32 logits [B, T, V].

    One forward is four public steps, which ``k2lab.distributed.PipelinedK2`` also composes, a stage per rank:

        ids, mask = model.check_input(input_ids, attention_mask, cache)   # text -> ids; refuses bad input
        x = model.embed(ids)                                              # [B, T, D]
        x = model.run_blocks(x, mask, cache)                              # blocks 0..L-1 (or start..stop)
        logits = model.head(x)                                            # final norm, head: float32 [B, T, V]

    >>> model = K2Model(K2Config.mini())
    >>> cache = model.new_cache(batch_size=1)
    >>> logits = model(ids, cache=cache)           # prefill; then one token at a time
    """

    def __init__(self, cfg: K2Config, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch dtype (torch.float32, torch.bfloat16, "
                             f"torch.float16) or None for float32; got {dtype!r}")
        self.config = cfg
        with check_device(device):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.embed_tokens.hook_out = HookPoint()  # [B, T, D] token embeddings
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.norm.hook_out = HookPoint()  # [B, T, D] final normalised residual
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
            self.hook_logits = HookPoint()  # [B, T, V] float32
        # YaRN's frequencies [R/2] and its factor on cos and sin (rope.py), computed once on the CPU and copied once
        # to each device that asks. Not a buffer: a model built on the meta device never holds an empty table.
        self.inv_freq, self.rope_scale = inverse_frequencies(cfg), cos_sin_scale(cfg)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {self.inv_freq.device: self.inv_freq}
        if self.lm_head.weight.device.type != "meta":
            self.init_weights()
        if dtype is not None:
            self.to(dtype)
        self.name_hook_points()
        self.tokenizer: Tokenizer | None = None  # whatever is attached; k2lab.load attaches the checkpoint's own
        self._running = False  # blocks are running (a hook that runs the model again would recurse)

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

    # ---- the forward --------------------------------------------------------------------------------------------
    def forward(self, input_ids: TextOrIds, cache: LatentCache | None = None, attn_impl: AttnImpl = "auto", *,
                attention_mask: torch.Tensor | None = None, return_type: ReturnType = "logits",
                loss_per_token: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] (int), or text (a string, or a list of strings left-padded into a batch) through
        ``model.tokenizer`` -> by ``return_type``:

        - ``"logits"``: float32 logits [B, T, V];
        - ``"loss"``: the mean next-token cross-entropy in nats over the positions whose token and next token are
          both real (``attention_mask``); ``loss_per_token=True`` makes it [B, T - 1] (position t scores token
          t + 1, 0 where excluded);
        - ``"both"``: (logits, loss).

        ``attention_mask`` [B, T]: 1 for a token, 0 for a pad (see the module docstring). Without one, ids are masked
        as TransformerLens masks them, so that ``model(model.to_tokens(texts))`` gives each row its own logits: the
        attached tokenizer's [PAD] tokens at a row's left and right edges are pads (``infer_attention_mask``; not at
        a decode step, whose cache already holds tokens). With a cache, positions continue from what it holds and the
        new tokens' latents are appended to it.
        """
        if return_type not in ("logits", "loss", "both"):
            raise ValueError(f"return_type must be 'logits', 'loss' or 'both', got {return_type!r}")
        if loss_per_token and return_type == "logits":
            raise ValueError("loss_per_token=True asks for a loss: use return_type='loss' or 'both'")
        ids, attention_mask = self.check_input(input_ids, attention_mask, cache, attn_impl)
        x = self.run_blocks(self.embed(ids), attention_mask, cache, attn_impl)  # [B, T, D]
        if return_type == "logits":
            return self.head(x).to(ids.device)  # where the ids were sent, as if the model were on one device
        return next_token_loss(self, x, ids, attention_mask, return_type, loss_per_token)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Checked ids [B, T] -> token embeddings [B, T, D] (``embed_tokens.hook_out``)."""
        return self.embed_tokens.hook_out(self.embed_tokens(ids))

    def run_blocks(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: LatentCache | None = None,
                   attn_impl: AttnImpl = "auto", start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The residual [B, T, D] through blocks ``start`` .. ``stop - 1`` (all by default). ``attention_mask`` [B, T]
        bool as ``check_input`` returns it; ``cache`` the forward's, advanced once its last block has run."""
        if self._running:
            raise RuntimeError("the model was called from a hook while its own forward is running: every hook "
                               "fires again in the inner forward, so this would recurse without end (and, in a "
                               "pipeline, mix up the messages between ranks). Record what you need first "
                               "(run_with_cache), then run the edited forward")
        self._running = True
        try:
            cos, sin, attn_mask = self.rotary_and_mask(attention_mask, cache, *x.shape[:2], x.device)
            for layer in self.layers[start:stop]:
                # With a device_map, blocks live on several devices: the residual (and the rotary table) follow them.
                device = layer.input_layernorm.weight.device
                mask = attn_mask.to(device) if attn_mask is not None else None
                x = layer(x.to(device), cos.to(device), sin.to(device), cache, attn_impl, mask)
        finally:
            self._running = False
        if cache is not None and (stop is None or stop >= len(self.layers)):
            cache.advance(x.shape[1])
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last residual [B, T, D] -> final norm (``norm.hook_out``) -> float32 logits [B, T, V] (``hook_logits``),
        on the head's device."""
        x = self.norm.hook_out(self.norm(x.to(self.norm.weight.device)))  # [B, T, D]
        return self.hook_logits(self.lm_head(x.to(self.lm_head.weight.device)).float())  # [B, T, V]

    def rotary_and_mask(self, attention_mask: torch.Tensor | None, cache: LatentCache | None, B: int, T: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What every block of one forward of T new tokens shares: the rotary cos and sin ([T, R] each; [B, T, R]
        with pads) and the attention mask ([B | 1, 1, T, S] bool; None for plain causal attention over T == S
        positions, or one query). The new tokens' mask ``attention_mask`` [B, T] bool is recorded in the ``cache``,
        which also remembers the pads of earlier steps."""
        start = cache.length if cache is not None else 0
        keys = None  # [B, S] bool: which key positions (cached, then new) hold real tokens; None: no pads anywhere
        if attention_mask is not None or (cache is not None and cache.token_mask is not None):
            new = attention_mask if attention_mask is not None else torch.ones(B, T, dtype=torch.bool, device=device)
            keys = cache.key_mask(new.to(device)) if cache is not None else new.to(device)
        if keys is None:
            positions = torch.arange(start, start + T, device=device)  # [T], shared by every row
            mask = causal_mask(T, start + T, device)[None, None] if 0 < start and 1 < T else None
        else:  # pads take no position: a token's position counts the real tokens before it in its row
            positions = (keys.cumsum(-1) - 1).clamp(min=0)[:, start:]  # [B, T]
            # Every query also sees itself, so a pad's row is never empty: its softmax stays finite and its output,
            # which nothing real reads, cannot turn into NaN and leak through a zero weight.
            own = torch.zeros(T, start + T, dtype=torch.bool, device=device).diagonal_scatter(
                torch.ones(T, dtype=torch.bool, device=device), start)  # [T, S]
            mask = ((causal_mask(T, start + T, device) & keys[:, None, :]) | own)[:, None]  # [B, 1, T, S]
        inv_freq = self._inv_freq_on.get(device)
        if inv_freq is None:
            with torch.inference_mode(False):  # kept: an ordinary tensor even when first made in inference mode
                inv_freq = self._inv_freq_on[device] = self.inv_freq.to(device)
        angles = positions.to(torch.float32)[..., None] * inv_freq  # [(B,) T, R/2] each pair's angle
        angles = torch.cat((angles, angles), dim=-1)  # [(B,) T, R]
        return angles.cos() * self.rope_scale, angles.sin() * self.rope_scale, mask

    # ---- text -------------------------------------------------------------------------------------------------------
    def require_tokenizer(self, what: str) -> Tokenizer:
        """The attached tokenizer; without one, an error that says how to attach one (``what`` needed it)."""
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
        tok = self.require_tokenizer("to_tokens")
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
        tok = self.require_tokenizer("to_str_tokens")
        ids = tok.encode(text_or_ids) if isinstance(text_or_ids, str) else torch.as_tensor(text_or_ids).tolist()
        if ids and isinstance(ids[0], list):
            rows = [[tok.id_to_piece(i) for i in row] for row in ids]
            return rows[0] if len(rows) == 1 else rows
        return [tok.id_to_piece(i) for i in ids]

    def check_input(self, input_ids: TextOrIds, attention_mask: torch.Tensor | None = None,
                    cache: LatentCache | None = None, attn_impl: AttnImpl = "auto"
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a forward is given -> (ids [B, T] on the model's device, attention mask [B, T] bool or None).

        Text goes through ``model.tokenizer`` (a list is left-padded, with its mask); ids are refused with the reason
        when they are not integer [B, T] ids of this vocabulary, or do not fit the cache or the positions."""
        text = isinstance(input_ids, str | list | tuple) and is_text(input_ids)
        if text:
            if attention_mask is not None:
                raise ValueError("attention_mask is made by the tokenizer for text input; pass ids to give your own")
            self.require_tokenizer("text input")
            input_ids, attention_mask = self.to_tokens(input_ids, return_mask=True)
            attention_mask = None if bool(attention_mask.all()) else attention_mask
        try:
            ids = torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"input_ids must be integer token ids [B, T] (a tensor or nested lists of int), got "
                            f"{type(input_ids).__name__} {str(input_ids)[:60]}") from None
        ids = ids[None] if ids.dim() == 1 else ids
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids [B, T]; got {ids.dtype} {tuple(ids.shape)}")
        if ids.dtype not in (torch.int32, torch.int64):  # uint8, int16...: the embedding takes int32/int64
            ids = ids.long()
        B, T = ids.shape
        if B == 0:
            raise ValueError(f"input_ids has no rows ({tuple(ids.shape)}): at least one sequence is needed")
        if T == 0:
            raise ValueError("input_ids is empty: at least one token is needed")
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
        vocab = self.config.vocab_size
        # Reading the ids back is a sync that torch.compile would break its graph on; compiled callers (the training
        # run, a compiled decode step) feed ids they sampled from the model's own vocabulary, without pads.
        readable = not torch.compiler.is_compiling() and ids.device.type != "meta"
        if readable:
            lo, hi = (bound.item() for bound in torch.aminmax(ids))
            if lo < 0 or hi >= vocab:
                raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary of {vocab} (valid ids: "
                                 f"0..{vocab - 1})")
        if cache is not None:
            self._check_cache(cache, B)
        start = cache.length if cache is not None else 0
        if start + T > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {start + T} positions ({start} cached + {T} new) exceeds "
                             f"max_position_embeddings={self.config.max_position_embeddings}")
        if attention_mask is not None:
            attention_mask = check_attention_mask(attention_mask, B, T).to(self.embed_tokens.weight.device)
        elif not text and readable and start == 0 and self.tokenizer is not None:
            # Ids without a mask: pads at the rows' edges are masked as TransformerLens does. The edges are looked at
            # here first, so that a batch without pads runs nothing more.
            pad = self.tokenizer.special_tokens.get("[PAD]")
            if pad is not None and bool((ids[:, [0, -1]] == pad).any()):
                attention_mask = self.infer_attention_mask(ids).to(self.embed_tokens.weight.device)
        return ids.to(self.embed_tokens.weight.device), attention_mask

    def infer_attention_mask(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The attention mask of ids [B, T] padded without one (TransformerLens's ``to_tokens`` habit): [B, T] bool,
        False on the runs of the attached tokenizer's [PAD] id at each row's left and right edges; None when no row
        has a pad at an edge, or no tokenizer with a [PAD] token is attached. A [PAD] between real tokens stays a
        token, and EOS is never taken for a pad (it is a real token at a row's end). A row of pads only raises."""
        pad = self.tokenizer.special_tokens.get("[PAD]") if self.tokenizer is not None else None
        ids = torch.as_tensor(ids)
        ids = ids[None] if ids.dim() == 1 else ids
        if pad is None or ids.numel() == 0 or not bool((ids[:, [0, -1]] == pad).any()):
            return None
        is_pad = (ids == pad).int()  # [B, T]
        left = is_pad.cumprod(-1)  # [B, T] 1 on the run of pads the row starts with
        right = is_pad.flip(-1).cumprod(-1).flip(-1)  # [B, T] 1 on the run it ends with
        mask = (left + right) == 0
        if not mask.any(-1).all():
            row = int((~mask.any(-1)).nonzero()[0])
            raise ValueError(f"input_ids row {row} holds only [PAD] tokens (id {pad}): a row needs a token to attend "
                             f"to; drop the row, or pass attention_mask= to say which of its tokens are real")
        return mask

    def _check_cache(self, cache: LatentCache, batch_size: int) -> None:
        """A cache made by ``new_cache`` of a model of this shape and dtype, for ``batch_size`` rows."""
        if not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a LatentCache from model.new_cache(batch_size), got {type(cache).__name__}")
        layers, width = len(self.layers), self.config.kv_lora_rank + self.config.qk_rope_head_dim
        if (cache.num_layers, cache.width, cache.dtype) != (layers, width, self.dtype):
            raise ValueError(f"cache holds {cache.num_layers} layers of {cache.width} {cache.dtype} values per "
                             f"token, but this model needs {layers} layers of {width} {self.dtype}: another model "
                             f"made it; use model.new_cache(batch_size)")
        if cache.batch_size != batch_size:
            raise ValueError(f"cache holds {cache.batch_size} rows but input_ids has {batch_size}")


def next_token_loss(model: K2Model, x: torch.Tensor, ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    return_type: ReturnType, per_token: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``K2Model.forward``'s loss from the last residual x [B, T, D]: cross-entropy of each next token in nats, over
    the positions whose token and next token are both real."""
    if ids.shape[1] < 2:
        raise ValueError(f"a next-token loss needs at least 2 tokens per row; got {ids.shape[1]}")
    targets = ids[:, 1:]  # [B, T-1]
    scored = torch.ones_like(targets, dtype=torch.bool)  # [B, T-1] token and target both real
    if attention_mask is not None:
        scored = attention_mask[:, 1:] & attention_mask[:, :-1]
        if not torch.compiler.is_compiling() and scored.device.type != "meta" and not scored.any():
            raise ValueError("no position has both a real token and a real next token (attention_mask)")
    if return_type == "loss" and not per_token and not model.hook_logits.active:  # no logits wanted: never hold them
        last = torch.zeros_like(scored[:, :1])  # the last position predicts nothing
        return head_loss(model, x, torch.cat((targets, last.long()), 1), torch.cat((scored, last), 1)).to(ids.device)
    logits = model.head(x).to(ids.device)  # [B, T, V]
    per_position = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="none")
    loss = per_position.view_as(targets) * scored  # [B, T-1]
    loss = loss if per_token else loss.sum() / scored.sum().clamp(min=1)
    return loss if return_type == "loss" else (logits, loss)


def head_loss(model: K2Model, x: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor | None = None,
              reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy in nats of ``targets`` [B, T] (the token each position predicts) under the logits of the last
    residual x [B, T, D], over the positions ``scored`` [B, T] bool (all when None), "mean" or "sum". The final norm
    runs as ``head`` runs it; a plain head then runs chunk by chunk (``loss.py``: the [B, T, V] logits are never
    held), any other (quantized) through its whole logits."""
    hidden = model.norm.hook_out(model.norm(x.to(model.norm.weight.device)))  # [B, T, D]
    if scored is not None and hidden.device.type != "meta":  # (on meta, which positions count is unknown: all do)
        hidden, targets = hidden[scored.to(hidden.device)], targets[scored]  # [N, D], [N]
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if not isinstance(model.lm_head, nn.Linear):
        logits = model.lm_head(hidden.to(model.lm_head.weight.device)).float()  # [N, V]
        return F.cross_entropy(logits, targets.to(logits.device), reduction=reduction)
    weight = model.lm_head.weight
    return head_cross_entropy(hidden.to(weight.device), weight, targets.to(weight.device), reduction)


def check_device(device: torch.device | str | int | None) -> torch.device:
    """A model's ``device=`` (None: the CPU) as a torch.device; one torch cannot read, or this machine lacks, is
    refused with the devices it has."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    count = torch.accelerator.device_count() if accelerator is not None else 0
    available = ", ".join(["cpu", "meta", *(f"{accelerator.type}:{i}" for i in range(count))])
    try:
        parsed = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a device name such as 'cpu', 'cuda', 'cuda:1' or 'meta'; "
                         f"got {device!r} (available here: {available})") from None
    if parsed.type not in ("cpu", "meta") and (accelerator is None or parsed.type != accelerator.type
                                               or (parsed.index or 0) >= count):
        raise ValueError(f"device={str(parsed)!r} is not available on this machine (available here: {available})")
    return parsed


def is_text(value: object) -> bool:
    """Whether a model input is text: a string, or a non-empty list or tuple of strings (a batch)."""
    return isinstance(value, str) or (isinstance(value, list | tuple) and len(value) > 0
                                      and all(isinstance(t, str) for t in value))


def check_attention_mask(attention_mask: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """``attention_mask`` [B, T] (or [T] for one row) of 0/1 or bool -> bool [B, T]; anything else raises."""
    mask = torch.as_tensor(attention_mask)
    mask = mask[None] if mask.dim() == 1 else mask
    if tuple(mask.shape) != (B, T) or mask.is_floating_point() or mask.is_complex():
        raise ValueError(f"attention_mask must be integer or bool [B, T] = {(B, T)} (1 = token, 0 = pad); got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    readable = not torch.compiler.is_compiling() and mask.device.type != "meta"
    if mask.dtype != torch.bool and readable and ((mask != 0) & (mask != 1)).any():
        raise ValueError(f"attention_mask holds values other than 0 and 1: {sorted(mask.unique().tolist())[:5]}")
    return mask.bool()
