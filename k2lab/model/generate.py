"""Autoregressive generation through the latent KV cache: one prefill, then one token per step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .attention import AttnImpl
from .transformer import K2Model

if TYPE_CHECKING:
    from ..tokenizer.tokenizer import K2Tokenizer


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row from last-position logits [B, V] -> [B]. Greedy (argmax) when temperature is 0."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        # Keep the smallest set of most likely tokens whose probability reaches top_p (always the best one).
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def healing_mask(tokenizer: K2Tokenizer, last_ids: list[int], vocab_size: int) -> torch.Tensor:
    """Token healing's constraint [B, V] bool: the tokens that may stand in for each row's last prompt token,
    those whose bytes start with its bytes (specials excluded; the token itself always allowed)."""
    pieces = [tokenizer.token_bytes(i) for i in range(min(tokenizer.vocab_size, vocab_size))]
    specials = set(tokenizer.special_tokens.values())
    mask = torch.zeros(len(last_ids), vocab_size, dtype=torch.bool)
    for row, last in enumerate(last_ids):
        prefix = tokenizer.token_bytes(last)
        mask[row, [i for i, piece in enumerate(pieces) if piece.startswith(prefix) and i not in specials]] = True
        mask[row, last] = True
    return mask


@torch.no_grad()
def generate(model: K2Model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             eos_token_id: int | None = None, attn_impl: AttnImpl = "auto",
             tokenizer: K2Tokenizer | None = None, token_healing: bool = False) -> torch.Tensor:
    """Continue ``input_ids`` [B, T] by up to ``max_new_tokens`` tokens -> [B, T + n], n <= max_new_tokens.

    Greedy when ``temperature`` is 0; otherwise samples from softmax(logits / temperature) restricted by
    ``top_k`` and ``top_p``, reproducibly for a given ``seed``. A row stops at the eos id (the config's unless
    given) and is padded with it while other rows go on; generation ends when every row has stopped.

    ``token_healing`` (with the ``tokenizer``, as in HF transformers) repairs a prompt that ends mid-token, such
    as ``"import "``, whose trailing space the tokenizer would have merged into the next word (" os"): the
    last prompt token is dropped and the first new token is chosen among those whose bytes start with its
    bytes. The result is then [B, T - 1 + n], and its text still starts with the prompt's.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    ids = torch.as_tensor(input_ids, device=model.device)
    ids = ids[None] if ids.dim() == 1 else ids
    allowed = None  # [B, V]: the first step's constraint under token healing
    if token_healing:
        if tokenizer is None:
            raise ValueError("token_healing needs the tokenizer: generate(..., tokenizer=tok, token_healing=True)")
        if ids.shape[1] < 2:
            raise ValueError(f"token healing drops the prompt's last token, so it needs at least 2; got {ids.shape[1]}")
        allowed = healing_mask(tokenizer, ids[:, -1].tolist(), model.config.vocab_size).to(ids.device)
        ids = ids[:, :-1]
    eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)

    cache = model.new_cache(ids.shape[0])
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    out, step_input = [ids], ids
    for _ in range(max_new_tokens):
        logits = model(step_input, cache=cache, attn_impl=attn_impl)[:, -1]  # [B, V]
        if allowed is not None:
            logits, allowed = logits.masked_fill(~allowed, float("-inf")), None
        token = sample_next(logits, temperature, top_k, top_p, generator)  # [B]
        if eos is not None:
            token = token.masked_fill(done, eos)
            done |= token == eos
        out.append(token[:, None])
        step_input = token[:, None]
        if done.all():
            break
    return torch.cat(out, dim=1)
