# %% [markdown]
# # 03 · Multi-head latent attention
#
# When a model generates, each new token attends over every token before it. Recomputing all their keys and values at
# every step would be wasteful, so they are kept in the [KV cache](GLOSSARY.md#kv-cache), and at long context the
# cache, not the weights, decides how many sequences fit on a GPU and how fast each step runs: every decode step reads
# all of it. This notebook follows the answers to "how small can the cache be?" from ordinary attention to K2's
# **multi-head latent attention** ([MLA](GLOSSARY.md#mla)), then has you write MLA from its weights, twice: as the
# formulas read, and in the *absorbed* form that decodes from the small cache.

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings)
print(about)

# %% [markdown]
# ## From MHA to MLA: what each token leaves in the cache
#
# * **Multi-head attention** (MHA, Vaswani et al. 2017): every head has its own key and value for every token. With
#   K2's head shapes (64 heads, keys of 192 features, values of 128) that is 64 × (192 + 128) = 20,480 numbers per
#   token per layer.
# * **Multi-query attention** (MQA, Shazeer 2019): all query heads share ONE key and one value per token: 64 times
#   less cache, at a cost in quality, since every head must read the same keys.
# * **Grouped-query attention** (GQA, Ainslie et al. 2023): a middle way, G groups of heads, each group sharing a key
#   and a value.
# * **Multi-head latent attention** (MLA, the DeepSeek-V2 paper, 2024): cache one compressed vector per token, the
#   **[latent](GLOSSARY.md#latent)** c_KV (512 numbers in K2), and rebuild every head's key and value from it with a
#   learned matrix; plus ONE 64-number rotary key shared by all heads (why it is separate is explained below). Every
#   head still gets keys and values of its own, as in MHA, from a cache about the size of MQA's.
#
# The DeepSeek-V2 paper tabulates these caches per token and reports ablations in its appendix: on its dense models
# MHA beat GQA and MQA, and on its MoE models MLA scored better than MHA while caching a small fraction of MHA's
# cache. K2 takes MLA over from DeepSeek-V3 (the K2 report, §2.3, with the same latent and head widths in the
# released `config.json`), but with 64 heads instead of DeepSeek-V3's 128, which the report explains by the attention
# cost at long context. What the sources leave unsaid: the ablations are DeepSeek's, on DeepSeek's models and
# benchmarks; they show *that* MLA did better, not *why*; and the K2 report runs no attention ablation of its own.
#
# ### Exercise 1 ★ · Write it yourself: the cache's bytes
#
# `my_kv_cache_bytes(cfg, tokens)`: the bytes of MLA's cache in bfloat16 (2 bytes a number), over all layers, for
# `tokens` positions. Per token and layer MLA caches `kv_lora_rank` + `qk_rope_head_dim` numbers. Running the cell
# checks it (`exercises.check_kv_cache_bytes` compares with `k2lab.kv_cache_bytes` for K2 and K2-nano, and names the
# usual slips: one layer only, 4 bytes a number, k_pe or c_KV forgotten, the expanded cache) and keeps it in your
# module.

# %%
import torch

import k2lab
from k2lab import K2Config
from k2lab.lab import exercises

k2 = K2Config.kimi_k2()


@lab.mine
def my_kv_cache_bytes(cfg: K2Config, tokens: int) -> int:
    """bytes of the latent KV cache (bfloat16) for ``tokens`` positions, all layers"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# The cache keeps the same few numbers for every token in every layer, and nothing else: count one token's numbers
# in one layer, then multiply out.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Numbers per token and layer, times 2 bytes, times `cfg.num_hidden_layers`, times `tokens`.

# %% [markdown] tags=["solution"]
# (512 + 64) numbers × 2 bytes × 61 layers = 70,272 bytes per token for K2:

# %% tags=["solution"]
# Solution (click to show)
def solution_kv_cache_bytes(cfg: K2Config, tokens: int) -> int:
    return tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * cfg.num_hidden_layers


print(exercises.check_kv_cache_bytes(solution_kv_cache_bytes))

# %% [markdown]
# With `my_kv_cache_bytes` from your module for MLA (yours if it passed its check; the next cell says which) and the
# same arithmetic for the others, K2's shapes under each scheme (bfloat16, all 61 layers; GQA with 8 groups, a common
# choice):

# %%
mine = lab.mine.load("my_kv_cache_bytes")

# %%
# NBVAL_CHECK_OUTPUT
H, L = k2.num_attention_heads, k2.num_hidden_layers
per_head = k2.qk_head_dim + k2.v_head_dim  # 192 + 128 numbers: one head's key and value
schemes = {"MHA (64 heads)": H * per_head * 2 * L, "GQA (8 groups)": 8 * per_head * 2 * L,
           "MQA (1 group)": per_head * 2 * L, "MLA (c_KV + k_pe)": mine.my_kv_cache_bytes(k2, 1)}
for name, nbytes in schemes.items():
    print(f"{name:<18} {nbytes:>10,} bytes per token, {nbytes * 131_072 / 2**30:6.1f} GiB at 131,072 tokens")
print(f"MHA / MLA = {schemes['MHA (64 heads)'] / schemes['MLA (c_KV + k_pe)']:.1f}")
print(f"k2lab.kv_cache_bytes: latent {k2lab.kv_cache_bytes(k2, 1):,}, expanded {k2lab.kv_cache_bytes(k2, 1, layout='expanded'):,}")

# %% [markdown]
# MLA's 70,272 bytes sit between MQA and GQA with 2 groups, 35.6 times less than MHA's 2.38 MiB. Both are
# arithmetic on the released config; the 2.38 MiB is also what the release's own `modeling_deepseek.py` caches, since it expands
# and stores every head's keys and values. Which of the two Moonshot's own serving stack keeps, the sources do not
# say.
#
# K2-nano's own cache object holds the same (C + R) numbers per token and layer, in float32:

# %%
# NBVAL_CHECK_OUTPUT
ids = model.to_tokens(lab.PROMPT)  # [B=1, T] on the model's device: the lab's running prompt
kv = model.new_cache(batch_size=1)
model(ids, cache=kv)
print(kv)
width = model.config.kv_lora_rank + model.config.qk_rope_head_dim  # C + R
print(f"{kv.nbytes // kv.length:,} bytes per token = {width} values x {kv.dtype.itemsize} bytes x "
      f"{len(model.layers)} layers")

# %% [markdown]
# ## MLA, step by step
#
# Per token x (width D = 7,168 in K2), one MLA layer computes, with the checkpoint's tensor names:
#
# | step | weights | formula | K2 shape |
# | --- | --- | --- | --- |
# | query latent | `q_a_proj`, `q_a_layernorm` | c_Q = RMSNorm(W_DQ x) | 1,536 |
# | queries | `q_b_proj` | [q_nope; q_pe] = W_UQ c_Q, per head | 64 × (128 + 64) |
# | key-value latent, rotary key | `kv_a_proj_with_mqa` | [c_KV; k_pe] = W_DKV x | 512 + 64 |
# | normalised latent | `kv_a_layernorm` | c_KV = RMSNorm(c_KV) | 512 |
# | keys and values | `kv_b_proj` | [k_nope; v] = [W_UK; W_UV] c_KV, per head | 64 × (128 + 128) |
# | rotation | (RoPE, notebook [02](02_yarn.ipynb)) | q_pe and k_pe turned by position | 64 × 64, 64 |
# | scores | | scale · (q_nope · k_nope + q_pe · k_pe), causal | 64 × T × T |
# | output | `o_proj` | o_proj(concat_h softmax(scores_h) v_h) | 7,168 |
#
# k_pe is **one** 64-feature key shared by all heads (the `_with_mqa` in the name: the rotary part is multi-query).
# The score of query t and key s in head h has two terms, the *content part* and the
# *[rotary part](GLOSSARY.md#rotary-part)*; only the rotary part is turned by RoPE:
#
# $$\text{score}_h(t, s) = \text{scale}\cdot\big(q^{nope}_{h,t}\cdot k^{nope}_{h,s} + q^{pe}_{h,t}\cdot k^{pe}_{s}\big),
#   \qquad \text{scale} = 192^{-1/2}\, m^2 \ \text{(notebook 02)}.$$
#
# Only c_KV and the rotated k_pe are cached: 512 + 64 = 576 numbers per token per layer. Every intermediate has a probe
# under `layers.{i}.self_attn`; their shapes in K2-nano (4 heads of 32 + 16, latents of 48 and 32), for the running
# prompt:

# %%
# NBVAL_CHECK_OUTPUT
tokens = [tok.id_to_piece(i) for i in ids[0].tolist()]
logits, cache = model.run_with_cache(ids, names=[".self_attn.", "input_layernorm.hook_out", "hook_attn_out"])
for probe in ["hook_q_latent", "hook_q_nope", "hook_q_pe", "hook_kv_latent", "hook_k_pe", "hook_rot_k_pe",
              "hook_pattern", "hook_z"]:
    print(f"layers.1.self_attn.{probe:<16} {list(cache[f'layers.1.self_attn.{probe}'].shape)}")
print({name: list(t.shape) for name, t in model.layers[1].self_attn.state_dict().items()})

# %% [markdown]
# ### The rotary features, as the checkpoint stores them
#
# In 02 you wrote `my_rotate` for the rotate-half layout, each pair (x_i, x_{i+R/2}). The checkpoint's projections
# write each pair as neighbours instead, (x_0, x_1), (x_2, x_3), ..., and the released code de-interleaves them
# before rotating: `x.view(..., R/2, 2).transpose(-1, -2).reshape(..., R)` puts the evens first, then the odds.
# Your two pieces from 02 come from your module, `mine.py` (k2lab's reference stands in for a piece you have not
# written; the cell below says which); with them, the model's rotated shared key `hook_rot_k_pe` is the rotation of
# its de-interleaved `hook_k_pe`:

# %%
mine = lab.mine.load("my_rotate", "my_yarn")

# %%
# NBVAL_CHECK_OUTPUT
from k2lab.model import rope


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): the checkpoint's neighbour pairs to the rotate-half layout."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


cfg = model.config
positions = torch.arange(ids.shape[1])
inv_freq = mine.my_yarn(cfg)[0].float()
k_pe = cache["layers.1.self_attn.hook_k_pe"][0].float().cpu()  # [T, R] as kv_a_proj_with_mqa wrote it
rotated = mine.my_rotate(deinterleave(k_pe), positions, inv_freq)
print("my_rotate(deinterleave(k_pe)) == hook_rot_k_pe:",
      torch.allclose(rotated, cache["layers.1.self_attn.hook_rot_k_pe"][0].float().cpu(), atol=1e-5))

# %% [markdown]
# `my_rotate` computed cos and sin of p·θ_i itself. The model computes them once per forward pass for all its
# layers and hands each attention layer `cos, sin` of shape [T, R] (each pair's angle written twice, for x_i and for
# x_{i+R/2}). The same rotation from them is `x * cos + rotate_half(x) * sin`, with `rotate_half(x)` = [−x_{second
# half}, x_{first half}]:

# %%
# NBVAL_CHECK_OUTPUT
def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """my_rotate, from precomputed cos and sin [T, R] (broadcast against x)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


angles = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)  # [T, R]: each pair's angle, twice
factor = rope.cos_sin_scale(cfg)  # YaRN's factor on cos and sin: 1.0 for K2 and K2-nano (notebook 02)
cos, sin = angles.cos() * factor, angles.sin() * factor
print("turn(x, cos, sin) == my_rotate(x, positions, inv_freq):",
      torch.allclose(turn(deinterleave(k_pe), cos, sin), rotated, atol=1e-6))

# %% [markdown]
# ### Exercise 2 ★★★ · Write it yourself: MLA from the weights
#
# `my_mla(w, cfg, hidden, cos, sin)`: one MLA layer's output [B, T, D] for `hidden` [B, T, D], from the weights `w`
# (a dict under the checkpoint's names: `q_a_proj.weight`, `q_a_layernorm.weight`, `q_b_proj.weight`,
# `kv_a_proj_with_mqa.weight`, `kv_a_layernorm.weight`, `kv_b_proj.weight`, `o_proj.weight`; a weight is
# [out, in], so a projection is `x @ W.T`). The config gives the widths (`num_attention_heads`, `qk_nope_head_dim`,
# `qk_rope_head_dim`, `v_head_dim`, `kv_lora_rank`), `rms_norm_eps` and `softmax_scale` (yours from 02 gives the same).
# `cos, sin` [T, R] are for the de-interleaved layout; queries attend causally. Follow the table row by row; `turn`
# and `deinterleave` above are yours to use.
#
# Running the cell checks it (`exercises.check_mla_forward`) and keeps it in your module. The check runs your
# function on random weights and names the slip it recognises: a norm forgotten, the nope/rope
# or c_KV/k_pe or k_nope/v split taken the wrong way round, no de-interleave, no rotation, or the rotation backwards,
# no causal mask, a wrong scale (m forgotten or not squared, N instead of N + R), the softmax over the wrong axis,
# o_proj forgotten.

# %%
@lab.mine
def my_mla(w: dict[str, torch.Tensor], cfg: K2Config, hidden: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> torch.Tensor:
    """hidden [B, T, D] -> [B, T, D], naive MLA from the weights"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Two paths leave the input. The query path: down to c_Q, normalise, up to every head's [q_nope | q_pe]. The key
# path: down to [c_KV | k_pe], normalise c_KV only, up to every head's [k_nope | v]; k_pe stays one vector per token,
# shared by the heads. Only q_pe and k_pe are rotated (after de-interleaving). Each score adds a content and a rotary
# dot product, is scaled, masked causally and softmaxed over the keys; the values' weighted sum goes through o_proj.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# RMSNorm is `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight`. Shape the queries as
# `.view(B, T, H, N + R)` and split `[..., :N]`, `[..., N:]`; `kv_a_proj_with_mqa` gives `[..., :C]` (the latent) then
# `[..., C:]` (k_pe, [B, T, R], no head axis); `kv_b_proj` of the normed latent `.view(B, T, H, N + V)` splits into
# k_nope and v. Rotate `deinterleave(q_pe)` with `cos[:, None], sin[:, None]` (a head axis to broadcast over) and
# `deinterleave(k_pe)` with `cos, sin`. Scores `einsum("bthn,bshn->bhts")` plus `einsum("bthr,bsr->bhts")`; mask with
# `torch.ones(T, T, dtype=torch.bool).tril()`; softmax over the keys (the last axis); `einsum("bhts,bshv->bthv")`,
# flatten the heads, `o_proj`.

# %% [markdown] tags=["solution"]
# The table, row by row. The only subtle lines are the splits (each widths' order is the checkpoint's) and the shared
# k_pe, which has no head axis: the einsum for the rotary term broadcasts it over the heads. The solution is named
# `solution_mla`, so running it never replaces yours.

# %% tags=["solution"]
# Solution (click to show)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def mla_inputs(w, cfg, hidden, cos, sin):
    """q_nope [B, T, H, N], rotated q_pe [B, T, H, R], c_KV [B, T, C], rotated k_pe [B, T, R]."""
    H, N, R, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    B, T, _ = hidden.shape
    c_q = rms_norm(hidden @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], cfg.rms_norm_eps)
    q = (c_q @ w["q_b_proj.weight"].T).view(B, T, H, N + R)
    q_nope, q_pe = q[..., :N], turn(deinterleave(q[..., N:]), cos[:, None], sin[:, None])
    kv_a = hidden @ w["kv_a_proj_with_mqa.weight"].T  # [B, T, C + R]
    c_kv = rms_norm(kv_a[..., :C], w["kv_a_layernorm.weight"], cfg.rms_norm_eps)
    k_pe = turn(deinterleave(kv_a[..., C:]), cos, sin)  # ONE rotary key per position, shared by the heads
    return q_nope, q_pe, c_kv, k_pe


def solution_mla(w, cfg, hidden, cos, sin):
    H, N, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    B, T, _ = hidden.shape
    q_nope, q_pe, c_kv, k_pe = mla_inputs(w, cfg, hidden, cos, sin)
    kv = (c_kv @ w["kv_b_proj.weight"].T).view(B, T, H, N + V)  # every head's keys and values, expanded
    k_nope, v = kv[..., :N], kv[..., N:]
    scores = torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
    causal = torch.ones(T, T, dtype=torch.bool, device=hidden.device).tril()
    pattern = (scores * cfg.softmax_scale).masked_fill(~causal, -torch.inf).softmax(-1)  # [B, H, T, S]
    z = torch.einsum("bhts,bshv->bthv", pattern, v).flatten(2)  # [B, T, H*V]
    return z @ w["o_proj.weight"].T


print(exercises.check_mla_forward(solution_mla))

# %% [markdown]
# ### Your MLA inside K2-nano
#
# The check used random weights. Now the real thing: layer 1 of the model, its weights from its `state_dict`, its
# input the recorded output of the block's first norm, cos and sin from the YaRN frequencies of your module; the
# output of `my_mla` from your module (yours if it passed its check, else k2lab's reference: the next cell says which)
# against the recorded `layers.1.hook_attn_out`:

# %%
mine = lab.mine.load("my_yarn", "my_mla")

# %%
# NBVAL_CHECK_OUTPUT
attn = model.layers[1].self_attn
w = {name: t.detach().float().cpu() for name, t in attn.state_dict().items()}
hidden = cache["layers.1.input_layernorm.hook_out"].float().cpu()  # [1, T, D]
out = mine.my_mla(w, cfg, hidden, cos, sin)
reference = cache["layers.1.hook_attn_out"].float().cpu()
gap = (out - reference).abs().max().item()
tolerance = 1e-5 if model.dtype == torch.float32 else 3e-2  # a bfloat16 model computed the reference more coarsely
print(f"my_mla == layer 1's attention: {gap <= tolerance * max(1.0, reference.abs().max().item())}")

# %% [markdown]
# ## The absorbed form: attention over the cache itself
#
# `my_mla` expands the latent into every head's keys and values, for the whole context, at every step: exactly the
# work (and, if cached, the memory) MLA set out to avoid. The **[absorbed](GLOSSARY.md#absorption)** form never
# builds them. Write W_UK,h [N × C] and W_UV,h [V × C] for head h's two blocks of `kv_b_proj`, so that
# k_nope = W_UK,h c_s and v = W_UV,h c_s.
#
# **Fold 1: W_UK into the query.** For the content part of the score,
#
# $$q^{nope}_{h,t}\cdot k^{nope}_{h,s} = q_{h,t}^{\top}\,(W_{UK,h}\, c_s) = (W_{UK,h}^{\top}\, q_{h,t})^{\top} c_s
#   = \tilde q_{h,t}\cdot c_s, \qquad \tilde q_{h,t} = W_{UK,h}^{\top} q_{h,t} \in \mathbb{R}^{C}.$$
#
# W_UK moves from every key (S of them) to the one query: each head's query is mapped into latent space once, and
# scored directly against the cached latents.
#
# ### Exercise 3 ★★ · Write it yourself: the absorbed score
#
# Given the queries and the cached latents, compute every head's scaled scores **without building k_nope**: fold
# W_UK into the query, add the rotary part, scale. The check watches every tensor your code makes: a per-head key
# built anyway, whole or one head at a time, fails it even when the scores are right.

# %%
@lab.mine
def my_absorbed_score(q_nope, q_pe, c_kv, k_pe, w_uk, scale) -> torch.Tensor:
    """q_nope [T, H, N], q_pe [T, H, R], c_kv [S, C], k_pe [S, R], w_uk [H, N, C] -> scores [H, T, S] (no mask)"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Fold 1 above, term by term: map each head's query into latent space with W_UKᵀ (C numbers per head and query) and
# dot it with every cached latent; the rotary term needs no folding, since k_pe is already one vector per position.
# Mind the order in which you multiply: W_UK must meet the query first.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `torch.einsum("thn,hnc->htc", q_nope, w_uk)` is every head's W_UKᵀ q, [H, T, C]; multiply by `c_kv.T` for the
# content part. The rotary part needs no folding: `einsum("thr,sr->hts", q_pe, k_pe)`.

# %% [markdown] tags=["solution"]
# Map each head's query into latent space with W_UKᵀ, score against the latents, add the rotary part, scale the sum.
# On layer 1's probes it reproduces the model's own scores:

# %% tags=["solution"]
# Solution (click to show)
def solution_absorbed_score(q_nope, q_pe, c_kv, k_pe, w_uk, scale) -> torch.Tensor:
    q_latent = torch.einsum("thn,hnc->htc", q_nope, w_uk)  # [H, T, C]
    return scale * (q_latent @ c_kv.T + torch.einsum("thr,sr->hts", q_pe, k_pe))


print(exercises.check_absorbed_score(solution_absorbed_score))
p = "layers.1.self_attn."
w_uk = w["kv_b_proj.weight"].view(attn.num_heads, attn.nope_dim + attn.v_dim, -1)[:, :attn.nope_dim]  # [H, N, C]
solved = solution_absorbed_score(*(cache[p + name][0].float().cpu() for name in ("hook_q_nope", "hook_rot_q_pe",
                                                                              "hook_kv_latent", "hook_rot_k_pe")),
                                 w_uk, attn.softmax_scale)
scores = cache[p + "hook_attn_scores"][0].float().cpu()  # [H, T, S], -inf above the diagonal
print(f"layer 1, all heads: max |solution - hook_attn_scores| = "
      f"{(solved - scores)[scores.isfinite()].abs().max():.1e}")

# %% [markdown]
# **Fold 2: W_UV after attention.** Head h's output is a weighted sum of values, and W_UV,h is the same for every
# position s, so it comes out of the sum:
#
# $$z_{h,t} = \sum_s p_{h,t,s}\, W_{UV,h}\, c_s = W_{UV,h}\Big(\sum_s p_{h,t,s}\, c_s\Big) = W_{UV,h}\,\bar c_{h,t}.$$
#
# Attend over the latents themselves, then map the C-wide result to the head's V features. (The output projection
# computes out_t = Σ_h W_O,h z_h,t = Σ_h (W_O,h W_UV,h) c̄_h,t, so W_O,h W_UV,h [D × C] could even be multiplied once,
# ahead of time.)
#
# **Both folds: one multi-query attention.** Put the folded query and the rotary query side by side, and the latent
# and the rotary key side by side:
#
# $$\text{score}_h(t, s) = \text{scale}\cdot\big[\,W_{UK,h}^{\top} q^{nope}_{h,t}\,;\, q^{pe}_{h,t}\,\big]\cdot
#   \big[\,c_s\,;\,k^{pe}_s\,\big].$$
#
# The key [c_s ; k_pe,s] (576 numbers in K2) is exactly the cache entry, the same for every head, and the value is its
# first 512 numbers, c_s: this is **multi-query attention** with 576-wide keys and 512-wide values, over the cache as
# it is stored. It is how DeepSeek's FlashMLA decode kernel computes MLA. And the scale stays 192^{-1/2}·m²: the
# scores are the same numbers as the naive ones, the same sums regrouped, so the 576-wide vectors must not bring a
# 576^{-1/2} of their own; the scale is part of the trained model, not of the width we happen to multiply in.
#
# ### Exercise 4 ★★★ · Write it yourself: absorbed MLA, as one multi-query attention
#
# `my_mla_absorbed(w, cfg, hidden, cos, sin)`: the same inputs and output as `my_mla`, computed as the one MQA above,
# then W_UV and `o_proj`. It may not build any head's keys or values (the check watches every tensor, whole or sliced
# by head), and it must give the naive output.

# %%
@lab.mine
def my_mla_absorbed(w: dict[str, torch.Tensor], cfg: K2Config, hidden: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
    """hidden [B, T, D] -> [B, T, D], attending over [c_KV ; k_pe] without expanding it"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Everything up to the latent and the rotated k_pe is the naive path's. Then one attention whose keys are the cache
# rows [c_KV ; k_pe] (the same for every head), whose queries are each head's [W_UKᵀ q_nope ; q_pe], and whose values
# are the c_KV rows themselves; only after the weighted sum does each head's W_UV turn C numbers into V. The scale is
# the naive one.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Reuse the first half of your `my_mla` (up to c_KV and the rotated k_pe). Split `kv_b_proj.weight` as
# `.view(H, N + V, C)` into W_UK `[:, :N]` and W_UV `[:, N:]`. Query `torch.cat([einsum("bthn,hnc->bthc", q_nope,
# W_UK), q_pe], -1)` [B, T, H, C + R]; key `torch.cat([c_kv, k_pe], -1)` [B, S, C + R]; scores
# `einsum("bthc,bsc->bhts")` × `cfg.softmax_scale`, mask, softmax; latent output `einsum("bhts,bsc->bthc", pattern,
# c_kv)`; then `einsum("bthc,hvc->bthv", ..., W_UV)`, flatten, `o_proj`.

# %% [markdown] tags=["solution"]
# The naive first half, then one MQA over the cache entries [c_KV ; k_pe] with c_KV as the values, then W_UV per head
# and o_proj. Nothing of size [B, S, H, N] or [B, S, H, V] is ever made. Below it, fold 2 on layer 1's probes, and the
# W_O·W_UV product multiplied ahead of time:

# %% tags=["solution"]
# Solution (click to show)
def solution_mla_absorbed(w, cfg, hidden, cos, sin):
    H, N, V, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    T = hidden.shape[1]
    q_nope, q_pe, c_kv, k_pe = mla_inputs(w, cfg, hidden, cos, sin)
    w_uk, w_uv = w["kv_b_proj.weight"].view(H, N + V, C).split([N, V], dim=1)  # [H, N, C], [H, V, C]
    query = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w_uk), q_pe], dim=-1)  # [B, T, H, C + R]
    keys = torch.cat([c_kv, k_pe], dim=-1)  # [B, S, C + R]: the cache entries, one per position, for every head
    scores = torch.einsum("bthc,bsc->bhts", query, keys) * cfg.softmax_scale  # the naive scale: the same scores
    causal = torch.ones(T, T, dtype=torch.bool, device=hidden.device).tril()
    pattern = scores.masked_fill(~causal, -torch.inf).softmax(-1)
    latent_out = torch.einsum("bhts,bsc->bthc", pattern, c_kv)  # attend over the latents themselves: [B, T, H, C]
    z = torch.einsum("bthc,hvc->bthv", latent_out, w_uv)  # fold 2: W_UV after attention
    return z.flatten(2) @ w["o_proj.weight"].T


print(exercises.check_mla_forward(solution_mla_absorbed, absorbed=True))
print(f"on layer 1: max |absorbed - naive| = "
      f"{(solution_mla_absorbed(w, cfg, hidden, cos, sin) - solution_mla(w, cfg, hidden, cos, sin)).abs().max():.1e}")

Hn, Nn, Vn = attn.num_heads, attn.nope_dim, attn.v_dim
w_uv = w["kv_b_proj.weight"].view(Hn, Nn + Vn, -1)[:, Nn:]  # [H, V, C]
pattern, c_kv = cache[p + "hook_pattern"][0].float().cpu(), cache[p + "hook_kv_latent"][0].float().cpu()
v = torch.einsum("hvc,sc->hsv", w_uv, c_kv)  # [H, S, V]: the values the naive path builds
print(f"fold 2, head outputs z: max |naive - absorbed| = "
      f"{(pattern @ v - torch.einsum('hvc,htc->htv', w_uv, pattern @ c_kv)).abs().max():.1e}")
w_o_uv = torch.einsum("dhv,hvc->hdc", w["o_proj.weight"].view(-1, Hn, Vn), w_uv)  # [H, D, C]: W_O,h W_UV,h
folded = torch.einsum("hdc,htc->td", w_o_uv, pattern @ c_kv)  # [T, D]
print(f"W_O W_UV multiplied once: max |o_proj(z) - folded| = "
      f"{((pattern @ v).transpose(0, 1).flatten(1) @ w['o_proj.weight'].T - folded).abs().max():.1e}")

# %% [markdown]
# The model runs either path (`attn_impl`). Over the whole model the two agree to float32 rounding:

# %%
naive = model(ids, attn_impl="naive")
absorbed = model(ids, attn_impl="absorbed")
print(f"logits: max |naive - absorbed| = {(naive - absorbed).abs().max().item():.1e} "
      f"(logits up to {naive.abs().max().item():.1f})")

# %%
# NBVAL_CHECK_OUTPUT
print("naive and absorbed logits agree to float32 rounding:", torch.allclose(naive, absorbed, atol=1e-4))
_, naive_cache = model.run_with_cache(ids, names="hook_pattern", attn_impl="naive")
same = all(torch.allclose(naive_cache[n], cache[n], atol=1e-5) for n in naive_cache)
print(f"attention patterns equal in every layer: {same}")

# %% [markdown]
# ## Why RoPE is decoupled
#
# Why not rotate k_nope itself, as ordinary attention rotates its keys? With rotations R_t (query position t) and
# R_s (key position s),
#
# $$(R_t\, q)^{\top} (R_s\, W_{UK}\, c_s) = q^{\top} R_{s-t}\, W_{UK}\, c_s .$$
#
# The matrix between q and c_s now depends on s − t, a different one for every key, so no single W_UK^T can be
# folded into the query ahead of attention: the absorbed path would have to expand every key again. MLA therefore
# keeps the rotation off the latent path. A small separate **rotary part** carries it: 64 features of each head's
# query, and ONE 64-feature key per token computed from x and shared by all heads (so it costs the cache only 64
# values). Its score term q_pe · k_pe is added to the content term, and RoPE turns only these features.

# %% [markdown]
# ## What a decode step costs
#
# When generating, each new token attends over the whole context S, so every step reads the whole cache. Per
# layer, with H heads:
#
# | | bytes read | attention FLOPs |
# | --- | --- | --- |
# | expanded cache | S · H · (N + R + V) · 2 | 2·H·S·(N + R) + 2·H·S·V |
# | absorbed, latent cache | S · (C + R) · 2 | 2·H·S·(C + R) + 2·H·S·C |
#
# The absorbed path does about 3.4 times **more** arithmetic (it attends in 576 dimensions instead of 192) but
# reads 35.6 times fewer bytes. Decoding is limited by memory bandwidth, so this is a good trade: the arithmetic
# per byte read rises from 1 to about 120 FLOPs.

# %%
H, N, R, V, C, L = (k2.num_attention_heads, k2.qk_nope_head_dim, k2.qk_rope_head_dim, k2.v_head_dim,
                    k2.kv_lora_rank, k2.num_hidden_layers)
context = [2**p for p in range(8, 18)]  # 256 .. 131,072


def decode_cost(S: int) -> dict[str, float]:
    """Bytes read and attention FLOPs of one decode step over context S, all layers."""
    return {
        "expanded GiB": L * S * H * (N + R + V) * 2 / 2**30, "latent GiB": L * S * (C + R) * 2 / 2**30,
        "expanded GFLOP": L * (2 * H * S * (N + R) + 2 * H * S * V) / 1e9,
        "latent GFLOP": L * (2 * H * S * (C + R) + 2 * H * S * C) / 1e9,
    }


costs = [decode_cost(S) for S in context]
S = 8192
c = decode_cost(S)
print(f"at S = {S:,}: expanded {c['expanded GFLOP'] / c['expanded GiB'] / 2**30 * 1e9:.1f} FLOP/byte, "
      f"absorbed {c['latent GFLOP'] / c['latent GiB'] / 2**30 * 1e9:.0f} FLOP/byte; the absorbed path reads "
      f"{c['expanded GiB'] / c['latent GiB']:.1f} times fewer bytes and does {c['latent GFLOP'] / c['expanded GFLOP']:.1f} "
      f"times the FLOPs")

# %% tags=["nbval-ignore-output"]
from k2lab import viz

series = lambda key: {"expanded cache": [x[f"expanded {key}"] for x in costs],
                      "latent cache (absorbed)": [x[f"latent {key}"] for x in costs]}
viz.lines_figure(context, {"bytes read per decode step = cache size (GiB)": series("GiB"),
                           "attention FLOPs per decode step (GFLOP)": series("GFLOP")},
                 "context length (tokens)", log_x=True, log_y=True,
                 colors={"expanded cache": viz.style.NAIVE,
                         "latent cache (absorbed)": viz.style.ABSORBED},
                 title="Kimi K2, all 61 layers: one decode step against context length")

# %% [markdown]
# Both panels are straight lines in log-log: bytes and FLOPs grow in proportion to the context. On the left the
# latent cache stays 35.6 times below the expanded one at every length; on the right it costs about 3.4 times more
# arithmetic, which a GPU has to spare while it waits for the bytes.
#
# ## Attention patterns in K2-nano
#
# `hook_pattern` holds each head's softmax weights [B, H, T, S]: row t shows where query t looks. Pick a layer and
# look for heads that attend to the previous token, to the first token, or to an earlier occurrence of the same
# name.

# %% tags=["nbval-ignore-output"]
patterns = cache.stack("hook_pattern")[:, 0]  # [L, H, T, S]
viz.widgets.attention_explorer(patterns, tokens)

# %% [markdown]
# ## Content part against rotary part
#
# How much does each term contribute to the scores? Both are rebuilt from the probes and the weights (the content
# part through fold 1), and their sum must be the model's own scores. For every layer and head, the mean size of
# each term over the positions a query may see:

# %%
def score_terms(layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(content, rotary) parts of one head's scaled scores [T, S], from the probes and kv_b_proj."""
    attn, p = model.layers[layer].self_attn, f"layers.{layer}.self_attn."
    w_uk = attn.kv_b_proj.weight.view(attn.num_heads, attn.nope_dim + attn.v_dim, -1)[head, :attn.nope_dim]  # [N, C]
    q_nope, q_pe = cache[p + "hook_q_nope"][0, :, head], cache[p + "hook_rot_q_pe"][0, :, head]  # [T, N], [T, R]
    c_kv, k_pe = cache[p + "hook_kv_latent"][0], cache[p + "hook_rot_k_pe"][0]  # [S, C], [S, R]
    return attn.softmax_scale * (q_nope @ w_uk) @ c_kv.T, attn.softmax_scale * q_pe @ k_pe.T


visible = cache["layers.0.self_attn.hook_attn_scores"][0, 0].isfinite()  # [T, S] causal
sizes = {"content part": [], "rotary part": []}
labels, agree = [], True
for layer in range(len(model.layers)):
    for head in range(model.config.num_attention_heads):
        content, rotary = score_terms(layer, head)
        scores = cache[f"layers.{layer}.self_attn.hook_attn_scores"][0, head]
        agree &= torch.allclose((content + rotary)[visible], scores[visible], atol=1e-4)
        sizes["content part"].append(content[visible].abs().mean().item())
        sizes["rotary part"].append(rotary[visible].abs().mean().item())
        labels.append(f"L{layer}.h{head}")
print("content + rotary == hook_attn_scores in every head:", agree)
share = torch.tensor(sizes["rotary part"]) / (torch.tensor(sizes["rotary part"]) + torch.tensor(sizes["content part"]))
for layer in range(len(model.layers)):
    heads = share.view(len(model.layers), -1)[layer]
    print(f"layer {layer}: rotary share of |score| per head {[round(x, 2) for x in heads.tolist()]}")

# %% tags=["nbval-ignore-output"]
viz.layer_bars_figure(sizes, labels, "mean |term| over visible (t, s)",
                      title="Size of each score term, per layer and head (running prompt)", x_title="layer.head")

# %% [markdown]
# What K2-nano does, read from the numbers above: the **rotary part dominates** its scores. In layers 0 to 2 it
# is 96-100% of their size in every head, so the pattern there is set almost entirely by q_pe · k_pe, whose
# rotation makes it depend on the distance between the tokens; the content part takes a real share only in a few
# heads of the later layers (about 40% in layer 4's head 0). Remember that the rotary part is computed from the
# tokens too: it is not "position" alone, but a term that RoPE makes distance-sensitive. K2-nano is small and
# briefly trained; the real K2's heads need not split the same way, and the same cells measure them on a GPU node.
#
# One head, term by term: the head where the content part is largest. Each panel has its own colour range, so the
# smaller term stays visible (compare the colour bars for their sizes):

# %% tags=["nbval-ignore-output"]
layer, head = divmod(int(share.argmin()), model.config.num_attention_heads)
content, rotary = score_terms(layer, head)
viz.score_split_figure(content, rotary, tokens,
                       title=f"Layer {layer}, head {head}: score = content part + rotary part (own colour ranges)")

# %% [markdown]
# ## More exercises
#
# ### Exercise 5 ★ · Predict, then run
#
# DeepSeek-V3 has 128 heads where K2 has 64, with the same head and latent widths. Predict how the per-token cache
# of MLA and of MHA each change with twice the heads, then check with `k2lab.kv_cache_bytes` on
# `k2.replace(num_attention_heads=128)` (`layout="expanded"` for MHA's).

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Ask of every number each cache keeps per token: does it exist once per head, or once per token?

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `k2lab.kv_cache_bytes(k2.replace(num_attention_heads=128), 1)` and the same with `layout="expanded"`, beside K2's.

# %% [markdown] tags=["solution"]
# MLA's cache has no head axis: c_KV and the shared k_pe are per token, so 70,272 bytes stay 70,272. MHA's doubles.
# More heads cost MLA only attention arithmetic (each head scores against the same cache), which is the cost the K2
# report weighs when it halves the heads.

# %% tags=["solution"]
# Solution (click to show)
for heads in (64, 128):
    cfg_h = k2.replace(num_attention_heads=heads)
    print(f"{heads} heads: MLA {k2lab.kv_cache_bytes(cfg_h, 1):,} bytes per token, "
          f"MHA {k2lab.kv_cache_bytes(cfg_h, 1, layout='expanded'):,}")

# %% [markdown]
# ### Exercise 6 ★ · Change a knob
#
# Copy the model to bfloat16 (`copy.deepcopy(model).to(torch.bfloat16)`) and compare the naive and absorbed logits
# again. Predict first: does the gap stay near 1e-5, and do the two paths still pick the same top token at every
# position?

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# The two paths compute the same sums in another order. How many digits does each partial sum keep in bfloat16?

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `half = copy.deepcopy(model).to(torch.bfloat16)`, then `half(ids, attn_impl="naive")` and `"absorbed"`; compare
# their largest difference and their `argmax(-1)`.

# %% [markdown] tags=["solution"]
# bfloat16 keeps 8 bits of mantissa, so the two orders of summation drift apart far more than in float32; the printed
# gap is the answer. The top tokens can still mostly agree: differences smaller than the gap between the first and
# second logit do not change the argmax.

# %% tags=["solution"]
# Solution (click to show)
import copy

half = copy.deepcopy(model).to(torch.bfloat16)
naive16, absorbed16 = half(ids, attn_impl="naive"), half(ids, attn_impl="absorbed")
print(f"bfloat16: max |naive - absorbed| = {(naive16 - absorbed16).abs().max().item():.2e}; "
      f"same top token at {(naive16.argmax(-1) == absorbed16.argmax(-1)).float().mean().item():.0%} of positions")
