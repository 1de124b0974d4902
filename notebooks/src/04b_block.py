# %% [markdown]
# # 04b · The block: norms, residuals, SwiGLU and the MoE combine
#
# [03](03_mla.ipynb) took attention apart and [04](04_router.ipynb) the router. This notebook puts them back into
# the block they live in, and rebuilds K2-nano's first two blocks by hand from their weights: the **dense block 0**
# and the **MoE block 1**. Every step is checked against k2lab's own modules, with the largest difference printed.
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
#   h["h = RMSNorm(resid_mid) [B, T, D]"] --> router["router (04): top-k of sigmoid + bias"]
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

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings)
print(about)

# %% [markdown]
# We record every probe for the lab's running prompt and take the block inputs from the cache, so each hand-built
# step can be compared with what the model really computed.

# %%
import torch
import torch.nn.functional as F

ids = model.to_tokens(lab.PROMPT)  # [B=1, T], on the model's device
T = ids.shape[1]
logits, cache = model.run_with_cache(ids)
gap = lambda a, b: (a - b).abs().max().item()  # noqa: E731  the largest difference, printed for every check
print(f"{T} tokens; residual stream {list(cache['layers.0.hook_resid_pre'].shape)} = [B, T, D]")

# %% [markdown]
# ## RMSNorm
#
# $$\text{RMSNorm}(x) = g \odot \frac{x}{\sqrt{\text{mean}(x^2) + \epsilon}}$$
#
# Every token's vector is divided by its root mean square, so each row leaves with rms 1 (before the learned
# per-feature weight g). Unlike LayerNorm there is no centring and no bias. Block 1's first norm, by hand:

# %%
block = model.layers[1]
x = cache["layers.1.hook_resid_pre"][0]  # [T, D] the block's input
g, eps = block.input_layernorm.weight, block.input_layernorm.eps  # [D], 1e-6
normed = g * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [T, D]
print(f"max |by hand - input_layernorm(x)| = {gap(normed, block.input_layernorm(x)):.1e}")
rms = lambda t: t.pow(2).mean(-1).sqrt()  # noqa: E731  [T] each row's root mean square
print(f"rms of the rows: before {rms(x).min():.2f} .. {rms(x).max():.2f}; "
      f"after, without g: {rms(normed / g).min():.4f} .. {rms(normed / g).max():.4f}")

# %% [markdown]
# ## Attention, then the first residual
#
# Attention (taken apart in [03](03_mla.ipynb)) reads the normalised copy; its output is *added* to the stream.
# It needs the rotation angles of each position ([02](02_yarn.ipynb)):

# %%
cos, sin, _ = model.rotary_and_mask(None, None, 1, T, model.device)  # [T, R] each (no pads: no mask)
attn_out = block.self_attn(normed[None], cos, sin)[0]  # [T, D]
resid_mid = x + attn_out  # [T, D]
print(f"max |attention - hook_attn_out| = {gap(attn_out, cache['layers.1.hook_attn_out'][0]):.1e}")
print(f"max |x + attention - hook_resid_mid| = {gap(resid_mid, cache['layers.1.hook_resid_mid'][0]):.1e}")

# %% [markdown]
# ## The dense block 0: SwiGLU
#
# K2's first block (`first_k_dense_replace = 1`) has no experts: one SwiGLU feed-forward, 18,432 hidden features in
# K2, 384 in K2-nano. A SwiGLU has three matrices; the gate's output goes through SiLU, silu(z) = z · sigmoid(z),
# and multiplies the up projection feature by feature:
#
# $$\text{SwiGLU}(h) = W_{down}\big(\operatorname{silu}(W_{gate} h) \odot W_{up} h\big).$$

# %%
dense = model.layers[0]
h0 = dense.post_attention_layernorm(cache["layers.0.hook_resid_mid"][0])  # [T, D]
mlp = dense.mlp
hidden = F.silu(h0 @ mlp.gate_proj.weight.T) * (h0 @ mlp.up_proj.weight.T)  # [T, I]
dense_out = hidden @ mlp.down_proj.weight.T  # [T, D]
print(f"[T, D] {list(h0.shape)} -> [T, I] {list(hidden.shape)} -> [T, D] {list(dense_out.shape)}")
print(f"max |SwiGLU by hand - hook_mlp_out of block 0| = {gap(dense_out, cache['layers.0.hook_mlp_out'][0]):.1e}")

# %% [markdown]
# ## The MoE block: router, routed experts, shared expert, combine
#
# From block 1 on, the feed-forward is a mixture of experts. Its input is the second norm's copy of the stream:

# %%
h = block.post_attention_layernorm(resid_mid)  # [T, D]
gate = block.mlp.gate
s = (h @ gate.weight.T).float().sigmoid()  # [T, E] affinities (04's steps 1-2)
idx = (s + gate.e_score_correction_bias).topk(gate.top_k, dim=-1).indices  # [T, k] chosen by s + bias
w = s.gather(-1, idx)  # [T, k] weights from s alone ...
w = w / w.sum(-1, keepdim=True) * gate.scaling  # ... renormalised and scaled
print("same experts as hook_topk_idx:", torch.equal(idx, cache["layers.1.mlp.gate.hook_topk_idx"][0]))
print(f"max |weights - hook_topk_weights| = {gap(w, cache['layers.1.mlp.gate.hook_topk_weights'][0]):.1e}")

# %% [markdown]
# Each routed expert is a small SwiGLU of its own. Every token runs its k chosen experts, one per *slot*:

# %%
experts = block.mlp.experts
expert_out = h.new_zeros(T, gate.top_k, h.shape[-1])  # [T, k, D]
for t in range(T):
    for j, e in enumerate(idx[t].tolist()):
        w_gate, w_up, w_down = experts.expert_weights(e)  # [I, D], [I, D], [D, I]
        expert_out[t, j] = (F.silu(w_gate @ h[t]) * (w_up @ h[t])) @ w_down.T
print(f"max |experts by hand - hook_expert_out| = {gap(expert_out, cache['layers.1.mlp.hook_expert_out'][0]):.1e}")

# %% [markdown]
# The **shared expert** is a SwiGLU that every token goes through, whatever the router says. The **combine** adds
# it to the routed experts' outputs, each multiplied by its weight:
#
# $$\text{mlp\_out} = \text{shared}(h) + \sum_{j=1}^{k} w_j\,\text{expert}_{i_j}(h).$$
#
# The weights sum to `routed_scaling_factor` (2.827), not 1: the routed part is scaled up against the shared one.

# %%
shared = block.mlp.shared_experts
shared_out = F.linear(F.silu(F.linear(h, shared.gate_proj.weight)) * F.linear(h, shared.up_proj.weight),
                      shared.down_proj.weight)  # [T, D]
routed_out = (w[..., None] * expert_out).sum(1)  # [T, D]: sum over the k slots
mlp_out = shared_out + routed_out
resid_post = resid_mid + mlp_out
print(f"max |shared by hand - hook_shared_out| = {gap(shared_out, cache['layers.1.mlp.hook_shared_out'][0]):.1e}")
print(f"max |combine - hook_mlp_out|           = {gap(mlp_out, cache['layers.1.hook_mlp_out'][0]):.1e}")
print(f"max |block by hand - hook_resid_post|  = {gap(resid_post, cache['layers.1.hook_resid_post'][0]):.1e}")

# %%
# NBVAL_CHECK_OUTPUT
checks = {"RMSNorm": (normed, block.input_layernorm(x)),
          "dense SwiGLU": (dense_out, cache["layers.0.hook_mlp_out"][0]),
          "routed experts": (expert_out, cache["layers.1.mlp.hook_expert_out"][0]),
          "shared expert": (shared_out, cache["layers.1.mlp.hook_shared_out"][0]),
          "MoE combine": (mlp_out, cache["layers.1.hook_mlp_out"][0]),
          "whole block 1": (resid_post, cache["layers.1.hook_resid_post"][0])}
for name, (mine, theirs) in checks.items():
    print(f"{name:<15} agrees with k2lab to float32 rounding: {torch.allclose(mine, theirs, atol=1e-4)}")

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
# A post-norm block (the original Transformer's) would normalise the stream itself after each addition. Pre-norm
# keeps an unnormalised path from the embedding to the head: each block's contribution stays in the sum, which is
# what lets [06](06_logits.ipynb) split the final logits over the blocks.
#
# ## Exercises
#
# **1. Predict, then run.** At the last token, which writes more into the residual stream in each MoE layer: the
# one shared expert, or the k routed experts together (after their weights)? Write your guess, then compare the
# rms of `layers.{i}.mlp.hook_shared_out` and `layers.{i}.mlp.hook_routed_out`.

# %%
# your code here: compare rms(cache[f"layers.{i}.mlp.hook_shared_out"][0, -1]) and the routed one

# %% [markdown]
# **2. Change a knob.** Remove the shared expert from every MoE layer (a hook that returns `t * 0` on
# `hook_shared_out`) and predict: does the model's top next token survive? Then remove the routed experts instead
# (`hook_routed_out`). Which one mattered more here?

# %%
top = lambda out: tok.id_to_piece(int(out[0, -1].argmax()))  # noqa: E731
print("the model's top next token:", repr(top(logits)))
# your code here: a selector can be a predicate over probe names, for every MoE layer at once:
# with model.hooks(fwd_hooks=[(lambda name: name.endswith("hook_shared_out"), lambda t, hook: t * 0)]): ...

# %% [markdown]
# **3. Write it yourself: RMSNorm and SwiGLU.** Fill in the two functions; the checks run them on fixed inputs
# against k2lab's modules and say what is wrong if something is.

# %%
from k2lab.lab import exercises


def my_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D]"""
    raise NotImplementedError


def my_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [N, D], gate [I, D], up [I, D], down [D, I] -> [N, D]"""
    raise NotImplementedError


print(exercises.check_rms_norm(my_rms_norm))
print(exercises.check_swiglu(my_swiglu))

# %% [markdown]
# **4. Write it yourself: the MoE combine and the whole block.** `my_combine` adds the shared expert's output to
# the weighted sum of the routed slots; `my_block` is one pre-norm block, given its two norms and two sublayers as
# functions.

# %%
def my_combine(shared: torch.Tensor, expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """shared [N, D], expert_out [N, k, D], weights [N, k] -> [N, D]"""
    raise NotImplementedError


def my_block(x, input_norm, attn, post_norm, ffn) -> torch.Tensor:
    """x [N, D]; each of input_norm, attn, post_norm, ffn maps [N, D] -> [N, D]"""
    raise NotImplementedError


print(exercises.check_moe_combine(my_combine))
print(exercises.check_block(my_block))

# %% [markdown]
# ## Solutions
#
# Expand a cell to read it (each is run with the notebook, so it is known to pass).
#
# **1.** In K2-nano the routed experts write several times more than the shared one in every MoE layer: the
# weights sum to 2.827, and the router picked experts that respond strongly to this token.

# %% tags=["solution"]
for i in [i for i in range(len(model.layers)) if f"layers.{i}.mlp.hook_shared_out" in cache]:
    shared_rms = rms(cache[f"layers.{i}.mlp.hook_shared_out"][0, -1]).item()
    routed_rms = rms(cache[f"layers.{i}.mlp.hook_routed_out"][0, -1]).item()
    print(f"layer {i}: shared {shared_rms:5.2f}, routed {routed_rms:5.2f} ({routed_rms / shared_rms:.1f}x)")

# %% [markdown]
# **2.** The knob, both ways (the answer for K2-nano is printed below the cell):

# %% tags=["solution"]
for part in ("hook_shared_out", "hook_routed_out"):
    with model.hooks(fwd_hooks=[(lambda name: name.endswith(part), lambda t, hook: t * 0)]):  # every MoE layer
        out = model(ids)
    print(f"without {part.removeprefix('hook_').removesuffix('_out')}: top next token {top(out)!r}, "
          f"p = {out[0, -1].softmax(-1).max().item():.2f} (with both: p = {logits[0, -1].softmax(-1).max():.2f})")

# %% [markdown]
# **3.** RMSNorm divides by the root of the mean square *plus* eps, then multiplies by g; SwiGLU puts SiLU on the
# gate projection only.

# %% tags=["solution"]
def my_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def my_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


assert exercises.check_rms_norm(my_rms_norm) and exercises.check_swiglu(my_swiglu)
print(exercises.check_rms_norm(my_rms_norm))
print(exercises.check_swiglu(my_swiglu))

# %% [markdown]
# **4.** The combine is one weighted sum over the slot axis plus the shared output; the block adds each sublayer's
# output to the stream it read from.

# %% tags=["solution"]
def my_combine(shared: torch.Tensor, expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return shared + (weights[..., None] * expert_out).sum(1)


def my_block(x, input_norm, attn, post_norm, ffn) -> torch.Tensor:
    x = x + attn(input_norm(x))
    return x + ffn(post_norm(x))


assert exercises.check_moe_combine(my_combine) and exercises.check_block(my_block)
print(exercises.check_moe_combine(my_combine))
print(exercises.check_block(my_block))
