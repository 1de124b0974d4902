# %% [markdown]
# # 04a · The router
#
# From its second block on, K2's feed-forward layer is a mixture of experts: 384 small SwiGLU networks, of which
# each token uses 8, plus one shared expert that every token uses. Something must decide which 8. That is the
# **router**, and this notebook takes it apart; [04b](04b_block.ipynb) then puts the router, the experts and the
# norms back together into a block. For a token with residual x (after the block's second norm), over E experts:
#
# 1. **logits** = W_gate x, one per expert, computed in float32;
# 2. **affinities** s = sigmoid(logits): each expert is judged on its own, they need not sum to one;
# 3. **choice scores** = s + b, where b is the *correction bias*, one number per expert;
# 4. **top-k** of the choice scores picks the experts (K2: 8 of 384);
# 5. **weights** w = s[idx] / Σ s[idx] × 2.827: the chosen experts' *affinities*, renormalised and scaled by the
#    `routed_scaling_factor`. The bias is not in the weights.
#
# A consequence for analysis, whatever the training: **sorting the logits does not tell you which experts a token
# used**; only the choice scores do. Terms: [affinity](GLOSSARY.md#affinity),
# [correction bias](GLOSSARY.md#correction-bias).
#
# *Sources.* Every number above is in the released `config.json` of Kimi-K2-Instruct: `scoring_func: "sigmoid"`,
# `topk_method: "noaux_tc"`, `n_routed_experts: 384`, `num_experts_per_tok: 8`, `n_shared_experts: 1`,
# `norm_topk_prob: true`, `routed_scaling_factor: 2.827`, `n_group: 1`; the five stages are the release's
# `MoEGate.forward` in `modeling_deepseek.py`, and each MoE block's `e_score_correction_bias` is a float32 tensor
# of the checkpoint. The K2 report (its Table 2) says the same: 384 experts, 8 active, 1 shared, no expert grouping.
#
# ## Why a sigmoid and a bias: what each router before it could not do
#
# **A softmax router** (the sparsely-gated MoE of Shazeer et al., 2017; GShard; Switch Transformer; DeepSeek-V2)
# turns the logits into a softmax over the experts and keeps the top k. Trained on the language-model loss alone,
# it tends to collapse: the experts that win early get more tokens, learn faster, and win more, until a few do
# most of the work and the rest idle (and, on a cluster, the GPUs that hold the busy experts make the others wait).
#
# **An auxiliary balance loss** fixes the collapse by adding a term that is smallest when the load is even
# (Switch Transformer's α · E · Σ_e f_e P_e, with f_e the share of tokens sent to expert e and P_e its mean router
# probability; DeepSeek-V2 uses three such losses, at the expert, device and communication level). What it cannot
# do is stay out of the way: its gradient flows into the same router weights as the language-model loss. Make α
# large and the load is even but the model is worse; make it small and the load drifts (Wang et al., below, measure
# this trade-off across values of α).
#
# **A correction bias outside the gradient** is the way out proposed by Wang et al. (2024), "Auxiliary-Loss-Free
# Load Balancing Strategy for Mixture-of-Experts" (arXiv 2408.15664): add one bias per expert to the scores *only to
# choose* the top k, and after each step move an overloaded expert's bias down and an underloaded one's up by a
# fixed amount u. No loss term, so no gradient interferes; the weights, and so the gradient, are those of the
# scores. DeepSeek-V3 (arXiv 2412.19437, section 2.1.2) adopted it with u = 0.001, switched the affinities from
# softmax to sigmoid (its report states the change without an ablation), and kept a sequence-wise balance loss
# with a very small weight (α = 0.0001) against extreme imbalance inside one sequence.
#
# **Kimi K2** runs DeepSeek-V3's router, as the config above shows. What the sources leave unsaid: **the K2 report
# does not describe how K2's bias was updated, nor whether any balance loss was used**; the released config carries
# `aux_loss_alpha: 0.001` and `seq_aux: true`, the names DeepSeek-V3's code gives its sequence-wise loss, which
# says it was configured, not that it was used. K2-nano was trained with DeepSeek-V3's bias rule and no auxiliary
# loss ([10](10_training.ipynb)); this notebook measures what that bias does in K2-nano.

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings)
print(about)

# %% [markdown]
# ## One token, stage by stage
#
# We record the router probes (`layers.{i}.mlp.gate.hook_*`) for the lab's running prompt and follow its last token
# (the one that must predict ` radius`) through the last MoE layer.

# %%
import torch

ids = model.to_tokens(lab.PROMPT)  # [B=1, T], on the model's device
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
# ### Exercise 1 ★★ · Write it yourself: the router
#
# Write the five stages as one function over a batch of tokens: `x` [N, D] the router's inputs, `weight` [E, D] its
# matrix (`gate.weight`), `bias` [E] the correction bias, then `top_k` and `scaling`. Return the chosen experts
# [N, k] and their weights [N, k], in any order of the k slots. Running the cell checks it
# (`exercises.check_router` runs it on a random router whose bias is far from zero, since a zero bias would hide the
# commonest slips, against k2lab's `Router`, and names what it recognises: the bias in the weights, a softmax, no
# renormalisation, no scaling, the bias on the logits, ...) and keeps it in your module.

# %%
from k2lab.lab import exercises


@lab.mine
def my_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """x [N, D], weight [E, D], bias [E] -> (idx [N, k], weights [N, k])"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# The five stages above, for all tokens at once. The bias enters exactly once: it decides which experts are chosen.
# The weights are read from the affinities s of the chosen experts, renormalised over the k of them and scaled.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Three lines do it. `s = (x @ weight.T).sigmoid()`; the experts are `(s + bias).topk(top_k, dim=-1).indices`;
# the weights are gathered from **s**, not from `s + bias` (`s.gather(-1, idx)`), then divided by their sum over the
# k slots and multiplied by `scaling`.

# %% [markdown] tags=["solution"]
# The bias enters once, in the top-k, and the weights are read from s at the chosen indices:

# %% tags=["solution"]
# Solution (click to show)
def solution_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    s = (x.float() @ weight.float().T).sigmoid()  # [N, E] stages 1-2
    idx = (s + bias).topk(top_k, dim=-1).indices  # [N, k] stages 3-4: the bias chooses ...
    w = s.gather(-1, idx)  # [N, k] ... but the weights come from s
    return idx, w / w.sum(-1, keepdim=True) * scaling  # stage 5


print(exercises.check_router(solution_router))

# %% [markdown]
# Your router (from your module: yours if it passed its check, else k2lab's reference, as the first lines say) on
# the real input of the last MoE layer, which the probe `post_attention_layernorm.hook_out` records (the block's
# second norm of the residual, [04b](04b_block.ipynb)). It must choose what the model chose for every token:

# %%
mine = lab.mine.load("my_router")
_, full = model.run_with_cache(ids, names=f"layers.{layer}.")
h = full[f"layers.{layer}.post_attention_layernorm.hook_out"][0]  # [T, D] what the router reads
chosen, chosen_w = mine.my_router(h, gate.weight, gate.e_score_correction_bias, gate.top_k, gate.scaling)
theirs = full[f"layers.{layer}.mlp.gate.hook_topk_idx"][0]  # [T, k]
print("same experts as hook_topk_idx for every token:", torch.equal(chosen.sort(-1).values, theirs.sort(-1).values))

# %% [markdown]
# ## Why not softmax: the same logits, two routers
#
# The exercise needed no softmax. Before the bias, what does the sigmoid itself change? Both functions increase with
# the logit, so on their own they choose the same top k. They differ in what the scores mean:
#
# * softmax scores compete: they sum to 1 over all E experts, so one expert's score depends on every other logit;
#   sigmoid scores are each in (0, 1), independent of the others;
# * after renormalising over the chosen k, softmax weights depend only on the *differences* of the chosen logits
#   (e^{l_i} / Σ e^{l_j}), while sigmoid weights also depend on where the logits sit: shifting every logit up by
#   the same amount changes them.

# %%
softmax = logits.softmax(-1)  # [E]
best = logits.topk(gate.top_k).indices  # [k] the same for sigmoid and softmax: both are monotone
renorm = lambda v: v[best] / v[best].sum() * gate.scaling  # noqa: E731  weights over the chosen k
print(f"sum over all {logits.shape[0]} experts: sigmoid {s.sum().item():.2f}, softmax {softmax.sum().item():.2f}")
print(f"{'expert':>6}{'logit':>8}{'sigmoid':>9}{'softmax':>9}{'w sigmoid':>11}{'w softmax':>11}"
      f"{'w sigmoid, logits + 2':>23}{'w softmax, logits + 2':>23}")
shifted = logits + 2.0
for n, e in enumerate(best.tolist()):
    print(f"{e:>6}{logits[e].item():>8.2f}{s[e].item():>9.3f}{softmax[e].item():>9.3f}"
          f"{renorm(s)[n].item():>11.3f}{renorm(softmax)[n].item():>11.3f}"
          f"{renorm(shifted.sigmoid())[n].item():>23.3f}{renorm(shifted.softmax(-1))[n].item():>23.3f}")

# %% [markdown]
# Read the table: the sigmoid weights are flatter than the softmax ones (a sigmoid saturates, an exponential does
# not), and shifting every logit by +2 leaves the softmax weights exactly as they were but moves the sigmoid ones.
# So without a bias the two routers choose the same experts and weigh them differently. The bias is what makes the
# choice differ: added to sigmoid scores in (0, 1), it can overturn their order ("Bias flips", below, counts how
# often).

# %% [markdown]
# ### A softmax-routed model beside K2-nano
#
# The same comparison on whole models. k2lab also runs DeepSeek-V2's router (`scoring_func="softmax"`,
# `topk_method="greedy"`, `norm_topk_prob=False`, no correction bias; `Router` in `k2lab/model/moe.py`, checked
# against HF transformers' `DeepseekV2ForCausalLM` in tests/model/test_softmax_router.py and
# [docs/family.md](../docs/family.md)). We build K2-nano's shape with that router and `routed_scaling_factor=1`
# (DeepSeek-V2-Lite's value in its config.json) and give it **random** weights (`init_weights`): no softmax-routed
# model was trained here, so only the *mechanics* of the probes compare, not what the experts learned. The running
# prompt goes through both (K2-nano's tokenizer; the random model shares its vocabulary).

# %%
# NBVAL_CHECK_OUTPUT
from k2lab import K2Config, K2Model

softmax_cfg = K2Config.nano().replace(scoring_func="softmax", topk_method="greedy", norm_topk_prob=False,
                                      routed_scaling_factor=1.0)
softmax_model = K2Model(softmax_cfg).eval()
softmax_model.init_weights(seed=0)  # random: normal(0, 0.02) matrices
nano, nano_tok = (model, tok) if settings.is_nano else lab.load_nano()  # K2-nano, whatever model this notebook runs
nano_ids = torch.tensor([nano_tok.encode(lab.PROMPT)])  # [1, T]
probes = {}
for name, m in (("K2-nano: sigmoid s", nano),  # hook_scores: s, before the bias
                ("softmax, random", softmax_model)):
    last = len(m.layers) - 1
    _, c = m.run_with_cache(nano_ids, names=f"layers.{last}.mlp.gate.", device="cpu")  # both models' probes side by side
    probes[name] = {stage: c[f"layers.{last}.mlp.gate.hook_{stage}"][0] for stage in ("scores", "topk_idx",
                                                                                     "topk_weights")}
print(f"last MoE layer, {nano_ids.shape[1]} tokens, top-{softmax_cfg.num_experts_per_tok} of "
      f"{softmax_cfg.n_routed_experts}; the softmax model's router has a correction bias: "
      f"{softmax_model.layers[-1].mlp.gate.e_score_correction_bias is not None}")
print(f"{'router':<26}{'scores sum per token':>24}{'last token: max s':>19}{'weights sum':>13}{'busiest expert':>16}")
for name, p in probes.items():
    sums, E = p["scores"].sum(-1), p["scores"].shape[-1]  # [T], experts
    load = torch.bincount(p["topk_idx"].flatten(), minlength=E) / p["topk_idx"].numel() * E  # [E] x fair share
    print(f"{name:<26}{sums.min().item():>11.2f} to {sums.max().item():<9.2f}{p['scores'][-1].max().item():>19.3f}"
          f"{p['topk_weights'].sum(-1).mean().item():>13.3f}{load.max().item():>13.1f} x")

# %% [markdown]
# What the probes show, row by row:
#
# * **`hook_scores`.** The softmax scores sum to exactly 1 for every token: the experts share one unit of
#   probability. K2-nano's sigmoid scores are independent; their sum over 32 experts varies from token to token
#   (between about 2 and 20 here), and it means nothing.
# * **`hook_topk_weights`.** With `norm_topk_prob=False` the softmax router's weights are the chosen scores as they
#   are, so they sum to the share of the unit the chosen experts hold (about 0.17 for 4 of 32 experts at random
#   initialisation, where every score is near 1/32 = 0.031); K2's weights are renormalised and always sum to
#   2.827.
# * **Load.** Neither number is a verdict on the router: K2-nano's load comes from training with the bias, the
#   random model's (one expert takes several times its share) from random weights that no balancing ever
#   touched. DeepSeek-V2 balanced its softmax router with auxiliary losses (expert-, device- and
#   communication-level; DeepSeek-V2 report, arXiv 2405.04434, section 2.2), not with a bias.
#
# The figure puts the last token's scores from both routers on one axis, sorted, with the chosen experts filled.

# %% tags=["nbval-ignore-output"]
import plotly.graph_objects as go

fig = go.Figure()
for name, p in probes.items():
    order = p["scores"][-1].argsort(descending=True)  # [E] experts by score
    chosen = torch.isin(order, p["topk_idx"][-1])
    fig.add_scatter(x=list(range(1, len(order) + 1)), y=p["scores"][-1, order].tolist(), mode="markers+lines",
                    name=name, marker=dict(size=[10 if c else 5 for c in chosen.tolist()],
                                           symbol=["circle" if c else "circle-open" for c in chosen.tolist()]))
E = softmax_cfg.n_routed_experts
fig.add_scatter(x=[1, E], y=[1 / E, 1 / E], mode="lines", line=dict(dash="dot", color="grey"), name="1/E (uniform)")
fig.update_layout(title=f"Last token's router scores, sorted (filled: chosen), {tokens[-1]!r}",
                  xaxis_title="rank of the expert", yaxis_title="score s (log axis)", yaxis_type="log", height=420,
                  yaxis_tickvals=[0.02, 0.05, 0.1, 0.2, 0.5, 1], template="plotly_white")
fig

# %% [markdown]
# On a log axis: K2-nano's sigmoid scores spread over a factor of about 20. Its filled points are the experts the
# router chose, and they are not the four highest scores: the fourth is the fifth by s (expert 30, s = 0.224,
# chosen over expert 24's 0.245), because the bias, which this figure does not draw, picks among close scores. The
# random softmax router's scores all sit near 1/E: at initialisation its logits are tiny, so softmax is almost
# uniform and the choice is almost arbitrary; training is what would pull them apart.

# %% [markdown]
# ## Only the spread of the bias matters
#
# Adding the same number c to every expert's bias adds c to every choice score, which cannot change their order,
# so top-k picks the same experts; and the weights never contain the bias. Only the *differences* between the
# biases matter:

# %%
# NBVAL_CHECK_OUTPUT
from k2lab.analysis.interventions import edit_bias

for c in (-1.0, 0.5, 3.0):
    print(f"c = {c:+.1f}: same top-k for this token: {torch.equal((choice + c).topk(gate.top_k).indices, idx)}")
tr = routing.trace(model, ids)
with edit_bias(model, {i: (lambda b: b + 1.0) for i in tr.layers}):  # every MoE layer, every token
    shifted_trace = routing.trace(model, ids)
print("bias + 1 in every layer: same experts for every token:", torch.equal(shifted_trace.indices, tr.indices),
      "| same weights:", torch.allclose(shifted_trace.weights, tr.weights))

# %% [markdown]
# K2-nano's biases drifted during training (the balancing rule in [10](10_training.ipynb) moves every bias by ±u,
# which need not sum to zero), but that drift is invisible to the router: what routes tokens is their spread.

# %%
for i in tr.layers:
    b = model.layers[i].mlp.gate.e_score_correction_bias
    print(f"layer {i}: bias mean {b.mean().item():+.3f} (irrelevant), spread max - min {(b.max() - b.min()).item():.3f}, "
          f"std {b.std().item():.3f}")

# %% [markdown]
# ## Bias flips
#
# A **[flip](GLOSSARY.md#bias-flip)** is a token whose chosen *set* of experts would differ without the bias.
# `routing.trace` records the unbiased choice too (the same rule, applied to s alone), so we can count flips per
# layer, and how many of the k experts the bias swapped:

# %%
flip_share = tr.bias_flips[:, 0].float().mean(-1)  # [L_moe]
swapped = torch.stack([(~(tr.indices[j, 0][..., :, None] == tr.unbiased_indices[j, 0][..., None, :]).any(-1)).sum(-1)
                       for j in range(len(tr.layers))]).float()  # [L_moe, T] experts per token the bias replaced
s_sorted = tr.scores[:, 0].sort(-1, descending=True).values  # [L_moe, T, E]
k = gate.top_k
margin = (s_sorted[..., k - 1] - s_sorted[..., k]).median(-1).values  # [L_moe] gap at the k-th place
for j, i in enumerate(tr.layers):
    b = model.layers[i].mlp.gate.e_score_correction_bias
    print(f"layer {i}: {tr.flip_counts[j].item():>3} of {ids.shape[1]} tokens flipped ({flip_share[j]:.0%}), "
          f"{swapped[j].mean().item():.1f} of {k} experts swapped on average; bias std {b.std().item():.3f} "
          f"against a median gap of {margin[j].item():.3f} between the k-th and (k+1)-th score")
place = tr.scores[:, 0].argsort(-1, descending=True).argsort(-1)  # [L_moe, T, E] each expert's place by s, 0 = best
dropped = ~(tr.unbiased_indices[:, 0][..., :, None] == tr.indices[:, 0][..., None, :]).any(-1)  # [L_moe, T, k]
print(f"experts the bias dropped, counted by their place among the affinities s (places 1 to {k}, 1 = highest s):")
for j, i in enumerate(tr.layers):
    places = place[j].gather(-1, tr.unbiased_indices[j, 0])[dropped[j]]  # places (0 to k - 1) of the dropped
    print(f"layer {i}: {torch.bincount(places, minlength=k).tolist()}")

# %% tags=["nbval-ignore-output"]
viz.bias_flip_figure(flip_share, tr.layers)

# %% [markdown]
# How to read this: a flip needs only one of the k experts to change, and the bias changes the choice wherever
# its differences exceed the gap between the last chosen and the first unchosen affinity. In K2-nano the biases'
# spread (their std) is 1.8 to 3.8 times the typical gap at the k-th place, so in layers 1 to 3 three tokens in four
# have an expert swapped: usually one in layers 2 and 3, in layer 1 more often two. Which places does it take?
# The last count above: of the 191 experts the bias dropped on this prompt, 101 held the 4th place by affinity,
# 62 the 3rd, 26 the 2nd and 2 the 1st; in layer 1 the 3rd place lost slightly more often than the 4th. Layers
# 4 and 5 have smaller bias spreads, about half their tokens flip, and what they lose is mostly the 4th place.
# So the bias decides the *lower* places of the k, not only the last, and almost never the first (these counts
# come from one prompt of 44 tokens). Without it the load would be far less even (next section).
#
# ## What the bias buys
#
# Route a batch of held-out code with the trained bias, then with every bias set to zero, and compare the load
# balance ([MaxVio](GLOSSARY.md#maxvio), 0 = perfectly even) with the change in the language-model loss (in
# [nats](GLOSSARY.md#nats) per token):

# %%
import torch.nn.functional as F

from k2lab.training import corpus

code = tok.encode(corpus.corpus_text("heldout", "code"), allow_special=False)[: 8 * 129]
batch = torch.tensor(code, device=model.device).view(8, 129)  # [B, T + 1]: inputs and next-token targets


def balance_and_loss(bias_edit=None) -> tuple[torch.Tensor, float]:
    """MaxVio per MoE layer [L_moe] and the mean next-token loss (nats) on the batch, under a bias edit."""
    with edit_bias(model, bias_edit or {}):
        logits, routing_cache = model.run_with_cache(batch[:, :-1], names=".mlp.gate.hook_topk_idx")
    _, chosen = routing_cache.stack_present("hook_topk_idx")  # [L_moe, B, T, k]: the MoE layers' rows
    counts = torch.stack([torch.bincount(c.flatten(), minlength=model.config.n_routed_experts) for c in chosen])
    return routing.max_violation(counts), F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


vio_with, loss_with = balance_and_loss()
vio_without, loss_without = balance_and_loss({i: 0.0 for i in tr.layers})
for i, a, b in zip(tr.layers, vio_with.tolist(), vio_without.tolist(), strict=True):
    print(f"layer {i}: MaxVio {a:.2f} with the trained bias, {b:.2f} without")
print(f"loss: {loss_with:.3f} nats/token with the bias, {loss_without:.3f} without ({loss_without - loss_with:+.3f})")

# %% [markdown]
# With the trained bias the busiest expert of each layer gets at most about twice its fair share (MaxVio 0.61 to
# 1.01); with every bias set to zero, MaxVio rises in every layer (to 1.94 to 4.91: layer 1's busiest expert
# takes about six times its share), and the loss rises by 0.025 nats per token (4.027 to 4.053).
#
# What this measured: the effect of *removing* a trained bias at inference, on load and loss, for one batch of
# 8 × 128 tokens of held-out code, in a model whose experts were trained with that bias routing their tokens.
# Removing it changes only which experts run (the weights never contain the bias). It does not measure what
# balancing costs in training: that would need a model trained without the bias (or with a balance loss instead)
# to compare with, and none was trained here; Wang et al. (2024) report that comparison, with models trained each
# way, and it is their result, not this notebook's, that the bias balances at a smaller cost in loss than an
# auxiliary loss does. Balance matters on a real cluster, where the experts sit on
# different GPUs and the GPU that holds an overloaded expert makes the others wait.

# %% [markdown]
# ## Explorer
#
# Pick a layer and a token to see its router stages. Look for tokens where the hollow circles (the unbiased
# choice) and the filled bars disagree: those are the flips.

# %% tags=["nbval-ignore-output"]
router_logits = cache.stack_present("gate.hook_logits")[1]  # [L_moe, B, T, E]: the MoE layers' rows
viz.widgets.router_explorer(tr, tokens, logits=router_logits)

# %% [markdown]
# ## Groups
#
# DeepSeek-V3 also limits each token to the experts of its best `topk_group` of `n_group` groups: its 256 experts
# form 8 groups of 32 consecutive experts, a group is scored by the sum of its two best choice scores s + b, each
# token keeps its 4 best groups and chooses its 8 experts among their 128 only. Its report (arXiv 2412.19437, section
# 2.1.2, "node-limited routing") uses the rule to bound how many nodes a token's experts sit on, when each node holds
# a group. K2 sets `n_group = 1` (its released config; the K2 report's Table 2 says "no expert grouping"), so the limit
# does nothing; `k2lab` implements it anyway (`routing.select_experts`, `routing.allowed_experts`) for DeepSeek-V3
# checkpoints. What the sources leave unsaid: why two best scores and not one or all; neither report argues the
# choice.

# %%
# NBVAL_CHECK_OUTPUT
k2 = K2Config.kimi_k2()
print(f"K2: n_group={k2.n_group}, topk_group={k2.topk_group}, top-{k2.num_experts_per_tok} of "
      f"{k2.n_routed_experts}, routed_scaling_factor={k2.routed_scaling_factor}")
print("select_experts reproduces the router:",
      torch.equal(routing.select_experts(tr.choice_scores, gate.top_k, model.config.n_group,
                                         model.config.topk_group), tr.indices))

# %% [markdown]
# ### Exercise 2 ★★ · Write it yourself: group-limited routing
#
# `my_group_router(s, bias, top_k, n_group, topk_group)`: the experts each token chooses [N, k] (any order of the k
# slots) from its affinities s [N, E] and the correction bias [E], under DeepSeek-V3's rule above. Running the cell
# checks it (`exercises.check_group_router`, with DeepSeek-V3's own setting, 8 groups of which 4 are kept, and a
# smaller one, against `routing.select_experts`; it names the slips it knows: a group scored by its best expert or by
# all of them, groups scored without the bias, strided groups, the groups ignored) and keeps it in your module.

# %%
@lab.mine
def my_group_router(s: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """s [N, E] affinities, bias [E] -> idx [N, top_k]: top-k of s + bias among the topk_group best groups"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Two choices, both made with the choice scores s + b. First the groups: view each token's E scores as n_group rows
# of E / n_group consecutive experts, score each row by its two largest entries, keep the topk_group best rows.
# Then the experts: hide every expert outside the kept groups and take the top-k of what is left.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `choice = s + bias`; `group_score = choice.view(N, n_group, -1).topk(2, dim=-1).values.sum(-1)` [N, G];
# `keep = group_score.topk(topk_group, dim=-1).indices`; a [N, G] boolean mask with `scatter_` (or `torch.zeros(...)
# .scatter(1, keep, True)`), expanded to [N, E] with `repeat_interleave(E // n_group, dim=-1)`; then
# `choice.masked_fill(~mask, -torch.inf).topk(top_k, dim=-1).indices`.

# %% [markdown] tags=["solution"]
# The groups first, from the sum of each group's two best choice scores, then the top-k among the kept groups'
# experts. On a DeepSeek-V3-shaped router (random affinities and bias) the limit changes the choice of most tokens:

# %% tags=["solution"]
# Solution (click to show)
def solution_group_router(s: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                          topk_group: int) -> torch.Tensor:
    choice = s + bias  # [N, E]
    N, E = choice.shape
    group_score = choice.view(N, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # [N, G]
    keep = group_score.topk(topk_group, dim=-1).indices  # [N, topk_group]
    allowed = torch.zeros(N, n_group, dtype=torch.bool).scatter(1, keep, True)  # [N, G]
    allowed = allowed.repeat_interleave(E // n_group, dim=-1)  # [N, E]: each group's consecutive experts
    return choice.masked_fill(~allowed, -torch.inf).topk(top_k, dim=-1).indices  # [N, k]


print(exercises.check_group_router(solution_group_router))
v3_gen = torch.Generator().manual_seed(0)
v3_s, v3_bias = torch.rand(1000, 256, generator=v3_gen), (torch.rand(256, generator=v3_gen) - 0.5) * 0.1
limited = solution_group_router(v3_s, v3_bias, 8, 8, 4)
free = (v3_s + v3_bias).topk(8, dim=-1).indices
changed = (limited.sort(-1).values != free.sort(-1).values).any(-1).float().mean().item()
print(f"DeepSeek-V3's shape, random scores: the 4-of-8-groups limit changes the experts of {changed:.0%} of tokens")

# %% [markdown]
# ## More exercises
#
# ### Exercise 3 ★ · Predict, then run: one expert's bias
#
# Raise one expert's bias in the last MoE layer by +1.0 (with `edit_bias`). What share of the prompt's tokens will
# choose it? Predict from the table of steps 1–3 (the sizes of s and of the other biases), then count with
# `routing.trace`.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# A choice score is s + b with s in (0, 1): how far can the other experts' scores reach, and where does +1 put this
# one?

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Inside `with edit_bias(model, {layer: lambda b: ...})`, take
# `routing.trace(model, ids)` and test `(trace.indices[trace.row(layer), 0] == expert).any(-1)` for each token.

# %% [markdown] tags=["solution"]
# Every token chooses it. Sigmoid scores lie in (0, 1) and the other biases of this layer differ by at most 0.21, so
# +1 lifts the expert's choice score above every other expert's for every token. Its *weight* still comes from its
# own affinity, which is what the renormalised weights are made of; so the token now spends one of its four slots on
# an expert that may not suit it.

# %% tags=["solution"]
# Solution (click to show)
target = int(tr.indices[tr.row(layer), 0, -1, -1])  # any expert will do; here the last token's k-th choice
with edit_bias(model, {layer: lambda b: b.index_add(0, torch.tensor([target], device=b.device), b.new_ones(1))}):
    boosted = routing.trace(model, ids)
share = (boosted.indices[boosted.row(layer), 0] == target).any(-1).float().mean().item()
print(f"expert {target} at layer {layer}: chosen by {share:.0%} of tokens (before: "
      f"{(tr.indices[tr.row(layer), 0] == target).any(-1).float().mean().item():.0%})")

# %% [markdown]
# ### Exercise 4 ★★ · Change a knob: half and double the bias
#
# Scale every MoE layer's bias by 0.5 and by 2 (`edit_bias(model, {i: lambda b: 0.5 * b for i in tr.layers})`) and
# measure MaxVio and the loss with `balance_and_loss`. Predict the direction of each before you run. Is doubling
# the bias twice as good for balance?

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Only the spread of the bias matters, and the trained spread is where the balancing rule stopped moving it. What does
# a smaller spread give back to the affinities, and what does a larger one take from them?

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `balance_and_loss({i: (lambda b, f=factor: f * b) for i in tr.layers})` for `factor in (0.5, 2.0)`, beside
# `vio_with, loss_with` (the trained bias) and `loss_without` (no bias).

# %% [markdown] tags=["solution"]
# Neither helps. Halving the bias gives the affinities more say and the load drifts back towards the busy experts:
# MaxVio rises in every layer (to 0.95 to 2.14, from 0.61 to 1.01) while the loss barely moves (4.032 against
# 4.027). Doubling it overshoots: the experts that were idle without the bias now get too many tokens, MaxVio rises
# too (1.46 to 2.64), and the loss rises by 0.054 nats per token, twice as much as removing the bias altogether
# (+0.025). The trained bias sits where the balancing rule stopped moving it, the spread that evens the load
# without overruling the affinities.

# %% tags=["solution"]
# Solution (click to show)
for factor in (0.5, 2.0):
    vio, loss = balance_and_loss({i: (lambda b, f=factor: f * b) for i in tr.layers})
    print(f"bias x {factor}: MaxVio {[round(v, 2) for v in vio.tolist()]}, loss {loss:.3f} "
          f"(trained bias: {[round(v, 2) for v in vio_with.tolist()]}, {loss_with:.3f}; "
          f"no bias: {loss_without:.3f})")
