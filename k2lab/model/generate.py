"""Autoregressive generation through the latent KV cache: one prefill, then one token per step."""

from __future__ import annotations

import math
import warnings

import torch

from .attention import AttnImpl
from .inputs import check_attention_mask, is_text
from .speed.compiled_decode import compiled_decode_step, eager_reason
from .transformer import K2Model, Tokenizer


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row from last-position logits [B, V] -> [B]. Greedy (argmax) when temperature is 0."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    # The best logit first subtracted: a tiny temperature then sends the others to -inf, not inf - inf = NaN.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
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


def healing_mask(tokenizer: Tokenizer, last_ids: list[int], vocab_size: int) -> torch.Tensor:
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


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
                    seed: int | None) -> None:
    """generate's numeric arguments: counts are whole numbers, probabilities and temperatures finite."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def real(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not whole(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not real(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and (not whole(top_k) or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_p is not None and (not real(top_p) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be None or lie in (0, 1], got {top_p!r}")
    if seed is not None and not whole(seed):
        raise ValueError(f"seed must be None or an integer, got {seed!r}")


@torch.no_grad()
def generate(model: K2Model, input_ids: torch.Tensor | str | list[str], max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             eos_token_id: int | None = None, attn_impl: AttnImpl = "auto",
             tokenizer: Tokenizer | None = None, token_healing: bool = False,
             attention_mask: torch.Tensor | None = None, compile: bool = False, stop_at_eos: bool = True
             ) -> torch.Tensor | str | list[str]:
    """Continue ``input_ids`` [B, T] by up to ``max_new_tokens`` tokens -> [B, T + n], n <= max_new_tokens.

    Greedy when ``temperature`` is 0; otherwise samples from softmax(logits / temperature) restricted by
    ``top_k`` and ``top_p``, reproducibly for a given ``seed``. A row stops at the eos id (the config's unless
    given) and is padded with it while other rows go on; generation ends when every row has stopped.
    ``stop_at_eos=False`` (TransformerLens's switch) generates ``max_new_tokens`` for every row, past any eos.

    A padded batch: ``attention_mask`` [B, T] (1 = token, 0 = pad); ids given without one are masked as the model's
    forward masks them (``K2Model.infer_attention_mask``: [PAD] tokens at a row's edges). Each row continues from its
    last real token, and greedy decoding gives each row the tokens it would get alone. Pad on the left
    (``tok.encode_padded``'s default), so that every row's text stays contiguous in the result; the result keeps the
    pads where they were.

    Text: ``generate(model, "def f(", ...)`` (or a list of strings, left-padded into one batch) encodes with the
    ``tokenizer`` (default ``model.tokenizer``) and returns the full text, prompt plus completion, for each
    prompt (a string for a string), cut before the first eos.

    ``token_healing`` (with the ``tokenizer``, as in HF transformers) repairs a prompt that ends mid-token, such
    as ``"import "``, whose trailing space the tokenizer would have merged into the next word (" os"): the
    last prompt token is dropped and the first new token is chosen among those whose bytes start with its
    bytes. The result is then [B, T - 1 + n], and its text still starts with the prompt's.

    The forward passes run under ``torch.no_grad``.

    ``compile=True`` runs the decode steps through ``torch.compile`` with ``fullgraph=True`` (the prefill stays eager;
    model/speed/compiled_decode.py): the whole step is one graph whose small ops inductor fuses into a few kernels, and
    whose experts, stacked or held quantized (FP8, INT4), are read by index inside them
    (model/speed/indexed_experts.py). On one CUDA device the step runs over a static cache and is captured as a CUDA
    graph (``mode="reduce-overhead"``).
    The first step compiles (tens of seconds on a CPU, again for each new thread count); after that a step of the
    benchmark model takes about half the eager one on a 2-core CPU (docs/speed.md). The tokens equal eager
    generation's up to float32 rounding of near-ties. Hooks cannot run inside a compiled graph, so a model with
    anything attached (``model.is_observed()``), with streamed experts, or with its speed rooms off (``model.speed``)
    generates eagerly, after a warning that says why. Needs a C++ compiler on the CPU, as ``torch.compile`` does.
    """
    _check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    if compile and not isinstance(model, K2Model):
        raise ValueError(f"compile=True compiles a K2Model's decode step; this model is a {type(model).__name__}")
    if model.device.type == "meta":
        raise ValueError("generate samples tokens from the logits' values, and a model on the meta device has none "
                         "(only shapes): load it, or build it on a real device")
    text = input_ids if is_text(input_ids) else None
    if text is not None:
        if attention_mask is not None:
            raise ValueError("attention_mask is made by the tokenizer for text input; pass ids to give your own")
        if tokenizer is None:
            tokenizer = model.require_tokenizer("generate on text")
        input_ids, attention_mask = tokenizer.encode_padded([text] if isinstance(text, str) else list(text))
    try:
        ids = torch.as_tensor(input_ids, device=model.device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"input_ids must be token ids [B, T] of one length per row (a tensor, or lists of int of "
                         f"equal length: pad them, e.g. tokenizer.encode_padded), or text (a string, or a list of "
                         f"strings only); got {str(input_ids)[:80]}") from None
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold at least one token id per row, [B, T] integers; got {ids.dtype} "
                         f"{tuple(ids.shape)}" + (" (the text encodes to no token)" if text is not None else ""))
    if ids.shape[1] + max_new_tokens - 1 > model.config.max_position_embeddings:  # the last token is not fed back
        raise ValueError(f"the prompt's {ids.shape[1]} tokens plus max_new_tokens={max_new_tokens} exceed the "
                         f"model's max_position_embeddings={model.config.max_position_embeddings}: shorten one")
    mask = None
    if attention_mask is not None:
        mask = check_attention_mask(attention_mask, *ids.shape).to(ids.device)  # [B, T] bool
        if not mask.any(-1).all():
            raise ValueError(f"attention_mask has a row without any token: row {int((~mask.any(-1)).nonzero()[0])}")
    elif isinstance(model, K2Model):
        mask = model.infer_attention_mask(ids)  # pads at the rows' edges, as the model's own forward infers them
    allowed = None  # [B, V]: the first step's constraint under token healing
    if token_healing:
        if tokenizer is None:
            raise ValueError("token_healing needs the tokenizer: generate(..., tokenizer=tok, token_healing=True)")
        if ids.shape[1] < 2:
            raise ValueError(f"token healing drops the prompt's last token, so it needs at least 2; got {ids.shape[1]}")
        if mask is not None and not (mask[:, -1].all() and mask[:, :-1].any(-1).all()):
            raise ValueError("token healing drops each row's last token: pad on the left, with 2 tokens per row")
        allowed = healing_mask(tokenizer, ids[:, -1].tolist(), model.config.vocab_size).to(ids.device)
        ids, mask = ids[:, :-1], None if mask is None else mask[:, :-1]
    eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
    vocab = model.config.vocab_size
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < vocab):
        raise ValueError(f"eos_token_id must be a token id in 0..{vocab - 1} (or None for the config's), got {eos!r}; "
                         f"to generate past every eos, pass stop_at_eos=False")
    if not isinstance(stop_at_eos, bool):
        raise ValueError(f"stop_at_eos must be True or False, got {stop_at_eos!r}")
    eos = eos if stop_at_eos else None
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)

    reason = eager_reason(model) if compile else None  # speed/compiled_decode.py
    if reason is not None:
        # stacklevel 3: past torch.no_grad's wrapper, at the caller
        warnings.warn(f"generate(compile=True) runs eagerly: {reason}", UserWarning, stacklevel=3)
        compile = False
    out = _decode(model, ids, mask, allowed, max_new_tokens, temperature, top_k, top_p, generator, eos, attn_impl,
                  compile)
    result = torch.cat(out, dim=1)  # [B, T + n]
    if text is None:
        return result
    texts = []
    for row, real in zip(result.tolist(), (mask if mask is not None else torch.ones_like(ids, dtype=torch.bool)
                                           ).tolist(), strict=True):
        prompt = [i for i, keep in zip(row, real, strict=False) if keep]
        new = row[len(real):]
        new = new[: new.index(eos)] if eos is not None and eos in new else new
        texts.append(tokenizer.decode(prompt + new))
    return texts[0] if isinstance(text, str) else texts


def _decode(model: K2Model, ids: torch.Tensor, mask: torch.Tensor | None, allowed: torch.Tensor | None,
            max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
            generator: torch.Generator | None, eos: int | None, attn_impl: AttnImpl,
            compile: bool) -> list[torch.Tensor]:
    """generate's loop: the prompt ids [B, T], then each step's new tokens [B, 1], as a list to concatenate."""
    B, T = ids.shape
    # Storage for every position is reserved first: no step grows the cache (a compiled step must not, in its graph).
    cache = model.new_cache(B, capacity=T + max_new_tokens)
    step = None  # compile: the compiled decode step, made once the prefill has filled the cache
    done = torch.zeros(B, dtype=torch.bool, device=ids.device)
    # Where each row's next token is read: its last real token at prefill (pads may follow it), then the new one.
    last = torch.full((B,), T - 1, device=ids.device)
    if mask is not None:
        last = T - 1 - mask.flip(-1).int().argmax(-1)  # [B]
    out, step_input, step_mask = [ids], ids, mask  # the cache remembers the pads after the prefill
    for i in range(max_new_tokens):
        if i == 0 or not compile:  # the prefill runs eager: its products are large, its shapes vary
            logits = model(step_input, cache=cache, attn_impl=attn_impl, attention_mask=step_mask)  # [B, T', V]
        else:
            step = step or compiled_decode_step(model, cache, attn_impl)  # speed/compiled_decode.py
            logits = step(step_input)  # [B, 1, V]
        logits = logits[torch.arange(B, device=ids.device), last]  # [B, V]
        if bool(logits.isnan().any()):
            row = int(logits.isnan().any(-1).nonzero()[0])
            raise ValueError(f"the model's logits hold NaN at step {i} (row {row}): no token can be chosen from them; "
                             f"check the weights (torch.isfinite) and any hooks")
        if allowed is not None:
            logits, allowed = logits.masked_fill(~allowed, float("-inf")), None
        token = sample_next(logits, temperature, top_k, top_p, generator)  # [B]
        if eos is not None:
            token = token.masked_fill(done, eos)
            done |= token == eos
        out.append(token[:, None])
        step_input, step_mask, last = token[:, None], None, torch.zeros_like(last)
        if done.all():
            break
    return out
