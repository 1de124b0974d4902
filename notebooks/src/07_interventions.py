# %% [markdown]
# # 07 · Interventions
#
# Reading activations shows what happened; changing them shows what *matters*. `k2lab.interventions` offers four
# context managers, each built on the probes and undone on exit:
#
# | intervention | what it changes |
# | --- | --- |
# | `ablate_experts(model, {layer: [experts]}, mode)` | removes routed experts, in one of three modes |
# | `force_route(model, {layer: [experts]}, positions)` | chooses the experts yourself |
# | `edit_bias(model, {layer: bias})` | replaces the correction bias, moving tokens between experts |
# | `patch(model, source_cache, names, positions)` | copies activations from another run (activation patching) |

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings)
print(about)

# %%
import torch

from k2lab import routing, viz
from k2lab.analysis.interventions import ablate_experts, edit_bias, force_route, patch

prompt = "for key, value in sorted(table.items()):\n    print(key,"
ids = torch.tensor([tok.encode(prompt)])  # [B=1, T]
logits = model(ids)
target = int(logits[0, -1].argmax())
layer = len(model.layers) - 1  # the last MoE layer
tr = routing.trace(model, ids)
chosen = tr.indices[tr.row(layer), 0, -1]  # [k] the last token's experts, best first
expert = int(chosen[0])
log_prob = lambda out: out[0, -1].log_softmax(-1)[target].item()
print(f"prediction {tok.id_to_piece(target)!r}, log p = {log_prob(logits):.3f}; "
      f"layer {layer} sends the last token to experts {chosen.tolist()}")

# %% [markdown]
# ## Ablating an expert, three ways
#
# Remove the last token's first-choice expert at that layer. What "remove" means is a choice:
#
# * `zero`: its slot contributes nothing; the other experts keep their weights (as if its output were 0);
# * `renormalize`: its slot is dropped and the others' weights renormalised to sum to 2.827 again;
# * `reroute`: the slot goes to the next-best expert by choice score, as if the expert did not exist.

# %%
results, routed = {}, {}
for mode in ("zero", "renormalize", "reroute"):
    with ablate_experts(model, {layer: [expert]}, mode=mode):
        out = model(ids)
        seen = routing.trace(model, ids)
    results[mode] = log_prob(out) - log_prob(logits)
    idx, w = seen.indices[seen.row(layer), 0, -1], seen.weights[seen.row(layer), 0, -1]  # [k], [k]
    mine = idx == expert
    routed[mode] = (bool(mine.any()), w[mine].sum().item(), w[~mine].sum().item())
    print(f"{mode:<12} expert {expert} chosen: {routed[mode][0]!s:<5}  "
          f"its weight {routed[mode][1]:.2f}  the others' {routed[mode][2]:.2f}")

# %%
# NBVAL_CHECK_OUTPUT
full = model.config.routed_scaling_factor  # 2.827
print("zero:        choice kept, weights kept:", routed["zero"][0] and routed["zero"][2] < full)
print("renormalize: choice kept, the others' weights sum to 2.827:",
      routed["renormalize"][0] and abs(routed["renormalize"][2] - full) < 1e-4)
print("reroute:     expert replaced, the weights sum to 2.827:",
      not routed["reroute"][0] and abs(routed["reroute"][2] - full) < 1e-4)

# %% [markdown]
# `zero` keeps the expert's weight but zeroes its output (`hook_expert_out` shows zeros in that slot), so the
# routed part shrinks; `renormalize` gives its weight to the others; `reroute` hands its slot to another expert.
# The effect of each on the prediction, and of ablating each of the token's other experts (in `reroute` mode):

# %%
for e in chosen.tolist()[1:]:
    with ablate_experts(model, {layer: [e]}, mode="reroute"):
        results[f"reroute expert {e}"] = log_prob(model(ids)) - log_prob(logits)
for name, delta in results.items():
    print(f"{name:<20} change in log p: {delta:+.3f}")

# %% tags=["nbval-ignore-output"]
viz.attribution_figure(list(results), torch.tensor(list(results.values())),
                       x_title=f"change in log p({tok.id_to_piece(target)!r})",
                       title=f"Ablating the last token's experts at layer {layer}")

# %% [markdown]
# ## Forcing a route
#
# `force_route` overrides the choice: here the last token must use the expert the router liked *least*. The
# router still weighs the experts it is given by their affinities s (renormalised, × 2.827).

# %%
least = int(tr.choice_scores[tr.row(layer), 0, -1].argmin())
with force_route(model, {layer: [least]}, positions=[-1]):
    forced = routing.trace(model, ids)
    delta = log_prob(model(ids)) - log_prob(logits)
j = forced.row(layer)
print(f"forced expert {least}: chosen {forced.indices[j, 0, -1].tolist()}, "
      f"weights {[round(w, 3) for w in forced.weights[j, 0, -1].tolist()]}")
print(f"change in log p: {delta:+.3f}")

# %% [markdown]
# ## Editing the bias
#
# The correction bias only moves the choice. What does it buy? Route a batch of held-out code with the trained
# bias, then with every bias set to zero, and compare the load balance (MaxVio, 0 = perfectly even):

# %%
from k2lab.training import corpus

code = tok.encode(corpus.corpus_text("heldout", "code"), allow_special=False)[: 8 * 128]
batch = torch.tensor(code).view(8, 128)  # [B, T]
with_bias = routing.max_violation(routing.expert_counts(routing.trace(model, batch)))
with edit_bias(model, {i: 0.0 for i in tr.layers}):
    without_bias = routing.max_violation(routing.expert_counts(routing.trace(model, batch)))
for i, a, b in zip(tr.layers, with_bias.tolist(), without_bias.tolist(), strict=True):
    print(f"layer {i}: MaxVio {a:.2f} with the trained bias, {b:.2f} without")

# %% [markdown]
# And the other way round: a very negative bias removes an expert from every choice, without touching any weight.

# %%
# NBVAL_CHECK_OUTPUT
with edit_bias(model, {layer: lambda b: b.index_fill(0, torch.tensor([expert]), -10.0)}):
    banned = routing.expert_counts(routing.trace(model, batch))[tr.row(layer), expert].item()
print(f"tokens routed to the banned expert at layer {layer}: {banned}")
bias = model.layers[layer].mlp.gate.e_score_correction_bias  # [E]
print("bias restored on exit:", bias[expert].item() > -10)

# %% [markdown]
# ## Activation patching
#
# Which activations carry a piece of information? Take two prompts that differ in one detail, here the quote
# character, and measure the model's preference for closing with `'` rather than `"`: the logit difference LD.
# Run the *corrupted* prompt, but copy in the *clean* run's residual stream at one layer and one position. If the
# patch restores the clean preference, that activation carried the information. Normalised,
#
# $$\text{restored} = \frac{LD_{patched} - LD_{corrupted}}{LD_{clean} - LD_{corrupted}} \quad (0: \text{nothing}, 1: \text{everything}).$$

# %%
clean_prompt, corrupt_prompt = "name = 'world'\ngreeting = 'hello", 'name = "world"\ngreeting = "hello'
clean, corrupt = torch.tensor([tok.encode(clean_prompt)]), torch.tensor([tok.encode(corrupt_prompt)])
assert clean.shape == corrupt.shape, "patching needs prompts of equal length"
single, double = tok.encode("'")[0], tok.encode('"')[0]
ld = lambda out: (out[0, -1, single] - out[0, -1, double]).item()
clean_logits, clean_cache = model.run_with_cache(clean, names="hook_resid_pre")
ld_clean, ld_corrupt = ld(clean_logits), ld(model(corrupt))
print(f"LD clean {ld_clean:+.2f}, corrupted {ld_corrupt:+.2f}")

L, T = len(model.layers), clean.shape[1]
patched_layers = list(range(0, L, max(1, L // 12)))  # every layer of K2-nano; about 12 of a deep model's
restored = torch.zeros(len(patched_layers), T)
for row, i in enumerate(patched_layers):
    for t in range(T):
        with patch(model, clean_cache, f"layers.{i}.hook_resid_pre", positions=[t]):
            restored[row, t] = (ld(model(corrupt)) - ld_corrupt) / (ld_clean - ld_corrupt)
best = int(restored.argmax())
print(f"largest restoration {restored.max().item():.2f} at layer {patched_layers[best // T]}, "
      f"position {best % T}")

# %% [markdown]
# Each cell is one patched forward. Read it from the top: in K2-nano the early layers hold the quote style at the
# positions of the quotes themselves, and the later layers at the last position, where the next token is
# predicted. Somewhere in between, attention heads have copied it across.

# %% tags=["nbval-ignore-output"]
viz.effect_heatmap(restored, [f"layer {i} resid_pre" for i in patched_layers],
                   [tok.id_to_piece(i) for i in clean[0].tolist()], colorbar_title="restored",
                   title="Patching the clean residual stream into the corrupted run")
