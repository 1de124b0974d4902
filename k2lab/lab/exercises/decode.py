"""09: decoding with the learner's own latent cache. MLA over a cache at a position offset, absorbed
(``check_cached_mla``), and greedy generation through it, token for token against ``k2lab.generate``
(``check_cached_generate``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.func import functional_call

from ...config import K2Config
from ...model import K2Model, MultiHeadLatentAttention, generate
from ...model.rope import cos_sin_scale, inverse_frequencies
from ..own_training import meta_mla
from .checking import Verdict, Watch, call, checker, compare, generator

EXPANDED = ("you expanded the cached latents into every head's keys or values; attend over the cache as it is "
            "stored: the query [W_UK^T q_nope ; q_pe] against [c_KV ; k_pe], W_UV after the attention")


def rotations(cfg: K2Config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R] of the given positions, in the rotate-half layout, as K2Model computes them."""
    angles = positions.float()[:, None] * inverse_frequencies(cfg)  # [T, R/2]
    angles = torch.cat((angles, angles), dim=-1)  # [T, R]
    return angles.cos() * cos_sin_scale(cfg), angles.sin() * cos_sin_scale(cfg)


def _attention(cfg: K2Config, seed: int) -> MultiHeadLatentAttention:
    """A random MLA whose latent is far from unit rms (a forgotten norm shows) and whose rotary rows matter."""
    g = generator(seed)
    attn = MultiHeadLatentAttention(cfg)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if "layernorm" in name
                    else torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        attn.kv_a_proj_with_mqa.weight[: cfg.kv_lora_rank] *= 3.0
        attn.kv_a_proj_with_mqa.weight[cfg.kv_lora_rank:] *= 2.0
    return attn.eval()


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def _cached_variant(w: dict[str, torch.Tensor], cfg: K2Config, hidden: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, cache: torch.Tensor, *, offset: bool = True, mask: bool = True,
                    rotate_cached: bool = True, norm_cached: bool = True, k_pe_first: bool = False,
                    use_cache: bool = True, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA over a cache, written out with a switch for each usual mistake (the defaults are right): the
    checker's source of wrong answers. Returns the output and the entries attended over."""
    H, N, R, V, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    B, T, _ = hidden.shape
    eps = cfg.rms_norm_eps
    norm = lambda t, g: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * g  # noqa: E731
    q = (norm(hidden @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T).view(B, T, H, -1)
    q_nope, q_pe = q[..., :N], _turn(_deinterleave(q[..., N:]), cos[:, None], sin[:, None])
    kv_a = hidden @ w["kv_a_proj_with_mqa.weight"].T  # [B, T, C + R]
    latent = norm(kv_a[..., :C], w["kv_a_layernorm.weight"]) if norm_cached else kv_a[..., :C]
    k_pe = _turn(_deinterleave(kv_a[..., C:]), cos, sin) if rotate_cached else _deinterleave(kv_a[..., C:])
    new = torch.cat([k_pe, latent] if k_pe_first else [latent, k_pe], dim=-1)  # [B, T, C + R] as cached
    entries = torch.cat([cache, new], dim=1) if use_cache else new  # [B, S, C + R]
    S = entries.shape[1]
    c_kv, keys_pe = (entries[..., R:], entries[..., :R]) if k_pe_first else (entries[..., :C], entries[..., C:])
    w_uk, w_uv = w["kv_b_proj.weight"].view(H, N + V, C).split([N, V], dim=1)
    scores = (torch.einsum("bthn,hnc,bsc->bhts", q_nope, w_uk, c_kv) + torch.einsum("bthr,bsr->bhts", q_pe, keys_pe))
    scores = scores * (cfg.softmax_scale if scale is None else scale)
    if mask:
        visible = torch.ones(T, S, dtype=torch.bool).tril(S - T if offset else 0)  # query t sits at S - T + t
        scores = scores.masked_fill(~visible, -torch.inf)
    pattern = scores.softmax(-1).nan_to_num()
    z = torch.einsum("bhts,bsc,hvc->bthv", pattern, c_kv, w_uv).flatten(2)  # [B, T, H * V]
    out = z @ w["o_proj.weight"].T
    return out, entries


@checker
def check_cached_mla(fn: Callable) -> Verdict:
    """``fn(w, cfg, hidden [B, T, D], cos [T, R], sin [T, R], cache [B, S, C + R]) -> (out [B, T, D], cache
    [B, S + T, C + R])``: MLA for T new tokens at positions S..S+T-1 over a latent cache that holds S earlier ones,
    absorbed, as ``k2lab``'s MLA computes it with a ``LatentCache``. The new tokens' entries [c_KV ; rotated k_pe]
    are appended after the cached ones; query t (at position S + t) sees keys 0..S+t; no head's keys or values are
    built from the cache (the check watches every tensor your code makes).

    Three calls: a prompt into an empty cache (S = 0), one decode step (T = 1), and a chunk of three tokens after
    four cached ones, where the mask's offset matters."""

    cfg = K2Config.nano().replace(kv_lora_rank=40)
    attn = _attention(cfg, seed=51)
    w = {name: t.detach().clone() for name, t in attn.state_dict().items()}
    H, N, V, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    g = generator(52)
    B, width = 2, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    prompt = torch.randn(B, 7, cfg.hidden_size, generator=g)
    with torch.no_grad():
        _, full = reference_cached_mla(w, cfg, prompt, *rotations(cfg, torch.arange(7)), torch.zeros(B, 0, width))
    cases = [("a prompt into an empty cache", torch.zeros(B, 0, width), prompt[:, :5], 0),
             ("one decode step after 5 cached tokens", full[:, :5], prompt[:, 5:6], 5),
             ("3 new tokens after 4 cached ones", full[:, :4], prompt[:, 4:7], 4)]
    for what, cache, hidden, start in cases:
        positions = torch.arange(start, start + hidden.shape[1])
        cos, sin = rotations(cfg, positions)
        args = (w, cfg, hidden, cos, sin, cache)
        with torch.no_grad():
            expected_out, expected_cache = reference_cached_mla(*args)
            latents = expected_cache[..., :C]  # [B, S, C] every position's c_KV
            kv = (latents @ w["kv_b_proj.weight"].T).unflatten(-1, (H, N + V))  # [B, S, H, N + V]
        watch = (Watch().forbid(EXPANDED, kv).forbid(EXPANDED, kv[..., :N], (0, 2))
                 .forbid(EXPANDED, kv[..., N:], (0, 2)))  # whole, or per row or head, at any scale or layout
        with watch, torch.no_grad():
            out, error = call(fn, dict(w), cfg, hidden.clone(), cos.clone(), sin.clone(), cache.clone())
        if error is not None:
            return error
        label = f"MLA over the cache ({what})"
        if EXPANDED in watch.found:
            return Verdict(False, f"{label}: {EXPANDED}", mistake=EXPANDED)
        if not (isinstance(out, tuple) and len(out) == 2):
            return Verdict(False, f"{label}: return two tensors, (out [B, T, D], cache [B, S + T, C + R]), got "
                                  f"{type(out).__name__}")
        out, new_cache = out
        qk, wide = cfg.qk_head_dim, width
        with torch.no_grad():
            variants = {
                "offset": _cached_variant(*args, offset=False),
                "no mask": _cached_variant(*args, mask=False),
                "unrotated": _cached_variant(*args, rotate_cached=False),
                "unnormed": _cached_variant(*args, norm_cached=False),
                "k pe first": _cached_variant(*args, k_pe_first=True),
                "no cache": _cached_variant(*args, use_cache=False),
                "wide scale": _cached_variant(*args, scale=wide ** -0.5 * cfg.yarn_mscale ** 2),
            }
        unrotated = ("the cache holds k_pe AFTER its rotation: rotate each new token's k_pe at its own position, then "
                     "append; a cached key is never rotated again")
        unnormed = "the cache holds c_KV after kv_a_layernorm: append the normalised latent"
        pe_first = "a cache row is [c_KV ; k_pe], the latent first: you put k_pe first"
        mistakes = [
            (unrotated, variants["unrotated"][0]),
            (unnormed, variants["unnormed"][0]),
            (pe_first, variants["k pe first"][0]),
            ("your causal mask has no offset: the new token t sits at position S + t and sees every cached key, "
             "keys 0..S+t (torch.ones(T, S).tril(S - T))", variants["offset"][0]),
            ("the new tokens attend to each other's futures: query t may see the new keys up to its own position "
             "only (a causal mask over the last T keys)", variants["no mask"][0]),
            ("you ignored the cache: the new tokens must attend to every cached position too",
             variants["no cache"][0]),
            (f"the scale stays {qk}^-1/2 * m^2: the {wide}-wide cache rows do not change the scores",
             variants["wide scale"][0]),
        ]
        verdict = compare(f"{label}, output", out, expected_out, mistakes, atol=1e-4)
        if not verdict.ok:
            return verdict
        cache_mistakes = [
            (unrotated, variants["unrotated"][1]),
            (unnormed, variants["unnormed"][1]),
            (pe_first, variants["k pe first"][1]),
            ("you returned the cache without the new tokens: append their entries [c_KV ; k_pe] after the old ones",
             cache),
            ("you returned only the new tokens' entries: the cache keeps every earlier position too, old then new",
             variants["no cache"][1]),
        ]
        verdict = compare(f"{label}, cache", new_cache, expected_cache, cache_mistakes, atol=1e-4)
        if not verdict.ok:
            return verdict
    return Verdict(True, "MLA over the cache: matches k2lab's absorbed MLA with a LatentCache for a prompt, a decode "
                         "step and a chunk after cached tokens, without expanding the cache")


@checker
def check_cached_generate(fn: Callable, model: K2Model | None = None, ids: torch.Tensor | None = None,
                          new_tokens: int = 8) -> Verdict:
    """``fn(state_dict, cfg, ids [1, T], new_tokens) -> [1, T + new_tokens]``: greedy generation through your own
    latent cache (the prompt once, then one token per step at the next position), token for token equal to
    ``k2lab.generate``. By default on K2-nano and the lab's running prompt; a step that runs the whole sequence
    through the model again (no cache) is named, and so is the first step whose token differs, with both tokens."""
    if model is None or ids is None:

        model, ids = nano_and_prompt()
    ids = torch.as_tensor(ids).to(model.device)
    T, D = ids.shape[1], model.config.hidden_size
    with torch.no_grad():
        expected = generate(model, ids, max_new_tokens=new_tokens)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    watch = Watch()
    with watch, torch.no_grad():
        out, error = call(fn, state, model.config, ids.clone(), new_tokens)
    if error is not None:
        return error
    if out is None:
        return Verdict(False, "greedy generation: your function returned None; did you forget `return`?")
    out = torch.as_tensor(out).detach().cpu()
    expected = expected.cpu()
    if out.dim() == 1:
        out = out[None]
    if out.shape[-1] == new_tokens and out.shape != expected.shape:
        message = "you returned only the new tokens; return the prompt followed by them, [1, T + new_tokens]"
        return Verdict(False, f"greedy generation: {message}", mistake=message)
    if out.shape != expected.shape:
        return Verdict(False, f"greedy generation: wrong shape: got {list(out.shape)}, expected "
                              f"{list(expected.shape)} (the prompt and {new_tokens} new tokens)")
    B = ids.shape[0]  # a residual stream [B, L, D] longer than the prompt: the whole sequence run again
    regrown = sorted({s[1] for s in watch.shapes
                      if len(s) == 3 and s[0] == B and s[2] == D and T < s[1] <= T + new_tokens})
    if regrown:
        message = (f"your generation ran {regrown[0]} positions through the model at one step: after the prompt, "
                   "feed only the new token and read every earlier position from your cache")
        return Verdict(False, f"greedy generation: {message}", mistake=message)
    if not torch.equal(out[:, :T], expected[:, :T]):
        return Verdict(False, "greedy generation: the prompt at the start of your output is not the prompt given")
    differ = (out[0, T:] != expected[0, T:]).nonzero()
    if len(differ):
        step = int(differ[0])
        name = (lambda i: repr(model.tokenizer.id_to_piece(i))) if model.tokenizer is not None else str
        mine, theirs = int(out[0, T + step]), int(expected[0, T + step])
        where = ("the prompt's last logits already differ: your model is not K2-nano before any cache is involved "
                 "(check my_k2's pieces)" if step == 0 else
                 "the prompt's step agrees, so the decode path is wrong: is the new token rotated at its own "
                 "position (the cache's length), and does your cache hold every earlier position?")
        message = f"step {step} is the first that differs: yours {name(mine)} (id {mine}), k2lab's {name(theirs)} " \
                  f"(id {theirs}); {where}"
        return Verdict(False, f"greedy generation: {message}", mistake=where)
    return Verdict(True, f"greedy generation through the cache: the same {new_tokens} tokens as k2lab.generate, one "
                         f"position per decode step")


def nano_and_prompt() -> tuple[torch.nn.Module, torch.Tensor]:
    """K2-nano and the lab's running prompt, loaded once for the checks that need a trained model."""
    from ..nano import load_nano
    from ..settings import PROMPT

    model, tok = load_nano()
    return model, torch.tensor([tok.encode(PROMPT)])


def reference_cached_mla(w: dict[str, torch.Tensor], cfg: K2Config, hidden: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """09's ``my_cached_mla``: k2lab's absorbed MLA over a one-layer ``LatentCache`` that holds ``cache`` [B, S, C + R]
    before the new tokens ``hidden`` [B, T, D] (at positions S..S+T-1, whose ``cos``, ``sin`` [T, R] are given).
    Returns the output [B, T, D] and the cache with the new entries [B, S + T, C + R]."""
    from ...model import LatentCache

    lc = LatentCache(cfg, hidden.shape[0], dtype=cache.dtype, device=hidden.device, num_layers=1)
    if cache.shape[1]:
        lc.append(0, cache)
        lc.advance(cache.shape[1])
    out = functional_call(meta_mla(cfg), w, (hidden, cos, sin), {"cache": lc, "layer": 0, "attn_impl": "absorbed"})
    lc.advance(hidden.shape[1])
    return out, lc.latents(0).clone()
