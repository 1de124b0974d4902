# %% [markdown]
# # 05 · Expert load and specialisation
#
# One token tells little about experts; thousands tell a lot. This notebook routes a few thousand tokens of
# held-out text (Python code, and prose from Python's language reference, neither seen in training) and measures
# what `k2lab.routing` offers. Notation: N tokens, E experts, k chosen per token, S_t the set token t chose,
# c_e the number of tokens whose set holds expert e.
#
# | metric | formula | balanced / random value |
# | --- | --- | --- |
# | relative load | c_e / mean(c) | 1 |
# | MaxVio | max_e c_e / mean(c) − 1 | 0 |
# | domain specialisation (OLMoE) | share of a domain's tokens routed to e: c_e(D) / N(D) | k / E |
# | vocabulary specialisation (OLMoE) | share of token id x's occurrences routed to e: N_e(x) / N(x) | |
# | co-activation (OLMoE) | C(i → j) = N(i and j) / N(i) | (k − 1) / (E − 1) |
# | consecutive overlap | share of neighbours t, t+1 with S_t ∩ S_t+1 ≠ ∅ | 1 − C(E−k, k) / C(E, k) |
# | router entropy | −Σ p ln p, p = s / Σ s | at most ln E |
#
# *Sources.* MaxVio is the measure of Wang et al. (2024), "Auxiliary-Loss-Free Load Balancing Strategy for
# Mixture-of-Experts" (arXiv 2408.15664), the paper the correction bias comes from; domain and vocabulary
# specialisation and co-activation are OLMoE's (Muennighoff et al., 2024, arXiv 2409.02060, section 5). The K2
# figures used below (384 experts, 8 per token) are the released `config.json`'s. The K2 report publishes no
# routing statistics of this kind, so everything measured here is K2-nano's, a 32-expert model trained on Python's
# standard library: it shows how to read the metrics, not how K2's experts specialise.

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings)
print(about)

# %% [markdown]
# ## The text
#
# Sixteen windows of 128 tokens from each domain, as two batches.

# %%
# NBVAL_CHECK_OUTPUT
import torch

from k2lab import routing

from k2lab.training import corpus

ROWS, LENGTH = 16, 128


def windows(kind: str) -> torch.Tensor:
    """ROWS x LENGTH tokens of held-out text of one kind, as a batch [B, T]."""
    ids = tok.encode(corpus.corpus_text("heldout", kind), allow_special=False)
    return torch.tensor(ids[: ROWS * LENGTH], device=model.device).view(ROWS, LENGTH)


batches = {"code": windows("code"), "prose": windows("prose")}
traces, predicted = {}, {}
for name, batch in batches.items():
    logits, cache = model.run_with_cache(batch, names=".mlp.gate.")
    traces[name] = routing.RoutingTrace.from_cache(cache)  # [L_moe, B, T, ...]
    predicted[name] = logits.argmax(-1)  # [B, T] the model's guess for the next token
layers = traces["code"].layers
E, k = model.config.n_routed_experts, model.config.num_experts_per_tok
print({name: list(batch.shape) for name, batch in batches.items()},
      f"MoE layers {layers}, top-{k} of {E}")

# %% [markdown]
# ## Load
#
# K2-nano's experts were balanced during training by DeepSeek-V3's correction-bias rule ([04a](04a_router.ipynb),
# [10](10_training.ipynb)). How even is the result on text it never saw? Count, for each MoE layer and expert, the
# tokens whose k chosen experts include it, and summarise each layer by one number: how far the busiest expert is
# above the mean load. That is [MaxVio](GLOSSARY.md#maxvio), 0 when every expert gets the same number of tokens.
#
# ### Exercise 1 ★ · Write it yourself: MaxVio
#
# From expert counts [L, E], one value per layer: the busiest expert's load over the mean load, minus 1. Running the
# cell checks it and keeps it in your module: `exercises.check_max_violation` feeds it loads whose mean and maximum make the usual slips differ (a forgotten − 1, a percentage, the total
# instead of the mean, a spread such as (max − min) / mean, the wrong axis).

# %%
from k2lab.lab import exercises


@lab.mine
def my_max_violation(counts: torch.Tensor) -> torch.Tensor:
    """counts [L, E] (integers) -> MaxVio [L]"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# One number per layer, over its experts: how many times its fair share the busiest expert got, minus one so that an
# even load gives 0.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Reduce over the last axis (the experts): `counts.amax(-1)` and `counts.mean(-1)`. The counts are integers, and
# `mean` refuses integer tensors: convert them to floating point first.

# %% [markdown] tags=["solution"]
# Work in floating point (the mean of integers is not an integer) and reduce over the experts:

# %% tags=["solution"]
# Solution (click to show)
def solution_max_violation(counts: torch.Tensor) -> torch.Tensor:
    c = counts.double()
    return c.amax(-1) / c.mean(-1) - 1


print(exercises.check_max_violation(solution_max_violation))

# %% [markdown]
# `my_max_violation` from your module (yours if it passed its check, else `routing.max_violation`; the first lines
# say which) on the held-out counts (code and prose together, 4,096 tokens), beside the extremes of each layer.
# The heatmap then shows every expert's load against the uniform share (blue: under-used, red: over-used, on a
# colour range fitted to the data; grey: idle, no tokens at all), with MaxVio in the bars beside it.

# %%
mine = lab.mine.load("my_max_violation")
counts = routing.expert_counts(traces["code"]) + routing.expert_counts(traces["prose"])  # [L_moe, E]
max_vio = mine.my_max_violation(counts)  # [L_moe]
for layer, vio, c in zip(layers, max_vio.tolist(), counts.tolist(), strict=True):
    print(f"layer {layer}: MaxVio {vio:.2f}  (busiest expert {max(c)} tokens, idlest {min(c)}, "
          f"mean {sum(c) / E:.0f})")
print("equal to routing.max_violation:", torch.allclose(max_vio.float(), routing.max_violation(counts)))

# %% tags=["nbval-ignore-output"]
from k2lab import viz

viz.load_figure(routing.relative_load(counts), layers, title="Expert load on held-out code and prose")

# %% [markdown]
# ## Domain specialisation: code against prose
#
# OLMoE's measure: the share of a domain's tokens that go to each expert. If experts did not care about the
# domain, the two bars of each expert would match. Experts are sorted from the most code-leaning to the most
# prose-leaning.

# %%
last = layers[-1]
share = {name: routing.domain_specialization(tr)[tr.row(last)]  # {domain: [E]}
         for name, tr in traces.items()}
lean = share["code"] - share["prose"]
print(f"layer {last}: most code-leaning experts {lean.argsort(descending=True)[:3].tolist()}, "
      f"most prose-leaning {lean.argsort()[:3].tolist()}")

# %% tags=["nbval-ignore-output"]
viz.specialization_figure(share, uniform=k / E,
                          title=f"Layer {last}: share of each domain's tokens per expert")

# %% [markdown]
# ## Vocabulary specialisation
#
# Does an expert take particular *token ids*? For each id x seen at least 10 times and each expert e, OLMoE
# measures N_e(x) / N(x), the share of x's occurrences whose first choice was e, and averages its maximum over the
# ids. Using the *input* ids asks whether experts specialise in what they read; using the model's *predicted*
# next ids asks whether they specialise in what comes next (OLMoE found the later layers lean towards the
# output).

# %% [markdown]
# Even random routing gives a maximum share above 1/E to an id seen only ten or twenty times, so we add a
# control: the same routing shuffled across positions, which keeps every expert's load but breaks any link to
# the token.

# %%
import dataclasses

tr = traces["code"]
perm = torch.randperm(ROWS * LENGTH, generator=torch.Generator().manual_seed(0))
shuffled = dataclasses.replace(tr, indices=tr.indices.flatten(1, 2)[:, perm].view_as(tr.indices))
vocab_in = routing.vocabulary_specialization(tr, batches["code"])  # per (layer, id, expert)
summary = {
    "input ids": vocab_in.mean_max(),  # [L_moe]
    "predicted ids": routing.vocabulary_specialization(tr, predicted["code"]).mean_max(),
    "input ids, shuffled routing":
        routing.vocabulary_specialization(shuffled, batches["code"]).mean_max(),
}
for name, values in summary.items():
    print(f"{name:<28}", " ".join(f"{v:.2f}" for v in values.tolist()))

# %% tags=["nbval-ignore-output"]
viz.layer_bars_figure(summary, layers, "mean of max_e N_e(x) / N(x)",
                      title="Vocabulary specialisation on code (first choice, ids seen ≥ 10 times)")

# %% [markdown]
# Which tokens does one expert take? Here is the expert that took the largest share of code tokens in the last
# layer, with the ids it is most specialised in:

# %%
expert = int(share["code"].argmax())
print(f"layer {last}, expert {expert}: token, share of its occurrences, occurrences")
for token_id, ratio, n in vocab_in.top_tokens(last, expert, n=8):
    print(f"  {tok.id_to_piece(token_id)!r:<14} {ratio:5.0%}  {n:>4}")

# %% [markdown]
# ## Co-activation
#
# Which experts are chosen together? C(i → j) is the share of the tokens that chose expert i which also chose j.
# It is not symmetric: a busy expert j joins many of a rare expert i's tokens. Uniform random routing would give
# (k − 1)/(E − 1) everywhere.

# %%
co = routing.coactivation(traces["code"])[traces["code"].row(last)]  # [E, E]
i, j = divmod(int(co.argmax()), E)
print(f"layer {last}: strongest pair {i} -> {j}: {co[i, j].item():.0%} of expert {i}'s tokens "
      f"also chose {j} (random: {(k - 1) / (E - 1):.0%})")

# %% tags=["nbval-ignore-output"]
viz.coactivation_figure(co, title=f"Layer {last}: co-activation on code, C(i → j)")

# %% [markdown]
# ## Neighbouring tokens
#
# Do consecutive tokens share experts more than chance? If each token drew its k experts at random, two
# neighbours would share at least one with probability 1 − C(E − k, k)/C(E, k): 43% for K2-nano's 4 of 32, 16%
# for K2's 8 of 384.

# %%
baseline = routing.consecutive_baseline(E, k)
rates = {name: routing.consecutive_same_expert_rate(tr)  # {domain: [L_moe]}
         for name, tr in traces.items()}
print(f"random baseline {baseline:.1%}")
for name, rate in rates.items():
    print(f"{name:<6}", " ".join(f"{r:.0%}" for r in rate.tolist()))

# %% tags=["nbval-ignore-output"]
viz.layer_bars_figure(rates, layers, "neighbours sharing an expert (%)", reference=baseline,
                      reference_label="random routing", percent=True,
                      title="Consecutive tokens that share at least one expert")

# %% [markdown]
# ## Router entropy
#
# How sharp are the router's preferences? Two views, each as a share of its maximum:
#
# * over the affinities, p = s / Σ s across all E experts (maximum ln E): how much the router singles out some
#   experts *before* the bias and the top-k cut. Sigmoid affinities are each in (0, 1) and judged independently,
#   so this stays close to its maximum: the selection happens in the cut, not in a peaked distribution;
# * over the chosen experts' weights, p = w / Σ w (maximum ln k): how evenly a token spreads over the k experts it
#   uses.

# %% tags=["nbval-ignore-output"]
import math

entropies = {  # nats, [L_moe, B, T]
    "affinities s (max ln E)": routing.router_entropy(traces["code"], over="scores"),
    "chosen weights w (max ln k)": routing.router_entropy(traces["code"], over="weights"),
}
maxima = dict(zip(entropies, [math.log(E), math.log(k)], strict=True))
viz.entropy_figure(entropies, maxima, layers, title="Router entropy per token on code")

# %% [markdown]
# ## More exercises
#
# ### Exercise 2 ★ · Predict, then run: MaxVio's range
#
# What is MaxVio for loads [10, 10, 10, 10]? For [40, 0, 0, 0]? For E experts with all tokens on one? Predict, then
# run `routing.max_violation(torch.tensor([...]))` (or your own).

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Balanced means every expert at the mean. At the other extreme, how many times the mean is the one busy expert's
# load?

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `routing.max_violation(torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0]]))`; for the general case, all N tokens on
# one of E experts: the maximum is N and the mean is N / E.

# %% [markdown] tags=["solution"]
# 0 when balanced; with everything on one of E experts, max / mean = E, so MaxVio = E − 1 (3 for four experts, 383
# for K2's 384). So MaxVio is not bounded by 1: a value of 1.5 means the busiest expert has 2.5 times its share.

# %% tags=["solution"]
# Solution (click to show)
print(routing.max_violation(torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0]])).tolist())

# %% [markdown]
# ### Exercise 3 ★★ · Change a knob: the first choice alone
#
# Count only each token's *first* choice: `routing.expert_counts(tr, top=1)`. Predict first: is the first choice
# more or less balanced than all k choices together? Then think about what the balancing rule of training looks at.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# The balancing rule counts a token for each of its k experts, whichever slot the expert fills. Does anything in it
# look at the first slot alone?

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Sum `routing.expert_counts(t, top=1)` over the two traces and compare its MaxVio with that of `counts`. For the
# why: the rule ([10](10_training.ipynb)) moves expert e's bias by the sign of mean(c) − c_e, and c_e counts a
# token whichever of its k slots e fills.

# %% [markdown] tags=["solution"]
# Less balanced. The balancing rule of training ([10](10_training.ipynb)) pushes towards equal c_e, the number of
# tokens with expert e among their k choices (all k slots counted alike); it never looks at which slot an expert
# fills, so nothing evens out the first choices. The bias does move some of them, since the first choice is the top
# of s + b: in K2-nano it changes 9–25% of first choices, depending on the layer, against 45–90% of the chosen
# sets. The first choices stay far less even than all k together: MaxVio 2.5 to 4.0 against 0.4 to 1.5 (the
# printed values are K2-nano's answer).

# %% tags=["solution"]
# Solution (click to show)
first = sum(routing.expert_counts(t, top=1) for t in traces.values())
print("all k choices:", [round(v, 2) for v in routing.max_violation(counts).tolist()])
print("first choice: ", [round(v, 2) for v in routing.max_violation(first).tolist()])
for name, t in traces.items():  # share of tokens whose first choice differs from the one without the bias
    moved = (t.indices[..., 0] != t.unbiased_indices[..., 0]).float().flatten(1).mean(-1)  # [L_moe]
    print(f"{name}: first choice changed by the bias", [f"{v:.0%}" for v in moved.tolist()],
          "| chosen set changed", [f"{v:.0%}" for v in t.bias_flips.float().flatten(1).mean(-1).tolist()])
