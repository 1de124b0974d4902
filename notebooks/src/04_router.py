# %% [markdown]
# # 04 · The router
#
# In every MoE block (all of K2's blocks but the first) a router decides which experts process each token. K2's
# router is not the softmax router of Mixtral or OLMoE. For a token with residual x, over E experts:
#
# 1. **logits** = W_gate x, one per expert, computed in float32;
# 2. **affinities** s = sigmoid(logits): each expert is judged on its own, they need not sum to one;
# 3. **choice scores** = s + b, where b is the *correction bias*, one number per expert;
# 4. **top-k** of the choice scores picks the experts (K2: 8 of 384);
# 5. **weights** w = s[idx] / Σ s[idx] × 2.827: the chosen experts' *affinities*, renormalised and scaled by the
#    `routed_scaling_factor`. The bias is not in the weights.
#
# The bias is how K2 balances its experts without an auxiliary loss: during training an overloaded expert's bias
# is lowered a little after each step, an idle one's raised, so the choice shifts while the weights (and the
# gradient) stay those of the affinities. A consequence for analysis: **sorting the logits does not tell you
# which experts a token used**; only the choice scores do.

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings)
print(about)

# %% [markdown]
# ## One token, stage by stage
#
# We record the router probes (`layers.{i}.mlp.gate.hook_*`) for a prompt and follow its last token through the
# last MoE layer.

# %%
import torch

prompt = "class Stack:\n    def push(self, item):\n        self.items.append(item)"
ids = torch.tensor([tok.encode(prompt)])  # [B=1, T]
tokens = [tok.id_to_piece(i) for i in ids[0].tolist()]
_, cache = model.run_with_cache(ids, names=".mlp.gate.")
layer = len(model.layers) - 1
gate = model.layers[layer].mlp.gate
g = f"layers.{layer}.mlp.gate."
logits = cache[g + "hook_logits"][0, -1]  # [E]
print(f"layer {layer}, token {tokens[-1]!r}: {logits.shape[0]} experts, top-{gate.top_k}")

# %% [markdown]
# **Steps 1–3.** Logits, affinities, and the bias that shifts them into choice scores:

# %%
s = logits.sigmoid()  # [E] affinities in (0, 1)
bias = gate.e_score_correction_bias  # [E] float32
choice = s + bias  # [E]
print(f"{'expert':>6}{'logit':>9}{'s':>8}{'bias':>9}{'s + bias':>10}")
for e in choice.argsort(descending=True)[:10].tolist():
    print(f"{e:>6}{logits[e].item():>9.3f}{s[e].item():>8.3f}{bias[e].item():>+9.3f}"
          f"{choice[e].item():>10.3f}")

# %% [markdown]
# **Step 4.** The top-k of the choice scores. Compare it with the top-k of the logits (equivalently of s, since
# sigmoid keeps the order): wherever the bias matters they differ.

# %%
idx = choice.topk(gate.top_k).indices  # [k]
by_logits = logits.topk(gate.top_k).indices  # [k]
print("chosen (top-k of s + bias):", sorted(idx.tolist()))
print("top-k of the logits:       ", sorted(by_logits.tolist()))
print("the router's own choice:   ", sorted(cache[g + "hook_topk_idx"][0, -1].tolist()))

# %% [markdown]
# **Step 5.** The weights come from the affinities s, not from the choice scores, renormalised over the chosen
# experts and multiplied by the scaling factor, so they always sum to 2.827:

# %%
# NBVAL_CHECK_OUTPUT
w = s[idx] / (s[idx].sum() + 1e-20) * gate.scaling  # [k]
print(f"weights sum to routed_scaling_factor = {w.sum().item():.3f}")
print("equal to hook_topk_weights:", torch.allclose(w, cache[g + "hook_topk_weights"][0, -1]))
print("equal to hook_topk_idx:", torch.equal(idx, cache[g + "hook_topk_idx"][0, -1]))

# %% [markdown]
# The figure puts the stages together: bars are affinities (filled for the chosen experts), diamonds the choice
# scores, hollow circles the experts the token would have chosen without the bias.

# %% tags=["nbval-ignore-output"]
from k2lab import routing, viz

tr = routing.trace(model, ids)
j = tr.row(layer)
viz.router_token_figure(tr.scores[j, 0, -1], bias, tr.indices[j, 0, -1], tr.weights[j, 0, -1],
                        logits=logits, unbiased=tr.unbiased_indices[j, 0, -1],
                        title=f"Layer {layer}, token {tokens[-1]!r}")

# %% [markdown]
# ## Bias flips
#
# A **flip** is a token whose chosen *set* of experts would differ without the bias. `routing.trace` records the
# unbiased choice too (the same rule, applied to s alone), so we can count flips per layer:

# %%
flip_share = tr.bias_flips[:, 0].float().mean(-1)  # [L_moe]
for i, share, count in zip(tr.layers, flip_share.tolist(), tr.flip_counts.tolist(), strict=True):
    print(f"layer {i}: {count:>3} of {ids.shape[1]} tokens flipped ({share:.0%})")

# %% tags=["nbval-ignore-output"]
viz.bias_flip_figure(flip_share, tr.layers)

# %% [markdown]
# ## Explorer
#
# Pick a layer and a token to see its router stages. Look for tokens where the hollow circles (the unbiased
# choice) and the filled bars disagree: those are the flips.

# %% tags=["nbval-ignore-output"]
router_logits = cache.stack("gate.hook_logits")  # [L_moe, B, T, E]
viz.widgets.router_explorer(tr, tokens, logits=router_logits)

# %% [markdown]
# ## Groups
#
# DeepSeek-V3 also limits each token to the experts of its best `topk_group` of `n_group` groups (a group scored by
# the sum of its two best choice scores). K2 sets `n_group = 1`, so the limit does nothing; `k2lab` implements it
# anyway (`routing.select_experts`, `routing.allowed_experts`) for DeepSeek-V3 checkpoints.

# %%
# NBVAL_CHECK_OUTPUT
from k2lab import K2Config

k2 = K2Config.kimi_k2()
print(f"K2: n_group={k2.n_group}, topk_group={k2.topk_group}, top-{k2.num_experts_per_tok} of "
      f"{k2.n_routed_experts}, routed_scaling_factor={k2.routed_scaling_factor}")
print("select_experts reproduces the router:",
      torch.equal(routing.select_experts(tr.choice_scores, gate.top_k, model.config.n_group,
                                         model.config.topk_group), tr.indices))
