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
#
# *Sources.* The untied head is the released `config.json`'s `tie_word_embeddings: false` (the checkpoint stores
# `lm_head.weight` apart from `model.embed_tokens.weight`); the final RMSNorm and the float32 logits are
# `DeepseekV3ForCausalLM.forward` in the release's `modeling_deepseek.py`. The logit lens is nostalgebraist's
# (2020) and direct logit attribution follows Elhage et al., "A Mathematical Framework for Transformer Circuits"
# (2021). Every reading below is K2-nano's; the K2 report publishes no interpretability results to compare with.

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings)
print(about)

# %%
# NBVAL_CHECK_OUTPUT
import torch

prompt = lab.PROMPT  # the running prompt: the next token should start ` radius` again
ids = model.to_tokens(prompt)  # [B=1, T], on the model's device
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
# term would change (later layers read it too).
#
# ### Exercise 1 ★★ · Write it yourself: one term's direct attribution
#
# Given a term c, the final residual x_L, the final norm's weight g, a head row u (or a difference of two rows) and
# eps, return u · (g ⊙ c) / rms(x_L), with rms(x_L) = sqrt(mean(x_L²) + eps) as the final norm computes it. Running
# the cell checks it and keeps it in your module: `exercises.check_logit_attribution`'s stream is small beside its
# eps, so that leaving eps out, or putting it outside the root, shows; it also knows the term divided by its *own*
# rms.

# %%
from k2lab.lab import exercises


@lab.mine
def my_attribution(component, x_final, norm_weight, unembed_row, eps) -> float:
    """component, x_final, norm_weight, unembed_row: [D] -> the component's direct contribution (a float)"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# The final norm divides the whole stream by one number, its rms, and the head is linear: so each term reaches the
# logit divided by that same number, the whole stream's rms, never its own.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# The norm's scale is the same for every term: compute `rms = torch.sqrt(x_final.pow(2).mean() + eps)` from the
# *whole* final residual, then `(unembed_row * norm_weight * component).sum() / rms`. Return a Python float.

# %% [markdown] tags=["solution"]
# Divide by the rms of the *whole* final residual, the same for every term, eps inside the root:

# %% tags=["solution"]
# Solution (click to show)
def solution_attribution(component, x_final, norm_weight, unembed_row, eps) -> float:
    rms = torch.sqrt(x_final.pow(2).mean() + eps)
    return float((unembed_row * norm_weight * component).sum() / rms)


print(exercises.check_logit_attribution(solution_attribution))

# %% [markdown]
# One logit alone mixes two things: what makes this token likely, and what makes *every* token of its kind likely.
# Attributing a **logit difference** between the right token and a plausible alternative cancels the shared part
# and asks the sharper question: what makes the model prefer ` r` (the start of ` radius`) over ` (`, which would
# also continue `2 * 3.14159 *` as Python? Pass u_right − u_alt as the direction:

# %%
# NBVAL_CHECK_OUTPUT
alternative = tok.encode(" (")[0]
direction = model.lm_head.weight[target] - model.lm_head.weight[alternative]  # [D]
ld = (logits[0, -1, target] - logits[0, -1, alternative]).item()
attr = cache.logit_attribution(direction, pos=-1)  # every term, projected onto the direction
labels, values = attr.components(split_moe=True)  # [C] labels, [C, B]
print(f"logit difference {tok.id_to_piece(target)!r} - {tok.id_to_piece(alternative)!r} = {ld:.2f}; "
      f"{len(labels)} terms sum to it: {abs(values.sum().item() - ld) < 1e-3}")

# %% tags=["nbval-ignore-output"]
target_name = f"logit({tok.id_to_piece(target)!r}) − logit({tok.id_to_piece(alternative)!r})"
viz.attribution_figure(labels, values[:, 0], x_title=f"contribution to {target_name}",
                       title="Direct logit attribution by layer: attention, shared and routed experts")

# %% [markdown]
# `my_attribution` from your module (yours if it passed its check, else the reference; the first lines say which)
# gives the embedding's term, the first of the sum, as k2lab's `logit_attribution` does:

# %%
mine = lab.mine.load("my_attribution")
x_final = cache[f"layers.{len(model.layers) - 1}.hook_resid_post"][0, -1]  # [D] x_L at the last position
embed = mine.my_attribution(cache["embed_tokens.hook_out"][0, -1], x_final, model.norm.weight, direction,
                            model.norm.eps)
print(f"embedding: my_attribution {embed:+.4f}, k2lab {values[labels.index('embed'), 0].item():+.4f}")

# %% [markdown]
# The largest terms:

# %%
order = values[:, 0].abs().argsort(descending=True)
for n in order[:5].tolist():
    print(f"{labels[n]:<10} {values[n, 0].item():+.2f}")

# %% [markdown]
# ## Following the largest attribution down
#
# Take the largest *attention* term (for this prompt in K2-nano it is also among the largest of all) and split it
# twice. First by head: the attention output is o_proj applied to the heads' outputs z_h side by side, so it is a
# sum over heads, W_O,h z_h, and each head's write can be attributed like any term.

# %%
x_last = cache[f"layers.{len(model.layers) - 1}.hook_resid_post"][0, -1]  # [D] x_L at the last position
rms_x = (x_last.pow(2).mean() + model.norm.eps).sqrt()
dla = lambda write: (direction * model.norm.weight * write).sum(-1) / rms_x  # noqa: E731  [..., D] -> [...]
attn_terms = [n for n in order.tolist() if labels[n].endswith(".attn")]
layer = int(labels[attn_terms[0]].split(".")[0][1:])
attn = model.layers[layer].self_attn
H, V = attn.num_heads, attn.v_dim
z = cache[f"layers.{layer}.self_attn.hook_z"][0, -1]  # [H, V] each head's output at the last position
w_o = attn.o_proj.weight.view(-1, H, V)  # [D, H, V]
per_head = dla(torch.einsum("dhv,hv->hd", w_o, z))  # [H]
print(f"L{layer}.attn = {values[attn_terms[0], 0].item():+.2f}; by head: "
      + ", ".join(f"h{h} {v:+.2f}" for h, v in enumerate(per_head.tolist()))
      + f" (sum {per_head.sum().item():+.2f})")
head = int(per_head.abs().argmax())

# %% [markdown]
# Then the head by source position: its output is a weighted sum over the positions it attends to,
# z_h = Σ_s p_s v_{h,s}, with v_{h,s} = W_UV,h c_s rebuilt from the cached latent. So each source token's share of
# the head's contribution is p_s · DLA(W_O,h v_{h,s}):

# %%
p_row = cache[f"layers.{layer}.self_attn.hook_pattern"][0, head, -1]  # [S] where the last query looks
c_kv = cache[f"layers.{layer}.self_attn.hook_kv_latent"][0]  # [S, C]
w_uv = attn.kv_b_proj.weight.view(H, attn.nope_dim + V, -1)[head, attn.nope_dim:]  # [V, C]
per_source = p_row * dla((c_kv @ w_uv.T) @ w_o[:, head].T)  # [S]
print(f"L{layer}.h{head}: {per_head[head].item():+.2f} = sum over sources {per_source.sum().item():+.2f}; "
      f"the largest:")
for s_pos in per_source.abs().argsort(descending=True)[:5].tolist():
    print(f"  position {s_pos:>2} {tokens[s_pos]!r:<10} attention {p_row[s_pos].item():.2f}  "
          f"contribution {per_source[s_pos].item():+.2f}")

# %% [markdown]
# Read the chain from the printout. In K2-nano, layer 4's attention is the largest term (+3.9, more than the whole
# difference of 2.98, which other terms pull back), about four fifths of it from head 0; and that head spends 80%
# of its attention at the last position on the two earlier ` r` tokens (positions 16 and 20, the starts of
# ` radius` in `radius * radius`), which supply nearly all of its push. The head *copies* the argument's name
# forward: the mechanism one would guess for "the next token repeats a name from the prompt", now seen in the
# weights. Attribution says where the push was written; [07](07_interventions.ipynb) tests whether it is
# *needed*, by removing things.
#
# ## By expert
#
# Each MoE layer's routed part is itself a sum over the k chosen slots, weight × expert output. Here are the
# contributions of the experts the last token used in each MoE layer (at most the 24 largest, for deep models):

# %%
rows = []
for j, moe_layer in enumerate(attr.moe_layers):
    for slot in range(attr.expert_ids.shape[-1]):
        expert = int(attr.expert_ids[j, 0, slot])
        rows.append((f"L{moe_layer} expert {expert}", attr.expert_slots[j, 0, slot].item()))
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

# %% [markdown]
# The continuation is right for a token or two, then [greedy decoding](GLOSSARY.md#greedy-decoding) loops
# (` * radius` again and again): K2-nano is a 6.6 M-parameter model, and once a phrase repeats, repeating it
# again is its most likely next step ([00](00_tour.ipynb) shows sampling breaking the loop).

# %% [markdown]
# ## More exercises
#
# ### Exercise 2 ★ · Predict, then run: when does ` r` win?
#
# Look at the logit lens figure again. At which layer does ` r` first become the top guess at the last position?
# Predict from the figure, then print `lens[:, -1].argmax(-1)` as tokens.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Read the figure's last column from the bottom up: in which row does ` r` first take the top place?

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `lens` is [L, 16, V] probabilities for the last 16 positions; `lens[:, -1]` is the last position at every layer.
# `tok.id_to_piece` turns each argmax into its token.

# %% [markdown] tags=["solution"]
# Only at the last layer: through layer 4 the top guess is a space (p(` r`) is 0.075 after layer 4), and ` r` wins
# after layer 5. Layer 4's copying head has written its push by then, but the stream still favours other tokens
# until layer 5 adds its own.

# %% tags=["solution"]
# Solution (click to show)
guesses = [tok.id_to_piece(i) for i in lens[:, -1].argmax(-1).tolist()]
print("top guess at the last position, layer by layer:", guesses)

# %% [markdown]
# ### Exercise 3 ★★ · Change a knob: another alternative
#
# Replace the alternative ` (` by ` ` (a space, the model's second guess) and redo the attribution. Which terms keep
# their sign, and which flip? What does that say about what each term "knows"?

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Only the direction u changes. A term that pushes ` r` itself keeps its sign whatever the rival; a term that pushes
# against one particular rival may not.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Only the direction changes: `model.lm_head.weight[target] - model.lm_head.weight[space]` with
# `space = tok.encode(" ")[0]`, passed to `cache.logit_attribution(..., pos=-1)`. Print the same terms (`order`)
# against both alternatives side by side.

# %% [markdown] tags=["solution"]
# None of the six largest terms flips. Against a space they keep their signs and, for the attention terms, roughly
# their sizes (layer 4's attention +3.90 against both): they push ` r` itself, the copied name, rather than against
# one particular rival. The routed experts move more: layer 4's routed term halves (−0.96 to −0.44) and layer 1's
# grows (−0.57 to −0.88), so what they push against depends more on the rival.

# %% tags=["solution"]
# Solution (click to show)
space = tok.encode(" ")[0]
against_space = cache.logit_attribution(model.lm_head.weight[target] - model.lm_head.weight[space], pos=-1)
_, values_space = against_space.components(split_moe=True)
for n in order[:6].tolist():
    print(f"{labels[n]:<10} vs ' (' {values[n, 0].item():+.2f}   vs ' ' {values_space[n, 0].item():+.2f}")
