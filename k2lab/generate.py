"""Autoregressive generation through the latent KV cache: one prefill, then one token per step."""

from __future__ import annotations

import torch

from .attention import AttnImpl
from .model import K2Model


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


@torch.no_grad()
def generate(model: K2Model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             eos_token_id: int | None = None, attn_impl: AttnImpl = "absorbed") -> torch.Tensor:
    """Continue ``input_ids`` [B, T] by up to ``max_new_tokens`` tokens -> [B, T + n], n <= max_new_tokens.

    Greedy when ``temperature`` is 0; otherwise samples from softmax(logits / temperature) restricted by
    ``top_k`` and ``top_p``, reproducibly for a given ``seed``. A row stops at the eos id (the config's unless
    given) and is padded with it while other rows go on; generation ends when every row has stopped.
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
    eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)

    cache = model.new_cache(ids.shape[0])
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    out, step_input = [ids], ids
    for _ in range(max_new_tokens):
        logits = model(step_input, cache=cache, attn_impl=attn_impl)[:, -1]  # [B, V]
        token = sample_next(logits, temperature, top_k, top_p, generator)  # [B]
        if eos is not None:
            token = token.masked_fill(done, eos)
            done |= token == eos
        out.append(token[:, None])
        step_input = token[:, None]
        if done.all():
            break
    return torch.cat(out, dim=1)
