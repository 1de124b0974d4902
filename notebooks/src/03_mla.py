# %% [markdown]
# # 03 · Multi-head latent attention
#
# In ordinary multi-head attention every token writes a key and a value **per head** into the KV cache. For K2
# (64 heads, keys of 192 features, values of 128) that would be 64 × 320 = 20,480 numbers per token per layer.
# MLA caches a compressed **latent** instead, and rebuilds each head's keys and values from it.
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
# The score of query t and key s in head h has two terms, one about content and one about position:
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

prompt = "import os\n\ndef read(path):\n    with open(path) as f:\n        return f.read()"
ids = torch.tensor([tok.encode(prompt)])  # [B=1, T]
tokens = [tok.id_to_piece(i) for i in ids[0].tolist()]
logits, cache = model.run_with_cache(ids, names=".self_attn.")
for probe in ["hook_q_latent", "hook_q_nope", "hook_rot_q_pe", "hook_kv_latent", "hook_rot_k_pe",
              "hook_pattern", "hook_z"]:
    print(f"layers.1.self_attn.{probe:<16} {list(cache[f'layers.1.self_attn.{probe}'].shape)}")

# %% [markdown]
# ## Naive and absorbed attention
#
# The **naive** path expands the latents into every head's keys and values for the whole context, then attends
# as usual. The **absorbed** path never builds them. Since k_nope = W_UK c_KV,
#
# $$q^{nope}\cdot k^{nope} = q^{nope}\cdot (W_{UK}\, c_{KV}) = (W_{UK}^{\top} q^{nope})\cdot c_{KV},$$
#
# so W_UK folds into the query, and likewise W_UV folds into the output projection. Attention then runs directly
# over the 576-wide cached entries, as one multi-query attention shared by all heads. Both paths compute the same
# function; they differ only in rounding:

# %%
# NBVAL_CHECK_OUTPUT
naive = model(ids, attn_impl="naive")
absorbed = model(ids, attn_impl="absorbed")
difference = (naive - absorbed).abs().max().item()
print(f"naive and absorbed logits agree to float32 rounding (max |difference| < 1e-3): {difference < 1e-3}")
_, naive_cache = model.run_with_cache(ids, names="hook_pattern", attn_impl="naive")
same = all(torch.allclose(naive_cache[n], cache[n], atol=1e-5) for n in naive_cache)
print(f"attention patterns equal in every layer: {same}")

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
# ## Content against position
#
# The scores split into the two terms of the formula at the top. We rebuild them from the probes and the
# weights, using the absorption trick by hand: the content term needs k_nope = W_UK c_KV, the first N rows of
# each head's block of `kv_b_proj`.

# %%
# NBVAL_CHECK_OUTPUT
layer, head = 2, 0
attn, p = model.layers[layer].self_attn, f"layers.{layer}.self_attn."
Hn, Nn, Vn = attn.num_heads, attn.nope_dim, attn.v_dim
q_nope = cache[p + "hook_q_nope"][0, :, head]  # [T, N]
q_pe = cache[p + "hook_rot_q_pe"][0, :, head]  # [T, R]
c_kv, k_pe = cache[p + "hook_kv_latent"][0], cache[p + "hook_rot_k_pe"][0]  # [S, C], [S, R]
w_uk = attn.kv_b_proj.weight.view(Hn, Nn + Vn, -1)[head, :Nn]  # [N, C]
content = attn.softmax_scale * (q_nope @ w_uk) @ c_kv.T  # [T, S]: (W_UK^T q) . c_KV
position = attn.softmax_scale * q_pe @ k_pe.T  # [T, S]
scores = cache[p + "hook_attn_scores"][0, head]  # [T, S], -inf above the diagonal
visible = scores.isfinite()
print("content + position == hook_attn_scores:",
      torch.allclose((content + position)[visible], scores[visible], atol=1e-4))

# %% tags=["nbval-ignore-output"]
viz.score_split_figure(content, position, tokens,
                       title=f"Layer {layer}, head {head}: scores = content + position")
