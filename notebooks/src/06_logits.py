# %% [markdown]
# # 06 · From the residual stream to the next token
#
# After the last block, K2 normalises the residual stream and multiplies by the output head (not tied to the
# embedding), computing the logits in float32:
#
# $$\text{logits} = W_U\,\text{RMSNorm}(x_L), \qquad \text{RMSNorm}(x) = g \odot \frac{x}{\sqrt{\text{mean}(x^2) + \epsilon}} .$$
#
# Because every block *adds* to the residual stream, x_L is a sum: the embedding, plus each layer's attention
# output, plus each layer's feed-forward output (for MoE layers, the shared expert plus the weighted routed
# experts). This notebook reads that sum two ways: the **logit lens** (stop after any layer and read off a guess)
# and **direct logit attribution** (how much each term pushes one logit).

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings)
print(about)

# %%
# NBVAL_CHECK_OUTPUT
import torch

prompt = "def area(radius):\n    return 3.14159 * radius *"
ids = torch.tensor([tok.encode(prompt)])  # [B=1, T]
tokens = [tok.id_to_piece(i) for i in ids[0].tolist()]
logits, cache = model.run_with_cache(ids)
x_last = cache[f"layers.{len(model.layers) - 1}.hook_resid_post"]  # [B, T, D]
by_hand = model.lm_head(model.norm(x_last)).float()  # [B, T, V]
print(f"residual {list(x_last.shape)} -> logits {list(logits.shape)}; "
      f"head(norm(x_L)) equals the logits: {torch.allclose(by_hand, logits, atol=1e-4)}")

# %%
target = int(logits[0, -1].argmax())
print(f"after {prompt[-20:]!r} the model predicts {tok.id_to_piece(target)!r} "
      f"(p = {logits[0, -1].softmax(-1)[target].item():.2f})")

# %% [markdown]
# ## The logit lens
#
# Apply the final norm and head to every layer's output, as if the model stopped there
# (`cache.logit_lens()`, [L, B, T, V]). The last row is the model's real output. Early rows show what the
# residual stream already "says" after fewer blocks.

# %% tags=["nbval-ignore-output"]
from k2lab import viz

shown = slice(-16, None)  # the last 16 positions fit the page
lens = cache.logit_lens(pos=shown)[:, 0].softmax(-1)  # [L, 16, V]
p_top, i_top = lens.max(-1)  # [L, 16]
viz.logit_lens_figure(p_top, [[tok.id_to_piece(i) for i in row] for row in i_top.tolist()],
                      [f"layer {i}" for i in range(len(model.layers))], tokens[shown],
                      start=range(len(tokens))[shown].start)

# %% [markdown]
# The probability each layer gives to the final prediction, at the last position:

# %%
for layer, p in enumerate(lens[:, -1, target].tolist()):
    print(f"layer {layer}: p({tok.id_to_piece(target)!r}) = {p:.3f}")

# %% [markdown]
# ## Direct logit attribution
#
# A logit is u · RMSNorm(x_L), with u the head's row for the token. Freeze the norm's scale at its value for x_L,
# and the logit becomes linear in x_L, so it splits over the terms of the sum:
#
# $$\text{logit} = \sum_{c} \frac{u \cdot (g \odot c)}{\text{rms}(x_L)}, \qquad x_L = \text{embed} + \sum_l \text{attn}_l + \sum_l \text{mlp}_l .$$
#
# A term's contribution is how much it pushes the logit *directly*, through the head; it is not what removing the
# term would change (later layers read it too). `cache.logit_attribution(token)` returns every term projected
# this way; the terms sum to the logit.

# %%
# NBVAL_CHECK_OUTPUT
attr = cache.logit_attribution(target, pos=-1)  # every term, projected onto the target's logit
labels, values = attr.components(split_moe=True)  # [C] labels, [C, B]
print(f"{len(labels)} terms; they sum to the logit: "
      f"{torch.allclose(values.sum(0), logits[:, -1, target], atol=1e-3)}")

# %% tags=["nbval-ignore-output"]
target_name = f"the logit of {tok.id_to_piece(target)!r}"
viz.attribution_figure(labels, values[:, 0], x_title=f"contribution to {target_name}",
                       title="Direct logit attribution by layer: attention, shared and routed experts")

# %% [markdown]
# ## By expert
#
# Each MoE layer's routed part is itself a sum over the k chosen slots, weight × expert output. Here are the
# contributions of the experts the last token used in each MoE layer (at most the 24 largest, for deep models):

# %%
rows = []
for j, layer in enumerate(attr.moe_layers):
    for slot in range(attr.expert_ids.shape[-1]):
        expert = int(attr.expert_ids[j, 0, slot])
        rows.append((f"L{layer} expert {expert}", attr.expert_slots[j, 0, slot].item()))
strongest = max(rows, key=lambda row: abs(row[1]))
print(f"largest single-expert contribution: {strongest[0]} ({strongest[1]:+.3f})")
largest = sorted(range(len(rows)), key=lambda n: -abs(rows[n][1]))[:24]  # all of K2-nano's 20 slots
rows = [rows[n] for n in sorted(largest)]  # in layer order

# %% tags=["nbval-ignore-output"]
viz.attribution_figure([name for name, _ in rows], torch.tensor([v for _, v in rows]),
                       x_title=f"contribution to {target_name}",
                       title="Direct logit attribution by expert slot (the last token's experts)")

# %% [markdown]
# ## Generating through the latent cache
#
# `k2lab.generate` feeds the prompt once, then one token at a time, each step attending over the cached latents
# (see [03 mla](03_mla.ipynb)). Recomputing the whole sequence at every step gives the same greedy tokens, at a
# cost that grows with the length:

# %%
# NBVAL_CHECK_OUTPUT
import k2lab

new_tokens = 12
fast = k2lab.generate(model, ids, max_new_tokens=new_tokens)  # [1, T + n], through the cache
slow = ids
for _ in range(new_tokens):  # no cache: the full forward every step
    slow = torch.cat([slow, model(slow)[:, -1:].argmax(-1)], dim=1)
print("same tokens with and without the cache:", torch.equal(fast, slow[:, : fast.shape[1]]))  # [EOS] stops early

# %%
print(prompt + tok.decode(fast[0, ids.shape[1]:]))
