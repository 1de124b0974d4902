# %% [markdown]
# # 04b · The block: norms, residuals, SwiGLU and the MoE combine
#
# [03](03_mla.ipynb) took attention apart and [04a](04a_router.ipynb) the router. This notebook puts them back into
# the block they live in, and you write the missing pieces yourself: RMSNorm, SwiGLU, the MoE's combine and the
# pre-norm block. Each is checked on fixed inputs against k2lab's own module, then used at once on K2-nano's
# weights to rebuild its first two blocks, the **dense block 0** and the **MoE block 1**, compared with what the
# model computed. [09](09_full_model.ipynb) stacks the same pieces into the whole model.
#
# Every one of K2's 61 blocks is **pre-norm**: each sublayer reads a normalised copy of the
# [residual stream](GLOSSARY.md#residual-stream) and *adds* its output back; the stream itself is never normalised.
#
# ```mermaid
# flowchart TB
#   x["x: residual stream [B, T, D]"] --> n1["RMSNorm (input_layernorm)"]
#   n1 -- "[B, T, D]" --> attn["MLA (notebook 03)"]
#   attn -- "attn_out [B, T, D]" --> add1(("+"))
#   x --> add1
#   add1 -- "resid_mid [B, T, D]" --> n2["RMSNorm (post_attention_layernorm)"]
#   n2 -- "[B, T, D]" --> ffn["block 0: SwiGLU, D → I → D<br/>blocks 1 on: MoE (below)"]
#   ffn -- "mlp_out [B, T, D]" --> add2(("+"))
#   add1 --> add2
#   add2 -- "resid_post [B, T, D]" --> next["the next block"]
# ```
#
# and the MoE feed-forward of blocks 1 to 60:
#
# ```mermaid
# flowchart LR
#   h["h = RMSNorm(resid_mid) [B, T, D]"] --> router["router (04a): top-k of sigmoid + bias"]
#   router -- "idx, w [B, T, k]" --> experts["k routed SwiGLU experts"]
#   h --> experts
#   experts -- "expert_out [B, T, k, D]" --> sum["Σ_j w_j · expert_out_j"]
#   sum -- "routed [B, T, D]" --> plus(("+"))
#   h --> shared["shared SwiGLU expert"]
#   shared -- "shared [B, T, D]" --> plus
#   plus -- "mlp_out [B, T, D]" --> out[" "]
# ```
#
# K2: D = 7,168, I = 18,432 in the dense block, 2,048 in each expert, k = 8 of 384. K2-nano: D = 128, I = 384,
# experts of 64, k = 4 of 32.
#
# *Sources.* The widths are the released `config.json`'s (`hidden_size`, `intermediate_size`,
# `moe_intermediate_size`, `num_experts_per_tok`, `n_routed_experts`, `first_k_dense_replace: 1`,
# `rms_norm_eps: 1e-6`, `hidden_act: "silu"`); the block's order (norm, attention, residual, norm, feed-forward,
# residual) is `DeepseekV3DecoderLayer.forward` in the release's `modeling_deepseek.py`, and its SwiGLU is
# `DeepseekV3MLP.forward`. The dense block holds 497,500,160 parameters, 101,124,096 of them in its attention
# (counted from the same config and code, and equal to the checkpoint's tensors; k2lab reproduces both in
# [08](08_scale.ipynb)). The K2 report describes the architecture at the level of its Table 2 and leaves these
# details to the released code.

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings)
print(about)

# %% [markdown]
# We record every probe for the lab's running prompt and take the block inputs from the cache, so each piece you
# write can be compared with what the model really computed.

# %%
import torch
import torch.nn.functional as F

from k2lab.lab import exercises
from k2lab.model import prepare_inputs

ids = model.to_tokens(lab.PROMPT)  # [B=1, T], on the model's device
T = ids.shape[1]
logits, cache = model.run_with_cache(ids)
gap = lambda a, b: (a - b).abs().max().item()  # noqa: E731  the largest difference, printed for every check
rms = lambda t: t.pow(2).mean(-1).sqrt()  # noqa: E731  [...] each row's root mean square
print(f"{T} tokens; residual stream {list(cache['layers.0.hook_resid_pre'].shape)} = [B, T, D]")

# %% [markdown]
# ## RMSNorm
#
# A block adds to the stream, block after block, so the stream's size drifts from token to token and from layer to
# layer (the last section measures it). A sublayer should not have to cope with that: it reads a copy rescaled to a
# fixed size. LayerNorm does it by centring and dividing by the standard deviation; RMSNorm (Zhang and Sennrich,
# 2019) skips the centring and divides by the root mean square, one reduction instead of two:
#
# $$\text{RMSNorm}(x) = g \odot \frac{x}{\sqrt{\text{mean}(x^2) + \epsilon}}$$
#
# Every token's vector leaves with rms 1, before the learned per-feature weight g. There is no bias.
#
# ### Exercise 1 ★ · Write it yourself: RMSNorm
#
# `x` is [..., D]; normalise over the last dimension. Running the cell checks it (`exercises.check_rms_norm` uses a
# large eps and one tiny row, so that the eps's place shows, and a stream that is not centred, so that LayerNorm's
# centring shows) and keeps it in your module, `mine.py`.

# %%
@lab.mine
def my_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D]"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# One number per row: the root of the mean of its squares, eps added before the root so that a tiny row is not
# blown up. Divide the row by it, then scale each feature by its weight. Nothing is subtracted.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `x.pow(2).mean(-1, keepdim=True)` is the mean square of each row, kept as [..., 1] so that it divides the row.
# The eps goes *inside* the square root, then multiply by `weight`.

# %% [markdown] tags=["solution"]
# Mean square over the features, eps inside the root, the weight last:

# %% tags=["solution"]
# Solution (click to show)
def solution_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


print(exercises.check_rms_norm(solution_rms_norm))

# %% [markdown]
# `my_rms_norm` from your module (yours if it passed its check, else k2lab's reference; the first lines say which)
# on block 1's real input, against the block's own `input_layernorm`:

# %%
mine = lab.mine.load("my_rms_norm")
block = model.layers[1]
x = cache["layers.1.hook_resid_pre"][0]  # [T, D] the block's input
g, eps = block.input_layernorm.weight, block.input_layernorm.eps  # [D], 1e-6
normed = mine.my_rms_norm(x, g, eps)  # [T, D]
print(f"max |my_rms_norm(x) - input_layernorm(x)| = {gap(normed, block.input_layernorm(x)):.1e}")
print(f"rms of the rows: before {rms(x).min():.2f} .. {rms(x).max():.2f}; "
      f"after, without g: {rms(normed / g).min():.4f} .. {rms(normed / g).max():.4f}")

# %% [markdown]
# ## Attention, then the first residual
#
# Attention ([03](03_mla.ipynb)) reads the normalised copy; its output is *added* to the stream. It needs the
# rotation angles of each position ([02](02_yarn.ipynb)). The MLA is the one of your module, `my_mla` from 03 (yours
# if it passed its check, else k2lab's reference), given the block's attention weights:

# %%
mine = lab.mine.load("my_mla")
inputs = prepare_inputs(model, ids)  # what every block of this forward shares: positions, rotary cos and sin
cos, sin = inputs.cos, inputs.sin  # [T, R] each (no pads: one row of positions for the batch)
attn_weights = {name: t.detach() for name, t in block.self_attn.state_dict().items()}
attn_out = mine.my_mla(attn_weights, model.config, normed[None], cos, sin)[0]  # [T, D]
resid_mid = x + attn_out  # [T, D]
print(f"max |attention - hook_attn_out| = {gap(attn_out, cache['layers.1.hook_attn_out'][0]):.1e}")
print(f"max |x + attention - hook_resid_mid| = {gap(resid_mid, cache['layers.1.hook_resid_mid'][0]):.1e}")

# %% [markdown]
# ## The dense block 0: SwiGLU
#
# A plain two-layer MLP, W_down relu(W_up h), lets every hidden feature through or not by its own sign. A gated
# unit (Dauphin et al., 2017) adds a second projection that decides, feature by feature, how much of the first gets
# through; SwiGLU (Shazeer, 2020) takes SiLU, silu(z) = z · sigmoid(z), as the gate's activation:
#
# $$\text{SwiGLU}(h) = W_{down}\big(\operatorname{silu}(W_{gate} h) \odot W_{up} h\big).$$
#
# Three matrices instead of two; K2's first block (`first_k_dense_replace = 1`) is one such SwiGLU with 18,432
# hidden features (K2-nano: 384), and every expert of the later blocks is a small one.
#
# ### Exercise 2 ★ · Write it yourself: SwiGLU
#
# The matrices are stored as `nn.Linear` stores them, [out, in]: `gate` and `up` are [I, D], `down` is [D, I].
# Running the cell checks it (`exercises.check_swiglu`) and keeps it in your module.

# %%
@lab.mine
def my_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [N, D], gate [I, D], up [I, D], down [D, I] -> [N, D]"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Two projections of the same input to the hidden width: one goes through SiLU and gates the other, feature by
# feature (a product, not a sum); the gated features are projected back to D.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# A matrix stored [out, in] applies as `x @ W.T`. SiLU is `F.silu`, and it goes on the gate's projection only; the
# up projection multiplies the result feature by feature before `down`.

# %% [markdown] tags=["solution"]
# SiLU on the gate projection only, times the up projection, then down:

# %% tags=["solution"]
# Solution (click to show)
def solution_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


print(exercises.check_swiglu(solution_swiglu))

# %% [markdown]
# `my_swiglu` from your module on the dense block 0, against its recorded output:

# %%
mine = lab.mine.load("my_swiglu")
dense = model.layers[0]
h0 = dense.post_attention_layernorm(cache["layers.0.hook_resid_mid"][0])  # [T, D]
mlp = dense.mlp
dense_out = mine.my_swiglu(h0, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)  # [T, D]
print(f"[T, D] {list(h0.shape)} -> [T, I] via {list(mlp.gate_proj.weight.shape)} -> [T, D] {list(dense_out.shape)}")
print(f"max |my_swiglu - hook_mlp_out of block 0| = {gap(dense_out, cache['layers.0.hook_mlp_out'][0]):.1e}")

# %% [markdown]
# ## The MoE block: router, routed experts, shared expert, combine
#
# From block 1 on, the feed-forward is a mixture of experts. Its input is the second norm's copy of the stream, and
# the router of [04a](04a_router.ipynb) picks each token's k experts: `my_router` from your module (yours if it passed
# its check in 04a, else k2lab's `Router` with the weights it is given; the first lines say which).

# %%
mine = lab.mine.load("my_router")
h = mine.my_rms_norm(resid_mid, block.post_attention_layernorm.weight, eps)  # [T, D] the MoE's input
gate = block.mlp.gate
idx, w = mine.my_router(h, gate.weight, gate.e_score_correction_bias, gate.top_k, gate.scaling)  # [T, k] each
print("same experts as hook_topk_idx:", torch.equal(idx, cache["layers.1.mlp.gate.hook_topk_idx"][0]))
print(f"max |weights - hook_topk_weights| = {gap(w, cache['layers.1.mlp.gate.hook_topk_weights'][0]):.1e}")

# %% [markdown]
# Each routed expert is a small SwiGLU of its own (`my_swiglu` again). Every token runs its k chosen experts,
# one per *slot*:

# %%
experts = block.mlp.experts
expert_out = h.new_zeros(T, gate.top_k, h.shape[-1])  # [T, k, D]
for t in range(T):
    for j, e in enumerate(idx[t].tolist()):
        w_gate, w_up, w_down = experts.expert_weights(e)  # [I, D], [I, D], [D, I]
        expert_out[t, j] = mine.my_swiglu(h[t:t + 1], w_gate, w_up, w_down)[0]
print(f"max |experts - hook_expert_out| = {gap(expert_out, cache['layers.1.mlp.hook_expert_out'][0]):.1e}")

# %% [markdown]
# The **shared expert** is a SwiGLU that every token goes through, whatever the router says. The **combine** adds
# it to the routed experts' outputs, each multiplied by its weight:
#
# $$\text{mlp\_out} = \text{shared}(h) + \sum_{j=1}^{k} w_j\,\text{expert}_{i_j}(h).$$
#
# The weights sum to `routed_scaling_factor` (2.827), not 1: the routed part is scaled up against the shared one.
#
# ### Exercise 3 ★ · Write it yourself: the MoE combine
#
# `shared` [N, D] is the shared expert's output, `expert_out` [N, k, D] the chosen experts' outputs slot by slot,
# `weights` [N, k] the router's weights. Running the cell checks it (`exercises.check_moe_combine`) and keeps it.

# %%
@lab.mine
def my_combine(shared: torch.Tensor, expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """shared [N, D], expert_out [N, k, D], weights [N, k] -> [N, D]"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Each token's k slot outputs are weighted by its k router weights and summed; the shared expert's output is added
# as it is, with no weight.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Give the weights a feature axis (`weights[..., None]`, [N, k, 1]) so that they multiply each slot's output,
# then sum over the slot axis (1). The weights are used as they are: they already sum to 2.827.

# %% [markdown] tags=["solution"]
# One weighted sum over the slot axis, plus the shared output:

# %% tags=["solution"]
# Solution (click to show)
def solution_combine(shared: torch.Tensor, expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return shared + (weights[..., None] * expert_out).sum(1)


print(exercises.check_moe_combine(solution_combine))

# %% [markdown]
# The whole MoE feed-forward from the pieces of your module, as one function of the block's second-norm output, and
# block 1's feed-forward through it:

# %%
mine = lab.mine.load("my_router", "my_swiglu", "my_combine")


def moe_from_pieces(h: torch.Tensor, moe) -> torch.Tensor:
    """h [N, D] -> [N, D]: the router, the chosen experts and the shared expert of one MoE module, combined."""
    idx, w = mine.my_router(h, moe.gate.weight, moe.gate.e_score_correction_bias, moe.gate.top_k, moe.gate.scaling)
    out = h.new_zeros(*idx.shape, h.shape[-1])  # [N, k, D]
    for e in idx.unique().tolist():  # each expert once, on the tokens that chose it
        rows, slots = torch.where(idx == e)
        out[rows, slots] = mine.my_swiglu(h[rows], *moe.experts.expert_weights(e))
    shared = moe.shared_experts
    shared_out = mine.my_swiglu(h, shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    return mine.my_combine(shared_out, out, w)


mlp_out = moe_from_pieces(h, block.mlp)  # [T, D]
print(f"max |MoE from the pieces - hook_mlp_out of block 1| = {gap(mlp_out, cache['layers.1.hook_mlp_out'][0]):.1e}")

# %% [markdown]
# ## The block
#
# Now the order of the parts. Pre-norm: each sublayer reads a normalised copy and adds its output to the stream it
# read. (The original Transformer was post-norm: it normalised the stream itself after each addition.)
#
# ### Exercise 4 ★★ · Write it yourself: the pre-norm block
#
# `input_norm`, `attn`, `post_norm` and `ffn` are functions [N, D] -> [N, D] (the check, `exercises.check_block`,
# passes plain functions, so it needs no positions). Write one block.

# %%
@lab.mine
def my_block(x, input_norm, attn, post_norm, ffn) -> torch.Tensor:
    """x [N, D]; each of input_norm, attn, post_norm, ffn maps [N, D] -> [N, D]"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Pre-norm: each sublayer reads a normalised copy of the stream and adds its output to the stream itself. The
# feed-forward comes second, so it reads the stream with attention's output already in it.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Two lines, each of the form `x = x + sublayer(norm(x))`. The feed-forward reads the stream *after* attention has
# been added, through its own norm; nothing ever normalises `x` itself.

# %% [markdown] tags=["solution"]
# Each sublayer adds its output to the stream it read from:

# %% tags=["solution"]
# Solution (click to show)
def solution_block(x, input_norm, attn, post_norm, ffn) -> torch.Tensor:
    x = x + attn(input_norm(x))
    return x + ffn(post_norm(x))


print(exercises.check_block(solution_block))

# %% [markdown]
# Blocks 0 and 1 of K2-nano, every part from your module: the block, the norms, your MLA of 03, the SwiGLU of the
# dense block, the MoE above (each yours where it passed its check, else the reference; the first lines say which):

# %%
mine = lab.mine.load("my_block", "my_rms_norm", "my_mla")


def as_norm(norm):  # a block's RMSNorm module as my_rms_norm with its weight
    return lambda t: mine.my_rms_norm(t, norm.weight, norm.eps)


def as_attention(attn):  # my_mla with the block's attention weights, at positions 0..T-1
    weights = {name: t.detach() for name, t in attn.state_dict().items()}
    return lambda t: mine.my_mla(weights, model.config, t[None], cos, sin)[0]


dense_ffn = lambda t: mine.my_swiglu(t, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)  # noqa: E731
x0 = cache["layers.0.hook_resid_pre"][0]  # [T, D] the embeddings
built0 = mine.my_block(x0, as_norm(dense.input_layernorm), as_attention(dense.self_attn),
                       as_norm(dense.post_attention_layernorm), dense_ffn)
built1 = mine.my_block(built0, as_norm(block.input_layernorm), as_attention(block.self_attn),
                       as_norm(block.post_attention_layernorm), lambda t: moe_from_pieces(t, block.mlp))

# %%
# NBVAL_CHECK_OUTPUT
for name, (built, theirs) in {"block 0": (built0, cache["layers.0.hook_resid_post"][0]),
                              "block 1": (built1, cache["layers.1.hook_resid_post"][0])}.items():
    print(f"{name} from the pieces of your module agrees with hook_resid_post to float32 rounding: "
          f"{torch.allclose(built, theirs, atol=1e-4)}")

# %% [markdown]
# ## Pre-norm: the stream grows, each sublayer reads a normalised copy
#
# Because blocks only add, the residual stream's size grows from layer to layer, while what each sublayer reads is
# always rescaled to rms 1 (times g). The last token's stream, block by block:

# %%
for i in range(len(model.layers)):
    stream = cache[f"layers.{i}.hook_resid_pre"][0, -1]  # [D]
    attn_w, mlp_w = cache[f"layers.{i}.hook_attn_out"][0, -1], cache[f"layers.{i}.hook_mlp_out"][0, -1]
    print(f"block {i}: rms of the input {rms(stream).item():6.2f}; adds attention {rms(attn_w).item():5.2f}, "
          f"feed-forward {rms(mlp_w).item():5.2f}")

# %% [markdown]
# Every position of the prompt at once: the stream's rms at each block boundary (the median over the positions, the
# band their 10th to 90th percentile), and what each sublayer adds, drawn between the two boundaries of its block.
# The stream grows at every boundary (the medians are printed above the figure), while what a sublayer adds stays in
# a band the stream outgrows: a late block changes the stream's direction less than an early one can.

# %% tags=["nbval-ignore-output"]
from k2lab import viz

L = len(model.layers)
stream_rms = torch.stack([rms(cache[f"layers.{i}.hook_resid_pre"][0]) for i in range(L)]
                         + [rms(cache[f"layers.{L - 1}.hook_resid_post"][0])])  # [L + 1, T]
added = {"attention": torch.stack([rms(cache[f"layers.{i}.hook_attn_out"][0]) for i in range(L)]),  # [L, T]
         "feed-forward": torch.stack([rms(cache[f"layers.{i}.hook_mlp_out"][0]) for i in range(L)])}
print(f"median rms of the stream: {', '.join(f'{m:.2f}' for m in stream_rms.median(-1).values.tolist())}")
viz.residual_norm_figure(stream_rms, added, title="K2-nano: the residual stream's rms, block by block (running prompt)")

# %% [markdown]
# A post-norm block would normalise the stream itself after each addition. Pre-norm keeps an unnormalised path from
# the embedding to the head: each block's contribution stays in the sum, which is what lets [06](06_logits.ipynb)
# split the final logits over the blocks. The next piece of the construction is the whole model, in
# [09](09_full_model.ipynb): the embedding, 6 blocks (61 in K2) of what you wrote here, the final norm and the head,
# from K2-nano's state dict.
#
# ## More exercises
#
# ### Exercise 5 ★ · Predict, then run: shared or routed?
#
# At the last token, which writes more into the residual stream in each MoE layer: the one shared expert, or the k
# routed experts together (after their weights)? Write your guess, then compare the rms of
# `layers.{i}.mlp.hook_shared_out` and `layers.{i}.mlp.hook_routed_out`.

# %%
# your code here: compare rms(cache[f"layers.{i}.mlp.hook_shared_out"][0, -1]) and the routed one

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Two things set each part's size: its weights in the sum (the shared expert has none; the routed ones sum to
# routed_scaling_factor) and how strongly the chosen experts respond.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Loop over the layers that have a `hook_shared_out` in the cache and print both rms values side by side:
# `rms(cache[f"layers.{i}.mlp.hook_shared_out"][0, -1])` and the same of `hook_routed_out`.

# %% [markdown] tags=["solution"]
# In K2-nano the routed experts write more than the shared one in every MoE layer at this token, between 2.5 and
# 5.1 times as much (the printed ratios): their weights sum to 2.827, and the router picked experts that respond
# strongly to this token.

# %% tags=["solution"]
# Solution (click to show)
for i in [i for i in range(len(model.layers)) if f"layers.{i}.mlp.hook_shared_out" in cache]:
    shared_rms = rms(cache[f"layers.{i}.mlp.hook_shared_out"][0, -1]).item()
    routed_rms = rms(cache[f"layers.{i}.mlp.hook_routed_out"][0, -1]).item()
    print(f"layer {i}: shared {shared_rms:5.2f}, routed {routed_rms:5.2f} ({routed_rms / shared_rms:.1f}x)")

# %% [markdown]
# ### Exercise 6 ★★ · Change a knob: remove the shared expert, or the routed ones
#
# Remove the shared expert from every MoE layer (a hook that returns `t * 0` on `hook_shared_out`) and predict:
# does the model's top next token survive? Then remove the routed experts instead (`hook_routed_out`). Which one
# mattered more here?

# %%
top = lambda out: tok.id_to_piece(int(out[0, -1].argmax()))  # noqa: E731
print("the model's top next token:", repr(top(logits)))
# your code here: a selector can be a predicate over probe names, for every MoE layer at once:
# with model.hooks(fwd_hooks=[(lambda name: name.endswith("hook_shared_out"), lambda t, hook: t * 0)]): ...

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Removing a part and reading the top token and its probability answers which part mattered; the rms of what each part
# writes only says how large it is.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Run `model(ids)` inside each `with model.hooks(...)` block and compare `top(out)` and the probability of the top
# token, `out[0, -1].softmax(-1).max()`, with the unchanged model's.

# %% [markdown] tags=["solution"]
# The top token survives both: ` r` stays first. Without the shared expert its probability falls from 0.72 to
# 0.58, without the routed experts to 0.33, so here the routed experts matter more. That agrees with exercise 5,
# but it is the probabilities that answer the question, not the rms: a part can write a large vector that later
# layers mostly ignore. (The values are K2-nano's, printed by the cell.)

# %% tags=["solution"]
# Solution (click to show)
for part in ("hook_shared_out", "hook_routed_out"):
    with model.hooks(fwd_hooks=[(lambda name: name.endswith(part), lambda t, hook: t * 0)]):  # every MoE layer
        out = model(ids)
    print(f"without {part.removeprefix('hook_').removesuffix('_out')}: top next token {top(out)!r}, "
          f"p = {out[0, -1].softmax(-1).max().item():.2f} (with both: p = {logits[0, -1].softmax(-1).max():.2f})")
