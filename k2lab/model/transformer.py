"""The Kimi K2 language model: embedding, 61 pre-norm blocks (MLA + dense or MoE feed-forward), final norm,
untied head with float32 logits.

    x = embed(ids)
    for each block:  x = x + attn(rmsnorm(x));  x = x + ffn(rmsnorm(x))
    logits = lm_head(rmsnorm(x)).float()

Module paths mirror the checkpoint's tensor names without the leading ``model.``: the probe
``layers.3.self_attn.hook_kv_latent`` sits next to ``model.layers.3.self_attn.kv_a_proj_with_mqa.weight``.

What a forward is given (ids or text, pads, positions, the rotary table) becomes what every block shares in
``inputs.py``. Every speed trick sits in ``speed/``, called from here in one line; ``model.speed = False`` (or
``with model.reference():``) turns them all off, so that every call runs the reference functions.

The model holds whatever tokenizer is attached as ``model.tokenizer`` (``k2lab.load`` attaches the checkpoint
folder's own); then text goes in wherever ids do: ``model("def f(")``, ``model.to_tokens(texts)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal, Protocol

import torch
from torch import nn

from ..config import K2Config
from .activation_cache import ActivationCache
from .attention import AttnImpl, LatentCache, MultiHeadLatentAttention
from .devices import available_device
from .hooks import HookedModule, NameFilter
from .inputs import Inputs, TextOrIds, infer_attention_mask, prepare_inputs
from .layers import HookPoint, Linear, RMSNorm, SwiGLU
from .moe import MoE
from .rope import RotaryTable
from .speed.loss import ReturnType, next_token_loss


class Tokenizer(Protocol):
    """What the model and ``generate`` ask of an attached tokenizer (``k2lab.load_tokenizer`` makes one); the model
    package names no tokenizer class, so that it imports no tokenizer code."""

    vocab_size: int
    special_tokens: dict[str, int]

    def encode(self, text: str) -> list[int]:
        """text -> token ids."""

    def decode(self, ids: Sequence[int]) -> str:
        """token ids -> text."""

    def encode_padded(self, texts: list[str], padding_side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
        """Several texts -> (ids [B, T], attention_mask [B, T], 1 = token, 0 = pad), padded on ``padding_side``."""

    def id_to_piece(self, token_id: int) -> str:
        """One token id -> its text, as printed in tables and figures."""

    def token_bytes(self, token_id: int) -> bytes:
        """One token id -> the bytes it stands for."""



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
        """x [B, T, D] -> x + attention(norm(x)), then + feed-forward(norm(...)) [B, T, D]; ``cos``/``sin`` the rotary
        rows of the positions, ``cache`` the latent cache to append to and read."""
        x = self.hook_resid_pre(x)  # [B, T, D]
        attn_in = self.input_layernorm.hook_out(self.input_layernorm(x))  # [B, T, D]
        attn = self.self_attn(attn_in, cos, sin, cache, self.layer, attn_impl, attn_mask)
        x = self.hook_resid_mid(x + self.hook_attn_out(attn))
        mlp_in = self.post_attention_layernorm.hook_out(self.post_attention_layernorm(x))  # [B, T, D]
        return self.hook_resid_post(x + self.hook_mlp_out(self.mlp(mlp_in)))


class K2Model(HookedModule):
    """Kimi K2. ``model(ids)`` -> float32 logits [B, T, V].

    One forward is four public steps, which ``k2lab.distributed.PipelinedK2`` also composes, a stage per rank:

        inputs = prepare_inputs(model, input_ids, attention_mask, cache)  # inputs.py: ids, pads, positions, rotary
        x = model.embed(inputs.ids)                                       # [B, T, D]
        x = model.run_blocks(x, inputs, cache)                            # blocks 0..L-1 (or start..stop)
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
        with available_device(device, "device"):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.embed_tokens.hook_out = HookPoint()  # [B, T, D] token embeddings
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.norm.hook_out = HookPoint()  # [B, T, D] final normalised residual
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
            self.hook_logits = HookPoint()  # [B, T, V] float32
        # YaRN's cos and sin of every position (rope.py), made on each device as positions are asked for. Not a
        # buffer: a model built on the meta device never holds an empty table.
        self.rotary = RotaryTable.for_config(cfg)
        if self.lm_head.weight.device.type != "meta":
            self.init_weights()
        if dtype is not None:
            self.to(dtype)
        self.name_hook_points()
        self.tokenizer: Tokenizer | None = None  # whatever is attached; k2lab.load attaches the checkpoint's own
        self._running = False  # blocks are running (a hook that runs the model again would recurse)
        self._speed = True

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
        """The dtype of the weights (the embedding's)."""
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """The device of the embedding, where ``forward`` puts the ids."""
        return self.embed_tokens.weight.device

    @property
    def speed(self) -> bool:
        """Whether the speed rooms (``k2lab/model/speed/``) run: True by default. ``model.speed = False`` turns every
        one off, on every module: products without the thread split, the naive path's softmax written out, the
        reference loop over the experts, the loss through the whole logits, ``generate`` without inference mode or
        compilation. Every call then runs the reference functions, with results equal to float32 rounding."""
        return self._speed

    @speed.setter
    def speed(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ValueError(f"model.speed must be True or False, got {on!r}")
        for module in self.modules():
            if module is not self and hasattr(type(module), "speed"):  # the modules with a speed room
                module.speed = on
        self._speed = on

    @contextmanager
    def reference(self) -> Iterator[K2Model]:
        """``with model.reference():`` runs the block with every speed room off (``model.speed = False``), to trace or
        read the reference functions, a decode step's too; the setting before is restored on exit."""
        before = self.speed
        self.speed = False
        try:
            yield self
        finally:
            self.speed = before

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
        inputs = prepare_inputs(self, input_ids, attention_mask, cache, attn_impl)  # inputs.py
        x = self.run_blocks(self.embed(inputs.ids), inputs, cache)  # [B, T, D]
        if return_type == "logits":
            return self.head(x).to(inputs.ids.device)  # where the ids were sent, as if the model were on one device
        return next_token_loss(self, x, inputs, return_type, loss_per_token)  # speed/loss.py

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Checked ids [B, T] -> token embeddings [B, T, D] (``embed_tokens.hook_out``)."""
        return self.embed_tokens.hook_out(self.embed_tokens(ids))

    def run_blocks(self, x: torch.Tensor, inputs: Inputs, cache: LatentCache | None = None, start: int = 0,
                   stop: int | None = None) -> torch.Tensor:
        """The residual [B, T, D] through blocks ``start`` .. ``stop - 1`` (all by default). ``inputs`` from
        ``prepare_inputs``; ``cache`` the forward's, advanced once its last block has run."""
        if self._running:
            raise RuntimeError("the model was called from a hook while its own forward is running: every hook "
                               "fires again in the inner forward, so this would recurse without end (and, in a "
                               "pipeline, mix up the messages between ranks). Record what you need first "
                               "(run_with_cache), then run the edited forward")
        self._running = True
        try:
            for layer in self.layers[start:stop]:
                # With a device_map, blocks live on several devices: the residual (and the rotary table) follow them.
                device = layer.input_layernorm.weight.device
                mask = inputs.attn_mask.to(device) if inputs.attn_mask is not None else None
                x = layer(x.to(device), inputs.cos.to(device), inputs.sin.to(device), cache, inputs.attn_impl, mask)
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

    def infer_attention_mask(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The attention mask of ids [B, T] padded without one (TransformerLens's ``to_tokens`` habit): [B, T] bool,
        False on the runs of the attached tokenizer's [PAD] id at each row's left and right edges; None when no row
        has a pad at an edge, or no tokenizer with a [PAD] token is attached (``inputs.infer_attention_mask``)."""
        pad = self.tokenizer.special_tokens.get("[PAD]") if self.tokenizer is not None else None
        return infer_attention_mask(ids, pad)

    # ---- probes -----------------------------------------------------------------------------------------------------
    def run_with_cache(self, input_ids: TextOrIds, names: NameFilter = None, device: torch.device | str | None = None,
                       dtype: torch.dtype | None = None, *, names_filter: NameFilter = None, incl_bwd: bool = False,
                       metric: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       **forward_kwargs) -> tuple[torch.Tensor, ActivationCache]:
        """``HookedModule.run_with_cache`` (the same arguments), its record wrapped in an ``ActivationCache``, which
        adds the residual-stream analyses (logit lens, decompositions, attribution) to the recorded tensors and keeps
        the attention mask the forward ran with (given, made by the tokenizer for text, or inferred from [PAD]s at
        the rows' edges): ``cache.mask``, None without pads."""
        inputs = prepare_inputs(self, input_ids, forward_kwargs.pop("attention_mask", None),
                                forward_kwargs.get("cache"), forward_kwargs.get("attn_impl", "auto"))
        output, record = super().run_with_cache(inputs.ids, names, device, dtype, names_filter=names_filter,
                                                incl_bwd=incl_bwd, metric=metric, attention_mask=inputs.mask,
                                                **forward_kwargs)
        mask = None if inputs.mask is None else inputs.mask.to(device if device is not None else inputs.mask.device)
        return output, ActivationCache(record, self, mask=mask)
