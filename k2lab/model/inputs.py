"""What a forward is given -> what every block of it shares (``Inputs``): checked token ids, which of them are pads,
each token's position with its rotary cos and sin, and the attention mask.

    inputs = prepare_inputs(model, ids)                       # or text, through model.tokenizer
    x = model.run_blocks(model.embed(inputs.ids), inputs)     # what K2Model.forward does next

Padded batches: ``attention_mask`` [B, T] (1 = token, 0 = pad) hides pads from every query and gives them no position
(a token's position counts the real tokens before it in its row), so a padded row's real positions get the logits of
that row run alone, padded on the left or the right. Ids given without a mask get the one TransformerLens infers: the
attached tokenizer's [PAD] tokens at a row's edges are pads (``infer_attention_mask``). With a latent cache,
positions continue from what it holds, and the cache remembers which of its positions were pads.

``K2Model.forward``, ``k2lab.generate`` and the static decode step (speed/static_decode.py) take their rules from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .attention import ATTN_IMPLS, AttnImpl, LatentCache, causal_mask

if TYPE_CHECKING:
    from .transformer import K2Model

TextOrIds = torch.Tensor | str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


@dataclass
class Inputs:
    """One forward's inputs, as every block reads them."""

    ids: torch.Tensor  # [B, T] int token ids, on the embedding's device
    mask: torch.Tensor | None  # [B, T] bool, True for a token, False for a pad; None: no pad
    cos: torch.Tensor  # [T, R] each token's rotary cos; [B, T, R] when pads shift a row's positions
    sin: torch.Tensor  # as cos
    attn_mask: torch.Tensor | None  # [B | 1, 1, T, S] bool, True where a query may see a key; None: plain causal
    attn_impl: AttnImpl  # the attention path asked for ("auto": each block takes the faster one)


def prepare_inputs(model: K2Model, input_ids: TextOrIds, attention_mask: torch.Tensor | None = None,
                   cache: LatentCache | None = None, attn_impl: AttnImpl = "auto", device: torch.device | None = None
                   ) -> Inputs:
    """What a forward is given -> ``Inputs``, on ``device`` (default: the embedding's). Text goes through
    ``model.tokenizer`` (a list of strings is left-padded into a batch, with its mask). Ids that are not integer
    [B, T] ids of the vocabulary, or that do not fit the cache or the positions, are refused with the reason. The new
    tokens' mask is recorded in ``cache``."""
    if isinstance(input_ids, (str, list, tuple)) and is_text(input_ids):  # (a tuple: torch 2.7 cannot trace X | Y)
        input_ids, attention_mask = encode_text(model, input_ids, attention_mask)
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError):
        raise bad_ids(input_ids) from None
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or 0 in ids.shape or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise bad_ids(input_ids, ids)
    ids = ids if ids.dtype in (torch.int32, torch.int64) else ids.long()  # uint8, int16...: embeddings take these
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
    (B, T), vocab, device = ids.shape, model.config.vocab_size, device or model.embed_tokens.weight.device
    readable = ids.device.type != "meta" and not torch.compiler.is_compiling()  # a compiled graph reads back nothing
    if readable and ids.device.type == "cpu":
        low, high = (int(bound) for bound in torch.aminmax(ids))
        if low < 0 or high >= vocab:
            raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary of {vocab} (valid ids: "
                             f"0..{vocab - 1})")
    elif readable:  # on an accelerator: checked there, without the host waiting for it
        torch._assert_async(((ids >= 0) & (ids < vocab)).all(), f"a token id is outside 0..{vocab - 1}")
    start = 0 if cache is None else check_cache(model, cache, B)  # positions already cached
    if start + T > model.config.max_position_embeddings:
        raise ValueError(f"sequence of {start + T} positions ({start} cached + {T} new) exceeds "
                         f"max_position_embeddings={model.config.max_position_embeddings}")
    pad = model.tokenizer.special_tokens.get("[PAD]") if model.tokenizer is not None else None
    if attention_mask is not None:
        attention_mask = check_attention_mask(attention_mask, B, T).to(device)
    elif readable and start == 0 and pad is not None and bool((ids[:, [0, -1]] == pad).any()):
        attention_mask = infer_attention_mask(ids, pad).to(device)  # [PAD]s at the rows' edges, as TL masks them
    keys = None  # [B, S] bool: which key positions (cached, then new) hold real tokens; None: no pad anywhere
    if attention_mask is not None or (cache is not None and cache.token_mask is not None):
        new = attention_mask if attention_mask is not None else torch.ones(B, T, dtype=torch.bool, device=device)
        keys = cache.key_mask(new) if cache is not None else new
    if keys is None:
        positions = torch.arange(start, start + T, device=device)  # [T], shared by every row
        attn_mask = causal_mask(T, start + T, device)[None, None] if 0 < start and 1 < T else None
    else:  # a token's position counts the real tokens before it in its row
        positions = (keys.cumsum(-1) - 1).clamp(min=0)[:, start:]  # [B, T]
        # Every query also sees itself, so that a pad's row is never empty: its softmax stays finite and its output,
        # which nothing real reads, cannot turn into NaN and leak through a zero weight.
        own = torch.arange(start + T, device=device) == torch.arange(start, start + T, device=device)[:, None]
        attn_mask = ((causal_mask(T, start + T, device) & keys[:, None, :]) | own)[:, None]  # [B, 1, T, S]
    table = model.rotary.tables.get(device)  # rope.py: cos and sin [N, R] of every position, made once per device
    if table is None or table[0].shape[0] < start + T:
        table = model.rotary.grow(device, start + T)
    return Inputs(ids.to(device), attention_mask, table[0][positions], table[1][positions], attn_mask, attn_impl)


def is_text(value: object) -> bool:
    """Whether a model input is text: a string, or a non-empty list or tuple of strings (a batch)."""
    return isinstance(value, str) or (isinstance(value, list | tuple) and len(value) > 0
                                      and all(isinstance(t, str) for t in value))


def encode_text(model: K2Model, text: str | Sequence[str], attention_mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Text -> (ids [B, T], mask [B, T] or None when no row is padded) through ``model.tokenizer``; a list of strings
    is left-padded into one batch."""
    if attention_mask is not None:
        raise ValueError("attention_mask is made by the tokenizer for text input; pass ids to give your own")
    model.require_tokenizer("text input")
    ids, mask = model.to_tokens(text, return_mask=True)
    return ids, None if bool(mask.all()) else mask.bool()


def bad_ids(input_ids: object, ids: torch.Tensor | None = None) -> Exception:
    """The error for ``input_ids`` that are not integer token ids [B, T] (``ids``: what torch made of them)."""
    if ids is None:
        return TypeError(f"input_ids must be integer token ids [B, T] (a tensor or nested lists of int), or text; got "
                         f"{type(input_ids).__name__} {str(input_ids)[:60]}")
    if ids.dim() == 2 and ids.shape[0] == 0:
        return ValueError(f"input_ids has no rows ({tuple(ids.shape)}): at least one sequence is needed")
    if ids.dim() == 2 and ids.shape[1] == 0 or ids.dim() == 1:
        return ValueError("input_ids is empty: at least one token is needed")
    return ValueError(f"input_ids must be integer token ids [B, T]; got {ids.dtype} {tuple(ids.shape)}")


def check_cache(model: K2Model, cache: LatentCache, batch_size: int) -> int:
    """A cache made by ``model.new_cache`` for ``batch_size`` rows (or refused with the reason) -> its length."""
    if not isinstance(cache, LatentCache):
        raise TypeError(f"cache must be a LatentCache from model.new_cache(batch_size), got {type(cache).__name__}")
    layers, width = len(model.layers), model.config.kv_lora_rank + model.config.qk_rope_head_dim
    dtype = model.embed_tokens.weight.dtype
    if (cache.num_layers, cache.width, cache.dtype) != (layers, width, dtype):
        raise ValueError(f"cache holds {cache.num_layers} layers of {cache.width} {cache.dtype} values per token, but "
                         f"this model needs {layers} layers of {width} {dtype}: another model made it; use "
                         f"model.new_cache(batch_size)")
    if cache.batch_size != batch_size:
        raise ValueError(f"cache holds {cache.batch_size} rows but input_ids has {batch_size}")
    return cache.length


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


def infer_attention_mask(ids: torch.Tensor, pad: int | None) -> torch.Tensor | None:
    """The attention mask of ids [B, T] padded without one (TransformerLens's ``to_tokens`` habit): [B, T] bool, False
    on the runs of the ``pad`` id at each row's left and right edges; None when no row has a pad at an edge (or
    ``pad`` is None). A [PAD] between real tokens stays a token, and EOS is never taken for a pad (it is a real token
    at a row's end). A row of pads only raises."""
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
