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
# | `patch(model, source_cache, names, positions)` | copies activations from another run ([activation patching](GLOSSARY.md#activation-patching)) |
#
# The demos use the lab's running prompt, except activation patching, which needs two prompts that differ in one
# detail.

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

ids = model.to_tokens(lab.PROMPT)  # [B=1, T] on the model's device: the running prompt
logits, cache = model.run_with_cache(ids)
target = int(logits[0, -1].argmax())
layer = len(model.layers) - 1  # the last MoE layer
tr = routing.trace(model, ids)
chosen = tr.indices[tr.row(layer), 0, -1]  # [k] the last token's experts, best first
expert = int(chosen[0])
log_prob = lambda out: out[0, -1].log_softmax(-1)[target].item()  # noqa: E731
prob = lambda out: out[0, -1].softmax(-1)[target].item()  # noqa: E731
print(f"prediction {tok.id_to_piece(target)!r}, p = {prob(logits):.2f}, log p = {log_prob(logits):.3f}; "
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
          f"its weight {routed[mode][1]:.2f}  the others' {routed[mode][2]:.2f}  change in log p {results[mode]:+.3f}")

# %%
# NBVAL_CHECK_OUTPUT
full = model.config.routed_scaling_factor  # 2.827
print("zero:        choice kept, weights kept:", routed["zero"][0] and routed["zero"][2] < full)
print("renormalize: choice kept, the others' weights sum to 2.827:",
      routed["renormalize"][0] and abs(routed["renormalize"][2] - full) < 1e-4)
print("reroute:     expert replaced, the weights sum to 2.827:",
      not routed["reroute"][0] and abs(routed["reroute"][2] - full) < 1e-4)

# %% [markdown]
# The effect is small. Why, when this is the token's favourite expert? Compare its *direct* push on the target's
# logit ([06](06_logits.ipynb)'s attribution) with what removing it changes:

# %%
attr = cache.logit_attribution(target, pos=-1)
direct = attr.expert_slots[attr.moe_layers.index(layer), 0, 0].item()  # slot 0: the first choice
with ablate_experts(model, {layer: [expert]}, mode="zero"):
    out = model(ids)
others = torch.cat([out[0, -1, :target], out[0, -1, target + 1:]]) - torch.cat(
    [logits[0, -1, :target], logits[0, -1, target + 1:]])  # [V - 1] every other logit's change
print(f"expert {expert}'s direct contribution to the logit of {tok.id_to_piece(target)!r}: {direct:+.2f}")
print(f"removing it changes that logit by {(out - logits)[0, -1, target].item():+.2f}, the other logits by "
      f"{others.mean().item():+.2f} on average, and log p by {log_prob(out) - log_prob(logits):+.3f}")

# %% [markdown]
# Two things shrink the effect. The logit moves less than the direct contribution (−0.46 against +0.81), because
# removing a term also changes the final norm's scale, the rms of x_L that divides every term. And log p
# saturates: with p = 0.72 the target already holds most of the probability, so lowering its logit lowers the
# softmax's normaliser almost as much (d log p / d logit = 1 − p = 0.28); the other logits barely move. So the
# favourite expert of the last layer helps, but the prediction does not hang on it. What of the token's other
# experts at this layer? Reroute each in turn:

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
# Rerouting the token's other experts *raises* log p in all three cases: for experts 3 and 30 by less than any
# removal of expert 14 changed it (+0.019 and +0.009), but for expert 9 by +0.116, more than rerouting or zeroing
# expert 14 lowered it (−0.059, −0.076); of the six ablations only `renormalize` on expert 14 (−0.153) moves log p
# further. For those slots the next-best expert by choice score does more for ` r` than the expert it replaces.
#
# ## Forcing a route
#
# `force_route` overrides the choice. Forcing a single expert the router disliked into one slot is close to a
# no-op *by construction*: the router weighs the experts it is given by their affinities s, and a disliked expert's
# affinity is small, so its slot gets a small weight (try it in exercise 3). To test whether the router's choice
# matters, replace **all** k slots with the k experts it liked *least*, for every token: an anti-router. One layer
# at a time, then all MoE layers at once:

# %%
anti_router = lambda idx, choice: choice.topk(idx.shape[-1], dim=-1, largest=False).indices  # noqa: E731
for i in tr.layers:
    with force_route(model, {i: anti_router}):
        out = model(ids)
    print(f"anti-router at layer {i}:      p({tok.id_to_piece(target)!r}) = {prob(out):.2f}  "
          f"(top guess {tok.id_to_piece(int(out[0, -1].argmax()))!r})")
with force_route(model, {i: anti_router for i in tr.layers}):
    out = model(ids)
print(f"anti-router in every layer: p({tok.id_to_piece(target)!r}) = {prob(out):.2f}  "
      f"(top guess {tok.id_to_piece(int(out[0, -1].argmax()))!r}); unchanged: {prob(logits):.2f}")

# %% [markdown]
# In K2-nano one layer of wrong experts costs little, but wrong experts everywhere destroy the prediction: the
# routed experts matter together, while any one of them (or one layer's choice) can be made up for by the rest of
# the network. The router's choices are not arbitrary; they are redundant.
#
# ## Ablating the head that 06 found
#
# [06](06_logits.ipynb) traced the push towards ` r` to layer 4's attention, mostly head 0, which attends to the
# earlier ` r` tokens. Attribution says where a push was written, not whether the model needs it. Zero each head's
# output z (`hook_z`) at the last position, one at a time, and watch p(` r`):

# %%
def zero_head(head: int):
    """A hook that zeroes one head's output at the last position: z [B, T, H, V]."""
    def hook(z: torch.Tensor, hook) -> torch.Tensor:
        z = z.clone()
        z[:, -1, head] = 0
        return z
    return hook


H = model.config.num_attention_heads
p_without = torch.zeros(len(model.layers), H)  # [L, H]
for i in range(len(model.layers)):
    for h in range(H):
        with model.hooks(fwd_hooks=[(f"layers.{i}.self_attn.hook_z", zero_head(h))]):
            p_without[i, h] = prob(model(ids))
worst = divmod(int(p_without.argmin()), H)
print(f"p({tok.id_to_piece(target)!r}) = {prob(logits):.2f} unchanged; "
      f"lowest without layer {worst[0]}, head {worst[1]}: {p_without.min().item():.2f}")

# %% tags=["nbval-ignore-output"]
viz.effect_heatmap(p_without - prob(logits), [f"layer {i}" for i in range(len(model.layers))],
                   [f"head {h}" for h in range(H)], colorbar_title="change<br>in p", x_title="head zeroed",
                   title=f"Zeroing one head at the last position: change in p({tok.id_to_piece(target)!r})")

# %% [markdown]
# Here attribution and intervention agree: without layer 4's head 0 at one position, the copied name is gone and
# ` r` falls from first place to almost nothing (0.72 to 0.04). One more head matters (layer 5, head 3), and layer
# 4's head 1 a little; the others barely do. The copy that 06 saw in the attribution is needed, and one head of
# 24 carries most of it.
#
# ## Editing the bias
#
# The correction bias only moves the choice. [04a](04a_router.ipynb) measured what removing K2-nano's trained bias
# does at inference: the load grows far less even (MaxVio up to 4.91 from at most 1.01) and the loss rises by 0.025
# nats per token; it did not measure what the bias costs in training. Here the bias is a tool: a very negative
# bias removes an expert from every choice, without touching any weight:

# %%
# NBVAL_CHECK_OUTPUT
from k2lab.training import corpus

code = tok.encode(corpus.corpus_text("heldout", "code"), allow_special=False)[: 8 * 128]
batch = torch.tensor(code, device=model.device).view(8, 128)  # [B, T]
with edit_bias(model, {layer: lambda b: b.index_fill(0, torch.tensor([expert], device=b.device), -10.0)}):
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
clean, corrupt = model.to_tokens(clean_prompt), model.to_tokens(corrupt_prompt)
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
# Each cell is one patched forward. What K2-nano shows: in layers 0 to 2, one position carries most of the quote
# style: the *second* string's opening quote (` '` before `hello`, about 80% restored); the first string's quotes
# carry little (10-15% for the opening one, nothing for the closing one). From layer 3 on, the information moves
# to the last position (a third restored at layer 3, about 60% at layers 4 and 5) while the opening quote's share
# falls: an attention layer between 2 and 4 has copied it to where the next token is predicted. No single cell
# restores everything, because the information sits in more than one place at once.

# %% tags=["nbval-ignore-output"]
viz.effect_heatmap(restored, [f"layer {i} resid_pre" for i in patched_layers],
                   [tok.id_to_piece(i) for i in clean[0].tolist()], colorbar_title="restored",
                   title="Patching the clean residual stream into the corrupted run")

# %% [markdown]
# ### Exercise 1 ★★ · Write it yourself: a patching hook
#
# `patch` is a hook on a probe. Write its core: return the activation with the source's values at the given
# positions (axis 1 of [B, T, D]), *without* changing the activation in place: another probe, or the cache, may hold
# that very tensor. Running the cell checks it (`exercises.check_patch_hook`) and keeps it in your module; the cell
# after the solution uses it through `model.hooks` to reproduce the heatmap's largest cell.

# %%
from k2lab.lab import exercises


@lab.mine
def my_patch(activation: torch.Tensor, source: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """activation, source [B, T, D] -> [B, T, D] with source's values at ``positions``"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Build the answer in a copy of the activation and return the copy: the activation itself (and the source) must
# come out as they went in, since the cache or another probe may hold the same tensors.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `out = activation.clone()`, then assign `source[:, positions]` to `out[:, positions]`. A hook is called as
# `hook(activation, hook)` and its return value replaces the activation: wrap your function in a lambda that
# passes `clean_cache[name]` and `[t]`.

# %% [markdown] tags=["solution"]
# Clone, then write into the copy; the hook receives the activation and the probe, and the lambda supplies the
# clean run's activation and the position:

# %% tags=["solution"]
# Solution (click to show)
def solution_patch(activation: torch.Tensor, source: torch.Tensor, positions: list[int]) -> torch.Tensor:
    out = activation.clone()
    out[:, positions] = source[:, positions]
    return out


print(exercises.check_patch_hook(solution_patch))

# %% [markdown]
# `my_patch` from your module (yours if it passed its check, else the reference; the first lines say which) as a
# hook, on the heatmap's largest cell:

# %%
mine = lab.mine.load("my_patch")
row, t = divmod(best, T)
name = f"layers.{patched_layers[row]}.hook_resid_pre"
with model.hooks(fwd_hooks=[(name, lambda act, hook: mine.my_patch(act, clean_cache[name], [t]))]):
    by_hook = (ld(model(corrupt)) - ld_corrupt) / (ld_clean - ld_corrupt)
print(f"{name}, position {t}: restored {by_hook:.2f} (heatmap: {restored.max().item():.2f})")

# %% [markdown]
# ## Prompts of different lengths: a padded batch
#
# Patching needed two prompts of equal length. Running prompts of *different* lengths together needs padding:
# `tok.encode_padded` pads each row on the left to the longest (pad id, mask 0) and returns the
# attention mask too; given the mask, the model never attends to a pad and starts
# each row's positions at its first real token (docs/research.md). So each row must equal its prompt run alone:

# %%
prompts = [lab.PROMPT, "import os\nprint("]
padded, mask = tok.encode_padded(prompts, padding_side="left")  # [2, T_max] each
batched = model(padded, attention_mask=mask)  # [2, T_max, V]
print(f"batch {tuple(padded.shape)}, real tokens per row {mask.sum(-1).tolist()}")
for row, text in enumerate(prompts):
    alone = model(model.to_tokens(text))  # [1, T_row, V]
    gap = (batched[row, -alone.shape[1]:] - alone[0]).abs().max().item()  # left padding: the row's tokens are last
    print(f"row {row}: max |batched - alone| over its logits = {gap:.0e} (float32 rounding: {gap < 1e-4})")

# %% [markdown]
# The differences are float32 rounding (a batch of two sums in another order than a batch of one). Without the
# mask, row 1's tokens would attend to 39 pad tokens and its logits would change.
#
# ## Attribution patching: the heatmap from one backward pass
#
# The heatmap above cost one forward pass per cell (6 layers × 14 positions). **Attribution patching** (Nanda,
# "Attribution Patching", 2023) estimates every cell at once by a first-order Taylor expansion around the corrupted
# run: the change in the metric from patching activation a is about
# (a_clean − a_corrupt) · ∂LD/∂a, evaluated on the corrupted run. `attribution_patch` needs one clean forward, one
# corrupted forward and one backward (its docstring in `k2lab/analysis/interventions.py`). We normalise by
# LD_clean − LD_corrupt as before:

# %%
# NBVAL_CHECK_OUTPUT
from k2lab.analysis.interventions import attribution_patch

ld_tensor = lambda out: out[0, -1, single] - out[0, -1, double]  # noqa: E731  the metric as a scalar tensor
estimates = attribution_patch(model, clean, corrupt, ld_tensor, names="hook_resid_pre")  # {name: [B, T]}
estimated = torch.stack([estimates[f"layers.{i}.hook_resid_pre"][0] for i in patched_layers]).cpu() / (ld_clean - ld_corrupt)
r = torch.corrcoef(torch.stack([estimated.flatten(), restored.flatten()]))[0, 1].item()
print(f"correlation over the {restored.numel()} cells: {r:.2f}")
for row, t in [divmod(int(c), T) for c in restored.flatten().topk(4).indices]:
    print(f"layer {patched_layers[row]}, position {t:>2} {tok.id_to_piece(int(clean[0, t]))!r:>7}: "
          f"patched {restored[row, t].item():.2f}, estimated {estimated[row, t].item():.2f}")

# %% tags=["nbval-ignore-output"]
import plotly.graph_objects as go

fig = go.Figure()
for row, i in enumerate(patched_layers):
    fig.add_scatter(x=restored[row].tolist(), y=estimated[row].tolist(), mode="markers", name=f"layer {i}",
                    text=[tok.id_to_piece(int(t)) for t in clean[0]], marker=dict(size=9))
fig.add_scatter(x=[-0.1, 1], y=[-0.1, 1], mode="lines", line=dict(dash="dot", color="grey"), name="estimate = patch")
fig.update_layout(title="Attribution patching against activation patching, one point per layer and position",
                  xaxis_title="restored by the real patch", yaxis_title="first-order estimate", height=460,
                  template="plotly_white")
fig

# %% [markdown]
# The estimate finds the same cells: the opening quote in layers 0 to 2, the last position from layer 3 on, and
# nothing elsewhere (correlation 0.98). But it is not the patch. Where a cell matters most it falls short: at
# layers 0 to 2 the opening quote restores about 0.8 while the estimate says 0.5 to 0.65, and at layer 4 the last
# position restores 0.62 against an estimate of 0.42. The first-order term is exact only where LD is linear in
# the patched activation (exercise 4), and the further the activation is from the output, the more non-linear
# steps lie between: attention softmaxes, RMSNorms, SwiGLUs and the router's top-k, whose switch from one expert
# to another the gradient cannot see at all (top-k is piecewise constant). A large change (here the whole quote
# style) also leaves the region where the tangent is a good guide: the errors go both ways (layer 4's opening
# quote is overestimated, 0.31 against 0.25), and a small cell can get the wrong sign (layer 0, position 5).
# At the last position of layer 5, where one block and the final norm separate the activation from the logits,
# the two agree best (0.61 against 0.64).
# Use it as a cheap map to choose which cells to patch for real, as Nanda suggests, not as the measurement.

# %% [markdown]
# ## More exercises
#
# ### Exercise 2 ★ · Predict, then run: two heads at once
#
# Zero layer 5's head 3 at the last position *together with* layer 4's head 0. Will p(` r`) fall below what
# removing head 0 alone gave (0.04)? Predict, then pass both hooks to `model.hooks`.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Two heads that carry the same copy can each make up for the other; if one carries what the other left, removing both
# should cost far more than either alone.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `model.hooks(fwd_hooks=[(name_1, zero_head(0)), (name_2, zero_head(3))])` with the two `self_attn.hook_z` names;
# `prob(model(ids))` inside the `with` block.

# %% [markdown] tags=["solution"]
# Yes, by a factor of 20: p(` r`) falls to 0.002, from 0.040 with layer 4's head 0 alone. Layer 5's head 3 supplied
# most of what remained; the heatmap showed it as the second head that matters.

# %% tags=["solution"]
# Solution (click to show)
both_zeroed = [("layers.4.self_attn.hook_z", zero_head(0)), ("layers.5.self_attn.hook_z", zero_head(3))]
with model.hooks(fwd_hooks=both_zeroed):
    print(f"without L4.h0 and L5.h3: p = {prob(model(ids)):.3f} (L4.h0 alone: {p_without[4, 0].item():.3f})")

# %% [markdown]
# ### Exercise 3 ★★ · Change a knob: one unwanted expert
#
# Force only the single least-liked expert into the last token's first slot at the last layer
# (`force_route(model, {layer: [least]}, positions=[-1])`), and print its weight from `routing.trace`. Predict the
# weight before you run it, from its affinity s.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# A forced expert fills a slot, but its weight still comes from its own affinity s, renormalised with the other chosen
# experts'.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# The least-liked expert is `tr.choice_scores[tr.row(layer), 0, -1].argmin()`. Its weight is its affinity divided
# by the sum of the four chosen affinities, times 2.827 ([04a](04a_router.ipynb), step 5).

# %% [markdown] tags=["solution"]
# The weight is small because the affinity is: expert 28 has s = 0.038, so it gets 0.065 of the 2.827 while the
# three experts it joins keep theirs (1.145, 0.870, 0.747), and log p changes by only −0.034. Forcing an expert
# into a slot does not force the model to use it: the router weighs it by its own affinity.

# %% tags=["solution"]
# Solution (click to show)
least = int(tr.choice_scores[tr.row(layer), 0, -1].argmin())
with force_route(model, {layer: [least]}, positions=[-1]):
    forced = routing.trace(model, ids)
    delta = log_prob(model(ids)) - log_prob(logits)
j = forced.row(layer)
print(f"forced expert {least} (s = {tr.scores[j, 0, -1, least].item():.3f}): chosen {forced.indices[j, 0, -1].tolist()}, "
      f"weights {[round(w, 3) for w in forced.weights[j, 0, -1].tolist()]}; change in log p {delta:+.3f}")

# %% [markdown]
# ### Exercise 4 ★★ · Predict, then run: where is the estimate exact?
#
# `norm.hook_out` is the final norm's output, which the head multiplies to give the logits;
# `layers.5.hook_resid_post` is the same stream before that norm. At the last position, will `attribution_patch`
# match the real patch (`patch(model, cache, name, positions=[T - 1])`) on both? Predict, then compare the two
# numbers for each.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Ask where LD is a linear function of the patched activation: the first-order estimate is then exact.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Record both probes on the clean run
# (`model.run_with_cache(clean, names=[...])`), run `attribution_patch(model, clean, corrupt, ld_tensor, names=[...])`,
# and for each name the real patch's change in LD is `ld(model(corrupt)) - ld_corrupt` inside `patch(...)`.

# %% [markdown] tags=["solution"]
# Exact after the norm, not before it. LD is a difference of two rows of the head applied to `norm.hook_out`:
# linear, so the first-order estimate is the exact change (+8.6239 both). Before the norm, the patch also changes
# the rms that divides x, which the tangent only approximates: the estimate says +8.11 where the real patch gives
# +8.62.

# %% tags=["solution"]
# Solution (click to show)
final_names = ["norm.hook_out", f"layers.{L - 1}.hook_resid_post"]
_, final_cache = model.run_with_cache(clean, names=final_names)
final_estimates = attribution_patch(model, clean, corrupt, ld_tensor, names=final_names)
for name in final_names:
    with patch(model, final_cache, name, positions=[T - 1]):
        real = ld(model(corrupt)) - ld_corrupt
    print(f"{name:<24} last position: estimate {final_estimates[name][0, -1].item():+.4f}, "
          f"real patch {real:+.4f} (change in LD)")
