# %% [markdown]
# # 03 · Multi-head latent attention
#
# In ordinary multi-head attention every token writes a key and a value **per head** into the
# [KV cache](GLOSSARY.md#kv-cache). For K2
# (64 heads, keys of 192 features, values of 128) that would be 64 × 320 = 20,480 numbers per token per layer.
# MLA caches a compressed **[latent](GLOSSARY.md#latent)** instead, and rebuilds each head's keys and values from
# it.
#
# Per token x (width D = 7,168), one MLA layer computes:
#
# | step | formula | K2 shape |
# | --- | --- | --- |
# | query latent | c_Q = RMSNorm(W_DQ x) | 1,536 |
# | queries | [q_nope; q_pe] = W_UQ c_Q, per head | 64 × (128 + 64) |
# | key-value latent and rotary key | [c_KV; k_pe] = W_DKV x, then c_KV = RMSNorm(c_KV) | 512 + 64 |
# | keys and values | k_nope = W_UK c_KV, v = W_UV c_KV, per head | 64 × (128 + 128) |
# | rotary key | k_pe is **one** 64-feature key shared by all heads, rotated once | 64 |
#
# The score of query t and key s in head h has two terms, the *content part* and the
# *[rotary part](GLOSSARY.md#rotary-part)*. Both are computed from the tokens; only the rotary part is also turned
# by RoPE, by an angle that depends on the position ([02](02_yarn.ipynb)):
#
# $$\text{score}_h(t, s) = \text{scale}\cdot\big(q^{nope}_{h,t}\cdot k^{nope}_{h,s} + q^{pe}_{h,t}\cdot k^{pe}_{s}\big).$$
#
# Only c_KV and the rotated k_pe are cached: 512 + 64 = 576 numbers per token per layer.

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings)
print(about)

# %% [markdown]
# ## The probes along the way
#
# Every intermediate above has a probe under `layers.{i}.self_attn`. Their shapes, for one prompt of T tokens:

# %%
# NBVAL_CHECK_OUTPUT
import torch

ids = model.to_tokens(lab.PROMPT)  # [B=1, T] on the model's device: the lab's running prompt
tokens = [tok.id_to_piece(i) for i in ids[0].tolist()]
logits, cache = model.run_with_cache(ids, names=".self_attn.")
for probe in ["hook_q_latent", "hook_q_nope", "hook_rot_q_pe", "hook_kv_latent", "hook_rot_k_pe",
              "hook_pattern", "hook_z"]:
    print(f"layers.1.self_attn.{probe:<16} {list(cache[f'layers.1.self_attn.{probe}'].shape)}")

# %% [markdown]
# ## Naive and absorbed attention
#
# The **naive** path expands the latents into every head's keys and values for the whole context, then attends
# as usual. The **[absorbed](GLOSSARY.md#absorption)** path never builds them. Write W_UK,h [N × C] and
# W_UV,h [V × C] for head h's two blocks of `kv_b_proj`, so that k_nope = W_UK,h c_s and v = W_UV,h c_s.
#
# **Fold 1: W_UK into the query.** For the content part of the score,
#
# $$q^{nope}_{h,t}\cdot k^{nope}_{h,s} = q_{h,t}^{\top}\,(W_{UK,h}\, c_s) = (W_{UK,h}^{\top}\, q_{h,t})^{\top} c_s
#   = \tilde q_{h,t}\cdot c_s, \qquad \tilde q_{h,t} = W_{UK,h}^{\top} q_{h,t} \in \mathbb{R}^{C}.$$
#
# W_UK moves from every key (S of them) to the one query: each head's query is mapped into latent space once, and
# scored directly against the cached latents.
#
# **Fold 2: W_UV after attention, into the output projection.** Head h's output is a weighted sum of values,
# and W_UV,h is the same for every position s, so it comes out of the sum:
#
# $$z_{h,t} = \sum_s p_{h,t,s}\, W_{UV,h}\, c_s = W_{UV,h}\Big(\sum_s p_{h,t,s}\, c_s\Big) = W_{UV,h}\,\bar c_{h,t}.$$
#
# The output projection then computes out_t = Σ_h W_O,h z_h,t = Σ_h (W_O,h W_UV,h) c̄_h,t: the product
# W_O,h W_UV,h [D × C] could be multiplied once, ahead of time. (k2lab applies W_UV right after attention, which
# is the same sum in another order.)
#
# With both folds, attention runs over the 576-wide cached entries as one
# [multi-query attention](GLOSSARY.md#mqa) shared by all heads. Each fold, on layer 1 of the running prompt:

# %%
layer = 1
attn, p = model.layers[layer].self_attn, f"layers.{layer}.self_attn."
Hn, Nn, Vn = attn.num_heads, attn.nope_dim, attn.v_dim
w_kv_b = attn.kv_b_proj.weight.view(Hn, Nn + Vn, -1)  # [H, N + V, C]
w_uk, w_uv = w_kv_b[:, :Nn], w_kv_b[:, Nn:]  # [H, N, C], [H, V, C]
q_nope, c_kv = cache[p + "hook_q_nope"][0], cache[p + "hook_kv_latent"][0]  # [T, H, N], [S, C]
pattern = cache[p + "hook_pattern"][0]  # [H, T, S]

k_nope = torch.einsum("hnc,sc->hsn", w_uk, c_kv)  # [H, S, N]: the naive path builds every head's keys
naive_content = torch.einsum("thn,hsn->hts", q_nope, k_nope)  # [H, T, S]
q_latent = torch.einsum("hnc,thn->htc", w_uk, q_nope)  # [H, T, C]: fold 1, W_UK^T q
absorbed_content = q_latent @ c_kv.T  # [H, T, S]
print(f"fold 1, content scores: max |naive - absorbed| = {(naive_content - absorbed_content).abs().max():.1e} "
      f"(scores up to {naive_content.abs().max():.1f})")

v = torch.einsum("hvc,sc->hsv", w_uv, c_kv)  # [H, S, V]: the naive path builds every head's values
naive_z = pattern @ v  # [H, T, V]
absorbed_z = torch.einsum("hvc,htc->htv", w_uv, pattern @ c_kv)  # fold 2: W_UV (sum_s p c_s)
print(f"fold 2, head outputs z:   max |naive - absorbed| = {(naive_z - absorbed_z).abs().max():.1e}")
w_o = attn.o_proj.weight.view(-1, Hn, Vn)  # [D, H, V]
w_o_uv = torch.einsum("dhv,hvc->hdc", w_o, w_uv)  # [H, D, C]: W_O,h W_UV,h, multiplied once
out_folded = torch.einsum("hdc,htc->td", w_o_uv, pattern @ c_kv)  # [T, D]
print(f"fold 2 into o_proj:       max |o_proj(z) - folded| = "
      f"{(attn.o_proj(naive_z.transpose(0, 1).flatten(1)) - out_folded).abs().max():.1e}")

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
# ## The cache: 70,272 bytes per token instead of 2.4 MiB
#
# Per token and layer, the latent cache holds 576 numbers; an implementation that caches every head's keys and
# values holds 64 × (192 + 128) = 20,480. In bfloat16 over K2's 61 layers:

# %%
# NBVAL_CHECK_OUTPUT
import k2lab
from k2lab import K2Config

k2 = K2Config.kimi_k2()
latent, expanded = k2lab.kv_cache_bytes(k2, 1), k2lab.kv_cache_bytes(k2, 1, layout="expanded")
print(f"latent:   ({k2.kv_lora_rank} + {k2.qk_rope_head_dim}) x 2 bytes x {k2.num_hidden_layers} "
      f"layers = {latent:,} bytes per token")
print(f"expanded: {k2.num_attention_heads} x ({k2.qk_head_dim} + {k2.v_head_dim}) x 2 x "
      f"{k2.num_hidden_layers} = {expanded:,} bytes = {expanded / 2**20:.2f} MiB per token "
      f"({expanded / latent:.1f} x more)")
print(f"a full 131,072-token context: {k2lab.kv_cache_bytes(k2, 131_072) / 2**30:.1f} GiB latent, "
      f"{k2lab.kv_cache_bytes(k2, 131_072, layout='expanded') / 2**30:.0f} GiB expanded")

# %% [markdown]
# The model's own cache object agrees: after a prefill it holds (C + R) values per token per layer.

# %%
# NBVAL_CHECK_OUTPUT
kv = model.new_cache(batch_size=1)
model(ids, cache=kv)
print(kv)
width = model.config.kv_lora_rank + model.config.qk_rope_head_dim  # C + R
print(f"{kv.nbytes // kv.length:,} bytes per token = {width} values x {kv.dtype.itemsize} bytes x "
      f"{len(model.layers)} layers")

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
# reads 35 times fewer bytes. Decoding is limited by memory bandwidth, so this is a good trade: the arithmetic
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
      f"absorbed {c['latent GFLOP'] / c['latent GiB'] / 2**30 * 1e9:.0f} FLOP/byte")

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
# ## Exercises
#
# **1. Predict, then run.** If K2's kv_lora_rank were 256 instead of 512, how many bytes per token would its latent
# cache take over 61 layers in bfloat16? Predict, then run `k2lab.kv_cache_bytes(k2.replace(kv_lora_rank=256), 1)`.
#
# **2. Change a knob.** Copy the model to bfloat16 (`copy.deepcopy(model).to(torch.bfloat16)`) and compare the
# naive and absorbed logits again. Predict first: does the gap stay near 1e-6, and do the two paths still pick the
# same top token at every position?

# %%
# your code here

# %% [markdown]
# **3. Write it yourself: the absorbed score.** Given one position's queries and the cached latents, compute every
# head's scaled scores without building k_nope: fold W_UK into the query, add the rotary part, scale. Then use it
# on layer 1's probes and compare with `hook_attn_scores`.

# %%
from k2lab.lab import exercises


def my_absorbed_score(q_nope, q_pe, c_kv, k_pe, w_uk, scale) -> torch.Tensor:
    """q_nope [T, H, N], q_pe [T, H, R], c_kv [S, C], k_pe [S, R], w_uk [H, N, C] -> scores [H, T, S] (no mask)"""
    raise NotImplementedError


print(exercises.check_absorbed_score(my_absorbed_score))

# %% [markdown]
# ## Solutions
#
# **1.** (256 + 64) × 2 bytes × 61 layers = 39,040 bytes per token, 56% of K2's 70,272.

# %% tags=["solution"]
print(f"{k2lab.kv_cache_bytes(k2.replace(kv_lora_rank=256), 1):,} bytes per token")

# %% [markdown]
# **2.** bfloat16 keeps 8 bits of mantissa, so the two orders of summation drift apart far more than in float32;
# the printed gap is the answer. The top tokens can still mostly agree: differences smaller than the gap between the
# first and second logit do not change the argmax.

# %% tags=["solution"]
import copy

half = copy.deepcopy(model).to(torch.bfloat16)
naive16, absorbed16 = half(ids, attn_impl="naive"), half(ids, attn_impl="absorbed")
print(f"bfloat16: max |naive - absorbed| = {(naive16 - absorbed16).abs().max().item():.2e}; "
      f"same top token at {(naive16.argmax(-1) == absorbed16.argmax(-1)).float().mean().item():.0%} of positions")

# %% [markdown]
# **3.** Map each head's query into latent space with W_UK^T, score against the latents, add the rotary part:

# %% tags=["solution"]
def my_absorbed_score(q_nope, q_pe, c_kv, k_pe, w_uk, scale) -> torch.Tensor:
    q_latent = torch.einsum("thn,hnc->htc", q_nope, w_uk)  # [H, T, C]
    return scale * (q_latent @ c_kv.T + torch.einsum("thr,sr->hts", q_pe, k_pe))


assert exercises.check_absorbed_score(my_absorbed_score)
print(exercises.check_absorbed_score(my_absorbed_score))
attn, p = model.layers[1].self_attn, "layers.1.self_attn."
w_uk = attn.kv_b_proj.weight.view(attn.num_heads, attn.nope_dim + attn.v_dim, -1)[:, :attn.nope_dim]  # [H, N, C]
mine = my_absorbed_score(cache[p + "hook_q_nope"][0], cache[p + "hook_rot_q_pe"][0], cache[p + "hook_kv_latent"][0],
                         cache[p + "hook_rot_k_pe"][0], w_uk, attn.softmax_scale)
scores = cache[p + "hook_attn_scores"][0]  # [H, T, S], -inf above the diagonal
print(f"layer 1, all heads: max |mine - hook_attn_scores| = {(mine - scores)[scores.isfinite()].abs().max():.1e}")
