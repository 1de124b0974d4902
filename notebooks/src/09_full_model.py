# %% [markdown]
# # 09 · The full model: build K2 from its weights, then run the real one
#
# This notebook has two parts.
#
# **Part 1, anywhere (K2-nano):** the end of the construction track. With the pieces of your module, `mine.py`, that
# you wrote in [02](02_yarn.ipynb) (YaRN's frequencies), [03](03_mla.ipynb) (MLA), [04a](04a_router.ipynb) (the
# router) and [04b](04b_block.ipynb) (RMSNorm, SwiGLU, the combine), you compute K2's logits from nothing but its state
# dict, and check them against k2lab's model to float32 rounding (a relative 1e-5): first a small K2 with random
# weights, then K2-nano itself. Then you decode with it through a latent cache of your own, token for token as
# `k2lab.generate` does. [10](10_training.ipynb) trains the model you assemble here.
#
# **Part 2, on a GPU node with the real weights:** the full Kimi K2 with probes. What it needs:
#
# * the checkpoint: `moonshotai/Kimi-K2-Instruct` from the Hugging Face Hub (61 shards, about 959 GiB of FP8
#   weights; fetched into the Hub cache on first use, `HF_HUB_OFFLINE=1` then reads the cache) or a local folder
#   in the release layout;
# * memory for it: about 1.03 TB of GPU memory with the weights resident (eight 141 GB GPUs,
#   `K2LAB_DEVICE_MAP=auto`; see [08 scale](08_scale.ipynb)), or less with
#   `K2LAB_EXPERT_BUDGET_GIB=...` (routed experts streamed from disk; slow) and/or `K2LAB_NUM_LAYERS=...` (a
#   prefix of the blocks);
# * the variables set before Jupyter starts, for example
#
#       K2LAB_MODEL=moonshotai/Kimi-K2-Instruct K2LAB_DEVICE_MAP=auto jupyter lab notebooks/
#
# Anywhere else (no variables, no GPU, no weights) the parameter cell falls back to K2-nano and says why, and every
# cell runs the same code on it. Nothing in the code is K2-nano specific.
#
# **What the stored outputs show, and what they do not.** The outputs saved in this notebook are K2-nano's, because
# the lab is built on a CPU. K2-nano was trained on Python source and prose, never on a chat turn: the special
# tokens of the chat template never appeared in its training text. So its "answer" in Part 2 is not an answer, and
# its logit lens at the assistant's turn predicts noise. What does carry over to the real K2, unchanged: the probe
# names and the shapes they record, the way a chat prompt is laid out and routed token by token, how to read the
# routing heatmap, the load and the bias flips, and the logit lens read at the turn's first position. A real-shape
# MoE layer with experts streamed from disk runs in [08](08_scale.ipynb) on a CPU; the whole K2 needs the GPU node.

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings, fallback_to_nano=True)
if settings.is_nano:
    about += " -- set K2LAB_MODEL to run the real K2 (see above)"
print(about)

# %% [markdown]
# # Part 1 · K2 from its weights, with your own pieces
#
# A model is its code plus a dictionary of tensors. k2lab's `K2Model` is one reading of that dictionary; in this
# part you write another, and the two must agree. Here is K2-nano's dictionary, `state_dict()`: the checkpoint's
# tensor names without the leading `model.` (the release stores each expert's matrices apart; k2lab stacks them per
# layer, [E, I, D] and [E, D, I]). One dense block, one MoE block, and the ends:

# %%
import torch
import torch.nn.functional as F

from k2lab.lab import exercises

nano, nano_tok = (model, tok) if settings.is_nano else lab.load_nano()  # Part 1 runs on K2-nano, whatever Part 2 runs
state = {name: t.detach() for name, t in nano.state_dict().items()}
for name, t in state.items():
    if name.startswith(("layers.0.", "layers.1.")) or not name.startswith("layers."):
        print(f"{name:<48} {str(list(t.shape)):<16} {str(t.dtype).removeprefix('torch.')}")
print(f"... and layers.2 to layers.{nano.config.num_hidden_layers - 1} like layers.1: {len(state)} tensors in all")

# %% [markdown]
# ## Your pieces
#
# Notebooks do not share their variables, but they share your module: every piece you wrote carries `@lab.mine`,
# which kept it in `mine.py`. Load it; a piece you have not written (or whose answer does not pass its check yet) is
# k2lab's reference, and the cell says which is which. Nothing to paste: `mine.my_mla`, `mine.my_router`, ... are
# whichever stands in your module, and you can rerun this cell after finishing an earlier exercise.

# %%
mine = lab.mine.load("my_yarn", "my_mla", "my_router", "my_rms_norm", "my_swiglu", "my_combine")

# %% [markdown]
# ### Exercise 1 ★★★ · Write it yourself: the whole K2
#
# Write `my_k2(state_dict, cfg, ids)` -> logits [B, T, V]: the embedding (a row of `embed_tokens.weight` per id),
# then every block as in [04b](04b_block.ipynb) (the first `cfg.first_k_dense_replace` with a dense SwiGLU, the
# others with the MoE: your router, the chosen experts, the shared expert, the combine), then the final norm and
# the untied head. Use the pieces of your module (`mine.my_mla`, `mine.my_router`, `mine.my_rms_norm`,
# `mine.my_swiglu`, `mine.my_combine`, `mine.my_yarn`). Positions are 0 .. T−1, so the rotations are
# angle_t,i = t · inv_freq_i, written for features i and i + R/2 (the rotate-half layout that [03](03_mla.ipynb)'s MLA
# expects): `cos`, `sin` [T, R]. Keep the stream in the weights' dtype (the router's weights come in float32: cast
# them), so that the same function runs a bfloat16 state dict too, as [08](08_scale.ipynb) gives it.
#
# Running the cell checks it (`exercises.check_model_from_weights` runs it on a small K2 with random weights, 3 blocks,
# 8 experts, norm weights far from one and a correction bias far from zero, so that the usual slips show, and compares
# its logits with k2lab's to float32 rounding; it names what it recognises: a head tied to the embedding, the final
# norm forgotten, the bias in the weights, the routed scaling or the renormalisation forgotten, the choice made without
# the bias, the shared expert forgotten) and keeps it in your module. Then the same on K2-nano, below.

# %%
@lab.mine
def my_k2(state_dict: dict[str, torch.Tensor], cfg, ids: torch.Tensor) -> torch.Tensor:
    """state_dict: K2Model.state_dict() names; ids [B, T] -> logits [B, T, V]"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# The model is a loop over the blocks between an embedding lookup and the head, and each block is 04b's: the stream
# plus attention of its normalised copy, then the stream plus the feed-forward of its second normalised copy. The
# state dict holds each block's weights under `layers.{i}.`; the first `first_k_dense_replace` blocks have a dense
# SwiGLU, the others the MoE (router, the chosen experts slot by slot, the shared expert, the combine). The rotations
# depend only on the positions, so they are computed once, before the loop.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Write it top-down. `x = state_dict["embed_tokens.weight"][ids]` is [B, T, D]. For block i with prefix
# `p = f"layers.{i}."`, the MLA's weights are the entries whose names start with `p + "self_attn."`, with that
# prefix removed (a dict comprehension). Each block: `x = x + my_mla(weights, cfg, my_rms_norm(x, ...), cos, sin)`,
# then `h = my_rms_norm(x, ...)` with the second norm and `x = x + ffn(h)`. For the MoE, flatten h to [B·T, D] for
# the router, run each chosen expert on the rows that chose it (`torch.where(idx == e)` gives rows and slots), add
# the shared expert and reshape back. End with `my_rms_norm(x, state_dict["norm.weight"], eps) @
# state_dict["lm_head.weight"].T`.

# %% [markdown] tags=["solution"]
# Three functions: the rotations, the MoE (the same loop as k2lab's reference, one pass per chosen expert), and the
# stack, each piece from your module. YaRN's factor on cos and sin (mscale / mscale_all_dim, [02](02_yarn.ipynb)) is
# exactly 1 for K2's settings, and K2-nano's, so cos and sin are the plain ones of the YaRN frequencies. The solution's
# names are its own (`solution_k2`), so running it never replaces yours.

# %% tags=["solution"]
# Solution (click to show)
def solution_rotations(cfg, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R] of positions start .. start + T - 1."""
    inv_freq, _ = mine.my_yarn(cfg)  # [R/2]
    angles = torch.arange(start, start + T, dtype=torch.float32)[:, None] * inv_freq.float()  # [T, R/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, R]: pair i's angle for features i and i + R/2
    return angles.cos(), angles.sin()


def solution_moe(h: torch.Tensor, sd: dict[str, torch.Tensor], p: str, cfg) -> torch.Tensor:
    """h [N, D] -> [N, D]: router, chosen experts, shared expert, combine."""
    idx, w = mine.my_router(h, sd[p + "gate.weight"], sd[p + "gate.e_score_correction_bias"],
                            cfg.num_experts_per_tok, cfg.routed_scaling_factor)  # [N, k] each
    out = h.new_zeros(*idx.shape, h.shape[-1])  # [N, k, D]
    for e in idx.unique().tolist():
        rows, slots = torch.where(idx == e)
        out[rows, slots] = mine.my_swiglu(h[rows], *(sd[p + f"experts.{m}_proj"][e] for m in ("gate", "up", "down")))
    shared = mine.my_swiglu(h, *(sd[p + f"shared_experts.{m}_proj.weight"] for m in ("gate", "up", "down")))
    return mine.my_combine(shared, out, w.to(h.dtype))  # the router's float32 weights in the stream's dtype


def solution_ffn(h: torch.Tensor, sd: dict[str, torch.Tensor], cfg, i: int) -> torch.Tensor:
    """Block i's feed-forward of h [B, T, D]: the dense SwiGLU, or the MoE over the flattened tokens."""
    p = f"layers.{i}.mlp."
    if i < cfg.first_k_dense_replace:
        return mine.my_swiglu(h, *(sd[p + f"{m}_proj.weight"] for m in ("gate", "up", "down")))
    return solution_moe(h.flatten(0, 1), sd, p, cfg).view_as(h)


def solution_k2(state_dict: dict[str, torch.Tensor], cfg, ids: torch.Tensor) -> torch.Tensor:
    sd, eps = state_dict, cfg.rms_norm_eps
    cos, sin = solution_rotations(cfg, 0, ids.shape[1])
    x = sd["embed_tokens.weight"][ids]  # [B, T, D]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        attn_w = {n.removeprefix(p + "self_attn."): t for n, t in sd.items() if n.startswith(p + "self_attn.")}
        x = x + mine.my_mla(attn_w, cfg, mine.my_rms_norm(x, sd[p + "input_layernorm.weight"], eps), cos, sin)
        x = x + solution_ffn(mine.my_rms_norm(x, sd[p + "post_attention_layernorm.weight"], eps), sd, cfg, i)
    return mine.my_rms_norm(x, sd["norm.weight"], eps) @ sd["lm_head.weight"].T  # [B, T, V], untied head


print(exercises.check_model_from_weights(solution_k2))

# %% [markdown]
# Then the real test: K2-nano's own weights, its trained (non-zero) router bias included, on the lab's running
# prompt, with `my_k2` from your module (yours if it passed the check above, else the reference assembly, which calls
# your other pieces all the same; the first lines say which):

# %%
mine = lab.mine.load("my_k2")
nano_ids = nano.to_tokens(lab.PROMPT)  # [1, T]
print(exercises.check_model_from_weights(mine.my_k2, nano, nano_ids))

# %% [markdown]
# ## Your model generates
#
# Greedy decoding needs nothing but the logits: feed the sequence, append the argmax, repeat (without a cache, so
# each step recomputes the whole sequence). The model of your module must produce k2lab's tokens.

# %%
# NBVAL_CHECK_OUTPUT
import k2lab

with torch.no_grad():
    recomputed = nano_ids.cpu()
    for _ in range(8):
        recomputed = torch.cat([recomputed, mine.my_k2(state, nano.config, recomputed)[:, -1:].argmax(-1)], dim=1)
print("same tokens as k2lab.generate:",
      torch.equal(recomputed, k2lab.generate(nano, nano_ids, max_new_tokens=8).cpu()))
print(repr(nano_tok.decode(recomputed[0, nano_ids.shape[1]:])))

# %% [markdown]
# The continuation is K2-nano's greedy loop, the one [06](06_logits.ipynb) explains: a 6.6 M-parameter model, once
# a phrase repeats, finds repeating it again the likeliest step. The model of your module computes what k2lab's
# does; on the real K2's state dict it would compute the real K2, given the memory of Part 2 (and the FP8 weights
# dequantized, which you did yourself in [08](08_scale.ipynb)).
#
# ## Decode it yourself: your own latent cache
#
# Each step above ran the whole sequence again. The latent cache exists to avoid that, and it is the reason MLA
# exists ([03](03_mla.ipynb)): a decode step runs only the new token through the model, and each attention layer
# reads every earlier token from its cache, 576 numbers per token in K2 ([c_KV ; k_pe], the latent after its norm
# and the rotary key after its rotation). Two things change against `my_mla`:
#
# * **the cache**: the new tokens' entries are appended after the cached ones, and attention runs over all of them,
#   absorbed (the cache is never expanded into per-head keys or values: that is the point of caching the latent);
# * **the position offset**: with S tokens cached, the T new tokens sit at positions S .. S + T − 1. Their rotations
#   are those positions' (the caller gives `cos`, `sin` for them), and the causal mask is offset: new token t sees
#   every cached key and the new keys up to itself, keys 0 .. S + t.
#
# ### Exercise 2 ★★★ · Write it yourself: MLA over your own cache
#
# `my_cached_mla(w, cfg, hidden, cos, sin, cache)`: `hidden` [B, T, D] the new tokens' normalised stream, `cos`,
# `sin` [T, R] their rotations, `cache` [B, S, C + R] what the layer cached so far (S may be 0). Return the
# attention's output [B, T, D] and the cache with the new entries appended, [B, S + T, C + R]. Running the cell checks
# it (`exercises.check_cached_mla`: a prompt into an empty cache, one decode step, and three tokens after four cached
# ones, against k2lab's MLA with its `LatentCache`; it watches for per-head keys built from the cache, and names the
# usual slips: the mask without its offset, the cache ignored, k_pe cached before its rotation, c_KV before its norm,
# the entries' order, the scale of the wider rows) and keeps it in your module.

# %%
@lab.mine
def my_cached_mla(w: dict[str, torch.Tensor], cfg, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, T, D] at positions S..S+T-1, cache [B, S, C + R] -> (out [B, T, D], cache [B, S + T, C + R])"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# The first half is your MLA's: the queries, the latent after its norm, the rotated k_pe. The new cache rows are
# [c_KV ; k_pe]; append them to the old ones. Then the absorbed attention of [03](03_mla.ipynb)'s exercise 4 over
# all S + T rows: each head's query [W_UKᵀ q_nope ; q_pe] against the rows, values the rows' c_KV part, W_UV after.
# The only new thing is the mask, [T, S + T]: row t may see columns 0 .. S + t.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `entries = torch.cat([cache, torch.cat([c_kv, k_pe], -1)], dim=1)` [B, S + T, C + R];
# `visible = torch.ones(T, S + T, dtype=torch.bool).tril(S)` (the diagonal moved right by S); scores
# `einsum("bthc,bsc->bhts", query, entries) * cfg.softmax_scale`, `masked_fill(~visible, -inf)`, softmax; the latent
# output `einsum("bhts,bsc->bthc", pattern, entries[..., :C])`, then W_UV and `o_proj`. Return `(out, entries)`.

# %% [markdown] tags=["solution"]
# The naive path's first half (03's solution wrote it as `mla_inputs`; it is spelled out here), the append, and the
# absorbed attention with the offset mask:

# %% tags=["solution"]
# Solution (click to show)
def solution_cached_mla(w, cfg, hidden, cos, sin, cache):
    H, N, R, V, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    B, T, _ = hidden.shape
    eps = cfg.rms_norm_eps

    def deinterleave(x):  # the checkpoint's neighbour pairs to the rotate-half layout
        return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)

    def turn(x, cos, sin):  # the rotation from precomputed cos, sin
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin

    c_q = mine.my_rms_norm(hidden @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], eps)
    q = (c_q @ w["q_b_proj.weight"].T).view(B, T, H, N + R)
    q_nope, q_pe = q[..., :N], turn(deinterleave(q[..., N:]), cos[:, None], sin[:, None])
    kv_a = hidden @ w["kv_a_proj_with_mqa.weight"].T  # [B, T, C + R]
    c_kv = mine.my_rms_norm(kv_a[..., :C], w["kv_a_layernorm.weight"], eps)  # [B, T, C]
    k_pe = turn(deinterleave(kv_a[..., C:]), cos, sin)  # [B, T, R], rotated at the new positions
    entries = torch.cat([cache, torch.cat([c_kv, k_pe], dim=-1)], dim=1)  # [B, S + T, C + R]: old, then new
    S = entries.shape[1]
    w_uk, w_uv = w["kv_b_proj.weight"].view(H, N + V, C).split([N, V], dim=1)  # [H, N, C], [H, V, C]
    query = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w_uk), q_pe], dim=-1)  # [B, T, H, C + R]
    scores = torch.einsum("bthc,bsc->bhts", query, entries) * cfg.softmax_scale  # [B, H, T, S]
    visible = torch.ones(T, S, dtype=torch.bool, device=hidden.device).tril(S - T)  # query t is at S - T + t
    pattern = scores.masked_fill(~visible, -torch.inf).softmax(-1)
    latent_out = torch.einsum("bhts,bsc->bthc", pattern, entries[..., :C])  # [B, T, H, C]
    z = torch.einsum("bthc,hvc->bthv", latent_out, w_uv)  # [B, T, H, V]
    return z.flatten(2) @ w["o_proj.weight"].T, entries


print(exercises.check_cached_mla(solution_cached_mla))

# %% [markdown]
# ### Exercise 3 ★ · Predict, then run: where positions stop being shift-invariant
#
# The check of exercise 1 passes even if your rotations start at position 1 instead of 0: shift every position of a
# whole sequence by one, and every logit stays the same (to float32 rounding). Now use `my_cached_mla` from your
# module on K2-nano's layer 1 and predict two things before you run them:
#
# 1. the whole prompt at positions 0 .. T − 1 against 1 .. T, with an empty cache: the same outputs?
# 2. the prompt's first T − 1 tokens cached at positions 0 .. T − 2, then its last token as a decode step at position
#    T − 1 (right) against T (one too far): the same output?

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# A score depends on its query's and its key's positions only through their difference (02). Shifting every token
# shifts both sides of every score; shifting only the new token does not, when the keys' rotations are frozen in the
# cache.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `_, c = nano.run_with_cache(nano_ids, names="layers.1.input_layernorm.hook_out")` gives the layer's input [1, T, D];
# its weights are `{n.removeprefix("layers.1.self_attn."): t for n, t in state.items() if n.startswith(
# "layers.1.self_attn.")}`; `solution_rotations(nano.config, start, T)` gives cos, sin of positions start ..
# start + T − 1, and an empty cache is `torch.zeros(1, 0, C + R)`.

# %% [markdown] tags=["solution"]
# 1. The same, to float32 rounding: every query and every key moves by one position, so every distance, and every
# score, is what it was. A whole-sequence forward cannot see where positions start, which is why the check of
# exercise 1 passes with rotations from 1. 2. Different: the cached keys keep the rotations of the positions they had
# when they were cached, and only the new token moves, so every distance it sees is one too long. Once a cache is
# involved, the new token must be rotated at exactly its own position, the cache's length.

# %% tags=["solution"]
# Solution (click to show)
mine = lab.mine.load("my_cached_mla", quiet=True)
_, layer1 = nano.run_with_cache(nano_ids, names="layers.1.input_layernorm.hook_out")
x1 = layer1["layers.1.input_layernorm.hook_out"].float().cpu()  # [1, T, D]
w1 = {n.removeprefix("layers.1.self_attn."): t for n, t in state.items() if n.startswith("layers.1.self_attn.")}
T, width = x1.shape[1], nano.config.kv_lora_rank + nano.config.qk_rope_head_dim
empty = torch.zeros(1, 0, width)
from_0, _ = mine.my_cached_mla(w1, nano.config, x1, *solution_rotations(nano.config, 0, T), empty)
from_1, _ = mine.my_cached_mla(w1, nano.config, x1, *solution_rotations(nano.config, 1, T), empty)
_, cached = mine.my_cached_mla(w1, nano.config, x1[:, :-1], *solution_rotations(nano.config, 0, T - 1), empty)
right, _ = mine.my_cached_mla(w1, nano.config, x1[:, -1:], *solution_rotations(nano.config, T - 1, 1), cached)
too_far, _ = mine.my_cached_mla(w1, nano.config, x1[:, -1:], *solution_rotations(nano.config, T, 1), cached)
print(f"1. whole prompt from position 0 and from 1: max |difference| = {(from_0 - from_1).abs().max():.1e}")
print(f"2. decode step at position {T - 1} and at {T}: max |difference| = {(right - too_far).abs().max():.1e} "
      f"(outputs up to {right.abs().max():.2f}); the step at {T - 1} equals the whole prompt's last position: "
      f"{torch.allclose(right, from_0[:, -1:], atol=1e-5)}")

# %% [markdown]
# ### Exercise 4 ★★★ · Write it yourself: greedy generation with your cache
#
# `my_generate(state_dict, cfg, ids, new_tokens)`: the prompt once through the model, every layer filling its cache
# (`my_cached_mla` with an empty one), then one token per step: the argmax of the last logits, appended, and run alone
# through the model at the next position, each layer reading and extending its cache. Return [1, T + new_tokens].
# Running the cell checks it (`exercises.check_cached_generate`: on K2-nano and the running prompt, token for token
# against `k2lab.generate`; it says which step first differs, with both tokens, and notices a step that runs the whole
# sequence again) and keeps it in your module.

# %%
@lab.mine
def my_generate(state_dict: dict[str, torch.Tensor], cfg, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """greedy decoding through one latent cache per layer: ids [1, T] -> [1, T + new_tokens]"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Your `my_k2` with two changes: it runs only the new tokens, at positions that start where the cache ends, and its
# attention is `my_cached_mla`, which returns each layer's grown cache for the next call. Everything else in a block
# (norms, the feed-forward) works on the new tokens alone. The prompt is the first call, with empty caches; each step
# after it feeds one token.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Keep `caches = [torch.zeros(B, 0, C + R) for _ in range(cfg.num_hidden_layers)]`. Write `forward(new_ids, start)`
# -> logits [B, T_new, V]: cos, sin of positions `start .. start + T_new − 1`; for layer i,
# `out, caches[i] = mine.my_cached_mla(weights_i, cfg, norm(x), cos, sin, caches[i])`. Then
# `logits = forward(ids, 0)`; in the loop `next_id = logits[:, -1:].argmax(-1)`, append it, and
# `logits = forward(next_id, ids.shape[1] - 1)`.

# %% [markdown] tags=["solution"]
# Exercise 1's model, run on the new tokens only and with a cache per layer; the positions continue where the caches
# end:

# %% tags=["solution"]
# Solution (click to show)
def solution_generate(state_dict: dict[str, torch.Tensor], cfg, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    sd, eps = state_dict, cfg.rms_norm_eps
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    caches = [torch.zeros(ids.shape[0], 0, width, dtype=sd["norm.weight"].dtype, device=ids.device)
              for _ in range(cfg.num_hidden_layers)]

    def forward(new_ids: torch.Tensor, start: int) -> torch.Tensor:
        cos, sin = solution_rotations(cfg, start, new_ids.shape[1])  # the new tokens' own positions
        x = sd["embed_tokens.weight"][new_ids]  # [B, T_new, D]
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            attn_w = {n.removeprefix(p + "self_attn."): t for n, t in sd.items() if n.startswith(p + "self_attn.")}
            out, caches[i] = mine.my_cached_mla(attn_w, cfg, mine.my_rms_norm(x, sd[p + "input_layernorm.weight"],
                                                                              eps), cos, sin, caches[i])
            x = x + out
            x = x + solution_ffn(mine.my_rms_norm(x, sd[p + "post_attention_layernorm.weight"], eps), sd, cfg, i)
        return mine.my_rms_norm(x, sd["norm.weight"], eps) @ sd["lm_head.weight"].T  # [B, T_new, V]

    logits = forward(ids, 0)  # the prompt fills every cache
    for step in range(new_tokens):
        next_id = logits[:, -1:].argmax(-1)  # [B, 1]
        ids = torch.cat([ids, next_id], dim=1)
        if step + 1 < new_tokens:
            logits = forward(next_id, ids.shape[1] - 1)  # one token, at the position after the cached ones
    return ids


print(exercises.check_cached_generate(solution_generate))

# %% [markdown]
# `my_generate` of your module (yours, or the reference: `k2lab.generate` itself) on K2-nano, against
# `k2lab.generate`, and its speed against the recomputing loop above:

# %%
mine = lab.mine.load("my_generate", "my_cached_mla")

# %%
# NBVAL_CHECK_OUTPUT
import time

with torch.no_grad():
    start = time.perf_counter()
    decoded = mine.my_generate(state, nano.config, nano_ids.cpu(), 16)
    cached_s = time.perf_counter() - start
print("my_generate, 16 tokens, the same as k2lab.generate:",
      torch.equal(decoded, k2lab.generate(nano, nano_ids, max_new_tokens=16).cpu()))

# %%
with torch.no_grad():
    start = time.perf_counter()
    recomputed = nano_ids.cpu()
    for _ in range(16):
        recomputed = torch.cat([recomputed, mine.my_k2(state, nano.config, recomputed)[:, -1:].argmax(-1)], dim=1)
    recompute_s = time.perf_counter() - start
print(f"16 tokens: {cached_s:.2f} s through the cache, {recompute_s:.2f} s recomputing every step "
      f"(a {nano_ids.shape[1]}-token prompt; the gap grows with the context)")

# %% [markdown]
# # Part 2 · The real K2, with probes
#
# ## A real prompt
#
# A chat turn, laid out by K2's [chat template](GLOSSARY.md#chat-template) (see [01 tokens](01_tokens.ipynb)):

# %%
import torch

question = "Write a Python function that checks whether a string is a palindrome."
messages = [{"role": "user", "content": question}]
ids = torch.tensor([tok.apply_chat_template(messages)], device=model.device)  # [B=1, T], ends with the assistant's header
tokens = [tok.id_to_piece(i) for i in ids[0].tolist()]
print(f"{ids.shape[1]} tokens; the last ones: {tokens[-6:]}")

# %% [markdown]
# One forward pass records the router probes and the residual stream. Recorded tensors are moved to the CPU
# (`device="cpu"`), which also gathers them from several GPUs.

# %%
from k2lab import routing

wanted = lambda name: ".mlp.gate." in name or name.endswith("hook_resid_post")
logits, cache = model.run_with_cache(ids, names=wanted, device="cpu")
tr = routing.RoutingTrace.from_cache(cache)  # [L_moe, B, T, ...]
print(f"{len(tr.layers)} MoE layers, top-{tr.indices.shape[-1]} of {tr.scores.shape[-1]} experts")

# %% [markdown]
# ## The routing heatmap
#
# Pick a layer: each row is a token of the prompt, each coloured cell an expert it used, coloured by its weight.
# Look for columns that light up for the template's tokens (the `<|im_...|>` markers, role names) or for runs of
# similar words.

# %% tags=["nbval-ignore-output"]
from k2lab import viz

viz.widgets.routing_explorer(tr, tokens)

# %% [markdown]
# Where do the template's tokens go? The chat markers are the same in every conversation, and attention is
# causal, so the markers before the user's text are routed the same whatever the question. The last MoE layer's
# experts for each special token, against those of the question's words:

# %%
specials = set(tok.special_tokens.values())
last = tr.layers[-1]
for t, token_id in enumerate(ids[0].tolist()):
    if token_id in specials or t == ids.shape[1] - 1:
        print(f"position {t:>2} {tokens[t]!r:<18} experts {tr.indices[tr.row(last), 0, t].tolist()}")
text_positions = [t for t, i in enumerate(ids[0].tolist()) if i not in specials]
print(f"{len(text_positions)} ordinary tokens use {len(set(tr.indices[tr.row(last), 0, text_positions].flatten().tolist()))} "
      f"distinct experts in layer {last}")

# %% [markdown]
# In K2-nano the markers share a few experts (the same three or four recur): their embeddings were never trained,
# so they look alike to the router. On the real K2, trained on many chat turns, the same table shows which experts
# serve the template.
#
# Over the whole prompt, how evenly were the experts used, layer by layer? (One prompt is a small sample: expect
# many idle experts, drawn in grey.)

# %% tags=["nbval-ignore-output"]
counts = routing.expert_counts(tr)  # [L_moe, E]
viz.load_figure(routing.relative_load(counts), tr.layers, title="Expert load on this prompt")

# %% [markdown]
# And where did the correction bias change a token's experts?

# %% tags=["nbval-ignore-output"]
viz.bias_flip_figure(tr.bias_flips[:, 0].float().mean(-1), tr.layers)

# %% [markdown]
# ## The next token, layer by layer
#
# What does the model "say" after each block, at the last position (the assistant's turn is about to begin)? The
# logit lens of [06](06_logits.ipynb) answers it: apply the final norm and the head to a middle layer's residual,
# as if the model stopped there.
#
# ### Exercise 5 ★ · Write it yourself: the logit lens
#
# From one layer's residual stream, the logits the model would give if it stopped there. Running the cell checks it
# (`exercises.check_logit_lens`) and keeps it; the cell after the solution applies it to every layer's
# `hook_resid_post` at the last position and compares with `cache.logit_lens(pos=-1)`.

# %%
@lab.mine
def my_logit_lens(resid: torch.Tensor, norm, head) -> torch.Tensor:
    """resid [T, D]; norm, head: the model's final norm and lm_head -> logits [T, V] (float32)"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Pretend the model ended after this layer: what does it do after its last block?

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# The same two steps as after the last block ([06](06_logits.ipynb)): `head(norm(resid))`, returned in float32.
# Not a softmax: logits.

# %% [markdown] tags=["solution"]
# The final norm, then the head, in float32; then every layer's last position through it:

# %% tags=["solution"]
# Solution (click to show)
def solution_logit_lens(resid: torch.Tensor, norm, head) -> torch.Tensor:
    return head(norm(resid)).float()


print(exercises.check_logit_lens(solution_logit_lens))

# %% [markdown]
# `my_logit_lens` of your module (yours if it passed its check, else the reference) over the layers (every layer of
# K2-nano; about twelve of the real K2's 61):

# %%
mine = lab.mine.load("my_logit_lens")
resid = cache.stack("hook_resid_post")[:, 0, -1].to(model.device, model.dtype)  # [L, D] the last position
lens = mine.my_logit_lens(resid, model.norm, model.lm_head).cpu()  # [L, V]
print("equal to cache.logit_lens(pos=-1):", torch.allclose(lens, cache.logit_lens(pos=-1)[:, 0], atol=1e-4))
top = lens.softmax(-1).max(-1)
for layer, (p, i) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True)):
    if layer % max(1, len(lens) // 12) == 0 or layer == len(lens) - 1:
        print(f"layer {layer:>2}: {tok.id_to_piece(i)!r:<16} p = {p:.2f}")

# %% [markdown]
# On K2-nano the middle layers predict a comma or a newline and the last layer spreads its probability thin: the
# assistant's header is text it never saw, so no layer knows what follows it. On the real K2 this table shows at
# which depth the first word of the answer takes shape.
#
# ## The answer
#
# Greedy decoding through the latent cache:

# %%
import k2lab

out = k2lab.generate(model, ids, max_new_tokens=40)
print(tok.decode(out[0, ids.shape[1]:]))

# %% [markdown]
# On the real K2 this is the start of an answer. From K2-nano it is Python-flavoured noise that soon repeats
# itself: a model that never saw an assistant's turn continues it with the only text it knows (docstring prose
# from the standard library), and greedy decoding in a small model falls into loops ([00](00_tour.ipynb)).
#
# ## More exercises
#
# ### Exercise 6 ★★ · Predict, then run: which positions can a new question re-route?
#
# Change the question (keep it one user message) and trace the routing again. For which positions can the experts
# change, and for which can they not? Predict from the causal mask, then compare the two traces position by
# position.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# A token's router input depends only on the tokens up to it: attention is causal.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Find the first position where the two id sequences differ; compare `tr.indices[:, 0, t]` of both traces (`routing.trace(model, other_ids)`)
# before and after it.

# %% [markdown] tags=["solution"]
# Every position before the first token that differs routes identically in every layer: it cannot see the
# question. From there on anything may change. With "Sort a list of numbers in Python." the first difference is at
# position 29 (the question's first word); positions 0 to 28 route identically, and none of the 15 positions after
# that which both prompts have keeps all its experts in every layer (K2-nano's answer, printed below).

# %% tags=["solution"]
# Solution (click to show)
other = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "Sort a list of numbers in Python."}])],
                     device=model.device)
tr_other = routing.trace(model, other)
first = next(t for t, (a, b) in enumerate(zip(ids[0].tolist(), other[0].tolist(), strict=False)) if a != b)
same = [torch.equal(tr.indices[:, 0, t], tr_other.indices[:, 0, t].to(tr.indices.device))  # tr was gathered to the CPU
        for t in range(min(ids.shape[1], other.shape[1]))]
print(f"first differing token at position {first}; routing identical at positions 0..{first - 1}: "
      f"{all(same[:first])}; identical afterwards at {sum(same[first:])} of {len(same) - first} shared positions")

# %% [markdown]
# ### Exercise 7 ★ · Change a knob: your own system message
#
# Give the conversation your own system message (`{"role": "system", "content": ...}` first) and count the tokens:
# how many does K2's default system prompt take?

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# The template adds a default system turn when the conversation has none. A turn ends where the next one begins.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# The template adds a default system turn when the conversation has none (`k2lab.tokenizer.chat.DEFAULT_SYSTEM_PROMPT`).
# The system turn ends where the user's begins: look for the id of `<|im_user|>` (`tok.special_tokens`).

# %% [markdown] tags=["solution"]
# The default system message ("You are Kimi, an AI assistant created by Moonshot AI.") is added only when none is
# given. With K2-nano's tokenizer it takes 26 of the prompt's 52 tokens: its turn runs from `<|im_system|>` to its
# `<|im_end|>`, and 22 of those tokens are the message's text. With "Be brief." the system turn is 10 tokens and the
# whole prompt 36. These counts come from K2-nano's tokenizer; with `K2LAB_MODEL` set, the cell prints those of K2's
# own (the default prompt is the release's chat template, `tokenizer_config.json`).

# %% tags=["solution"]
# Solution (click to show)
from k2lab.tokenizer.chat import DEFAULT_SYSTEM_PROMPT

own = [{"role": "system", "content": "Be brief."}, *messages]
with_own = tok.apply_chat_template(own)
user_turn = tok.special_tokens["<|im_user|>"]  # each system turn ends where the user's turn begins
print(f"the default system turn: {ids[0].tolist().index(user_turn)} of the prompt's {ids.shape[1]} tokens, "
      f"{len(tok.encode(DEFAULT_SYSTEM_PROMPT))} of them its text")
print(f"with 'Be brief.': a system turn of {with_own.index(user_turn)} tokens, {len(with_own)} in all")
