# %% [markdown]
# # 11 · Features and experts
#
# A mixture of experts invites a question: are experts units of meaning? Does an expert hold a set of the things the
# model represents, or does each of those things spread over many experts? To ask it we need the *things*, and
# neurons are a poor answer: one direction of the residual stream mixes many unrelated meanings. **Sparse
# dictionaries** are the field's answer. A sparse autoencoder (SAE) rewrites an activation x [D] as a few active
# **features** out of many:
#
# $$f = \mathrm{TopK}_k\big(\mathrm{ReLU}((x - b_{dec}) W_{enc} + b_{enc})\big) \in \mathbb{R}^{F}, \qquad \hat{x} = f\, W_{dec} + b_{dec},$$
#
# with F much larger than D and only k features non-zero per token (the TopK SAE of Gao et al., 2024). Each row of
# W_dec is a feature's direction; a feature is *active* on a token when f > 0. A **transcoder** does the same but
# maps a block's input to its feed-forward's output: here the MoE's input (the normalised residual stream, which is
# also exactly what the router reads) to the MoE's output. Its features are then the pieces the MoE's output is made
# of, and we can hold them against the router's decisions.
#
# | tool | what it does |
# | --- | --- |
# | `interventions.splice(model, probe, dictionary, keep_error=)` | computes through the dictionary; its features become the probe `<probe>.hook_features` |
# | `analysis.dictionary.train_sae`, `train_transcoder`, `evaluate` | trains on activations streamed over a corpus; FVU, L0, dead features, CE recovered |
# | `analysis.features.trace_features` | the features and every MoE layer's routing of the same tokens |
# | `features.purity`, `features.information`, `features.expert_attribution` | features against experts, each against a baseline |

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
model, tok = lab.load_nano()  # the shipped dictionaries were trained on K2-nano's activations
print(lab.describe(model, "K2-nano (bundled)"))

# %%
import torch

from k2lab import interventions, routing, viz
from k2lab.analysis import dictionary, features
from k2lab.training import corpus

heldout = [doc.text for doc in corpus.documents("heldout")]  # never trained on, by the model or the dictionaries
print(f"{len(heldout)} held-out documents (standard-library code and reference prose)")

# %% [markdown]
# ## The shipped dictionaries
#
# k2lab ships dictionaries trained on K2-nano's training corpus (`python scripts/train_dictionaries.py`; the cell
# below lists them). This notebook reads two: an SAE of the residual stream after the middle block
# (`layers.3.hook_resid_post`, 1,024 features, k = 32) and a transcoder of that block's MoE (2,048 features,
# k = 32); the transcoders of the other blocks serve notebook 12's circuits. Their held-out scores are stored in
# their configs. The field reports:
#
# * **FVU**, the fraction of variance unexplained: |x − x̂|² / |x − mean x|², 0 is perfect;
# * **L0**, the active features per token (k for a TopK dictionary, fewer when some of the top k are ≤ 0);
# * **dead** features, never active on the held-out text;
# * **CE recovered**: splice the reconstruction in place of the activation and measure the next-token loss, against
#   the clean model (100%) and against zero-ablating the activation (0%).

# %%
# NBVAL_CHECK_OUTPUT
print(dictionary.shipped())
sae = dictionary.load_shipped("sae_nano_l3_resid_post")
transcoder = dictionary.load_shipped("transcoder_nano_l3_moe")
for d in (sae, transcoder):
    m = d.metadata["k2lab_heldout"]
    print(f"{type(d).__name__:<10} {d.d_sae:>5} features, k={d.k}: FVU {m['fvu']:.2f}, L0 {m['mean_l0']:.1f}, "
          f"dead {m['dead_fraction']:.1%}, CE recovered {m['ce_recovered']:.1%} (clean {m['ce_clean']:.3f}, "
          f"spliced {m['ce_spliced']:.3f}, zero-ablated {m['ce_zero']:.3f} nats)")

# %% [markdown]
# Both pass the goals set for them (FVU ≤ 0.2, CE recovered ≥ 85%, dead ≤ 10%), but read the transcoder's CE
# recovered with care: zero-ablating layer 3's whole MoE costs K2-nano only 0.10 nats, so 97% is measured over a
# small gap. The plainer figure is the cost of splicing it in: 0.003 nats. The SAE's gap is large (zeroing the
# residual stream is ruinous), and it costs 0.18 nats.
#
# ## Splicing
#
# `splice` replaces the probe's activation by the reconstruction. With `keep_error=True` it adds back the error
# x − x̂, so the forward is the model's own while the features are visible, and editing a feature moves the
# activation by exactly that feature's term. **Predict**: with `keep_error=True`, by how much do the logits move?

# %%
# NBVAL_CHECK_OUTPUT
ids = model.to_tokens(lab.PROMPT)  # [1, T]
clean_logits = model(ids)
with interventions.splice(model, sae.probe, sae, keep_error=True) as sae_features:
    kept_logits, cache = model.run_with_cache(ids, names=sae_features.name)
f = cache[sae_features.name]  # [1, T, 1024] feature activations
print(f"features probe {sae_features.name}: {list(f.shape)}, active per token {(f > 0).sum(-1).float().mean():.0f}")
print(f"keep_error=True: max |change in logits| <= 1e-6: {(kept_logits - clean_logits).abs().max().item() <= 1e-6}")
with interventions.splice(model, sae.probe, sae):
    spliced_logits = model(ids)
top = lambda logits: tok.id_to_piece(int(logits[0, -1].argmax()))  # noqa: E731
print(f"without the error term: last prediction {top(spliced_logits)!r} (clean {top(clean_logits)!r})")

# %% [markdown]
# The features probe is an ordinary probe inside the block: `run_with_cache`, `model.hooks`,
# `interventions.patch` and nnsight read and edit it by name, so everything [07](07_interventions.ipynb) did to
# activations can now be done to features.
#
# ## Train one yourself
#
# Training streams activations over the corpus and fits the dictionary on the CPU (Adam, decoder rows kept at unit
# norm, an auxiliary loss that revives dead features). A small SAE, 256 features with k = 16, on 200,000 tokens,
# takes well under a minute. **Predict**: will it reconstruct better or worse than the shipped one, and by how much?

# %% tags=["nbval-ignore-output"]
import random
import time

train_texts = [doc.text for doc in corpus.documents("train")]
random.Random(0).shuffle(train_texts)  # the corpus comes in module order: mix it
start = time.perf_counter()
small_sae = dictionary.train_sae(model, "layers.3.hook_resid_post", train_texts, d_sae=256, k=16, tokens=200_000,
                                 batch_tokens=1024, lr=3e-3, buffer_tokens=65_536, progress=False)
print(f"trained in {time.perf_counter() - start:.0f} s")
for name, d in (("small", small_sae), ("shipped", sae)):
    print(f"{name:<8}", dictionary.evaluate(model, d.probe, d, heldout, max_tokens=8_000))

# %% [markdown]
# Fewer features, fewer active per token and a fifth of the tokens: the small one leaves about 0.3 of the variance
# against 0.11, and costs about 0.7 nats against 0.16 when spliced. Reconstruction buys features, and features
# are what we want to read.
#
# ## Features by their top tokens
#
# `trace_features` runs texts with the dictionary spliced in (error kept, so the routing is the model's own) and
# records the features and every MoE layer's routing of the same tokens. A feature is read by the contexts that
# activate it most. Start from tokens: which feature responds most to ` [`, and what else does it fire on?

# %%
sae_trace = features.trace_features(model, sae, heldout, max_len=384, progress=False)
print(f"{sae_trace.features.shape[0]} texts, {len(sae_trace.active())} tokens, "
      f"{sae_trace.features.shape[-1]} features")


def feature_for(piece: str, ft: features.FeatureTrace) -> int:
    """The feature with the largest mean activation on the token ``piece``."""
    on_token = ft.tokens() == tok.encode(piece)[0]  # [N]
    return int(ft.features[ft.routing.real_tokens()][on_token].mean(0).argmax())


for piece in (" [", " return", "'"):
    i = feature_for(piece, sae_trace)
    print(f"\n{piece!r}: feature {i}")
    for context in sae_trace.top_contexts(i, tok.decode, n=4):
        print("   ", repr(context[-40:]))

# %% [markdown]
# The ` [` feature is tied to its token. The ` return` feature is wider: *Return*, *Returns* and *returned*, in
# docstrings and prose alike, one idea over several tokens. The quote's feature turns out to be about closing: a
# closing quote or parenthesis ends an expression. Some features are tokens, some are ideas; hold that thought, since
# most of what follows asks how much of the link between features and experts is only the token.
#
# ## Purity: do a feature's tokens go to one expert?
#
# For each feature, count where its active tokens were routed. **Purity** is the share of them that chose its most
# frequent expert: 1 if every one went there. A rare feature or a busy expert scores high by chance, so two
# baselines: the routing shuffled across all tokens (each expert keeps its load, each feature its count, the link is
# cut), and shuffled only among tokens of the same id (the link through the token itself is kept).
#
# The transcoder of layer 3 reads exactly the vector layer 3's router reads. **Predict**: its features' mean purity
# at layer 3, against the baselines.

# %%
# NBVAL_CHECK_OUTPUT
moe_trace = features.trace_features(model, transcoder, heldout, max_len=384, progress=False)
layer = 3
active, tokens = moe_trace.active(), moe_trace.tokens()
pure = features.purity(active, moe_trace.chosen(layer))
pure_within = features.purity(active, moe_trace.chosen(layer), within=tokens)
frequent = pure.active >= 50  # rarer features are pure by chance
print(f"layer {layer}, transcoder features active on 50 tokens or more:")
print(f"  mean purity {pure.purity[frequent].mean():.2f}; routing shuffled {pure.baseline[frequent].mean():.2f}; "
      f"shuffled within token ids {pure_within.baseline[frequent].mean():.2f}")

# %% tags=["nbval-ignore-output"]
viz.purity_figure({"purity": pure.purity[frequent], "routing shuffled": pure.baseline[frequent],
                   "shuffled within token ids": pure_within.baseline[frequent]},
                  title=f"Layer {layer}: the purity of {int(frequent.sum()):,} transcoder features (those on ≥ 50 "
                        "tokens) against the routing")

# %% [markdown]
# Features are far purer than chance (0.80 against 0.30): a typical feature sends four of five tokens to one expert.
# But shuffling only among tokens of the same id keeps most of it (0.73): in K2-nano, routing is largely decided by
# the token, and so are many features. What is left, 0.07, is the part of "this feature goes to that expert" that is
# not "both like this token". (A token seen once cannot move in that shuffle, so the within-token baseline errs
# high, and the remainder is a lower bound.)
#
# The purest features, each with the expert distribution of its tokens and its top context:

# %%
purest = pure.purest(n=10, min_active=50)
for i, expert, p, base, n in purest[:5]:
    print(f"feature {i:>4}: {p:.2f} of its {n} tokens to expert {expert} (chance {base:.2f}); "
          f"{moe_trace.top_contexts(i, tok.decode, n=1, before=4)[0]!r}")

# %% tags=["nbval-ignore-output"]
labels = [f"{i}: {moe_trace.top_contexts(i, tok.decode, n=1, before=2)[0][-14:]!r}" for i, *_ in purest]
viz.expert_share_heatmap(pure.distribution[[i for i, *_ in purest]], labels,
                         title=f"Where the purest transcoder features' tokens go at layer {layer}")

# %% [markdown]
# ### Exercise 1 ★★ · Write it yourself: purity
#
# Given which tokens one feature is active on and the experts every token chose, return the share of the feature's
# tokens that chose its most frequent expert. Running the cell checks it (`exercises.check_feature_purity`, against
# `features.purity`; it names the slips it knows, such as dividing by every token, or by the k choices) and keeps it
# in your module.

# %%
from k2lab.lab import exercises


@lab.mine
def my_purity(active: torch.Tensor, chosen: torch.Tensor) -> float:
    """active [N] bool, chosen [N, E] bool (k True per row) -> the feature's purity"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Keep only the feature's tokens; count, for each expert, how many of them chose it; the largest count, over the
# number of the feature's tokens, is the purity.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `chosen[active]` is [n, E]; `.sum(0)` counts per expert; divide `.max()` by `active.sum()` and return a float.

# %% [markdown] tags=["solution"]
# Count the feature's tokens per expert, take the largest count, divide by the feature's tokens:

# %% tags=["solution"]
# Solution (click to show)
def solution_purity(active: torch.Tensor, chosen: torch.Tensor) -> float:
    per_expert = chosen[active].sum(0)  # [E] the feature's tokens that chose each expert
    return (per_expert.max() / active.sum()).item()


print(exercises.check_feature_purity(solution_purity))

# %% [markdown]
# ## How much do features and experts tell about each other, layer by layer?
#
# Purity looks at one expert per feature. The **mutual information** I(A; C) between "feature f is active" (A) and
# "expert e is chosen" (C), in bits, counts both directions and both outcomes. Divided by the feature's own entropy
# H(A) it is a share: 1 when the feature is active exactly when the expert is chosen. `features.information` takes
# each feature's best expert, averages the share over features active on 50 tokens or more (rarer ones are biased
# upward), and bootstraps over texts (tokens of one text are not independent). Counted from a finite sample, the
# information is biased upward; the bootstrap measures that bias and `information` subtracts it from the share, its
# interval and the baselines alike. **Predict**: at which layer is the share of layer 3's transcoder features highest,
# and how much of it survives the within-token shuffle?

# %%
# NBVAL_CHECK_OUTPUT
info = features.information(active, moe_trace.chosen(), moe_trace.sequences(), layers=moe_trace.routing.layers)
info_within = features.information(active, moe_trace.chosen(), moe_trace.sequences(),
                                   layers=moe_trace.routing.layers, within=tokens, num_boot=50)
for j, i in enumerate(info.layers):
    low, high = info.mean_share_ci[:, j].tolist()
    beyond = info.mean_share[j] - info_within.baseline[j]
    print(f"layer {i}: share {info.mean_share[j]:.2f} [{low:.2f}, {high:.2f}]; shuffled {info.baseline[j]:.3f}; "
          f"within token ids {info_within.baseline[j]:.2f}, so {beyond:.2f} beyond the token")

# %% tags=["nbval-ignore-output"]
viz.information_figure(info.layers, info.mean_share, info.mean_share_ci,
                       {"routing shuffled": info.baseline, "shuffled within token ids": info_within.baseline},
                       title=f"Layer 3's transcoder features against each layer's routing: {int(info.counted.sum()):,} "
                             f"features, {info.num_tokens:,} tokens, 95% intervals over {info.num_sequences} texts")

# %% [markdown]
# A feature's activity shares about a fifth of its entropy with its best expert's choice in every MoE layer, far
# above the shuffled baseline (under 0.01). Almost all of it is the token: shuffled within token ids, layer 1 keeps
# all of it. Only at layer 3, whose router reads the transcoder's own input, does a clear excess remain (0.24
# against 0.20); the other layers keep 0.02 or less. So far: K2-nano's experts and features agree mostly because
# both follow the token, and beyond the token the agreement is strongest at the layer that reads the features.
#
# ### Exercise 2 ★★ · Write it yourself: mutual information
#
# I(A; C) in bits for two yes/no variables over the same tokens: the sum over the four cells (a, c) of
# p(a, c) log₂(p(a, c) / (p(a) p(c))). Mind the cells with no tokens. Running the cell checks it
# (`exercises.check_mutual_information`, against `features.information`, on a case with an empty cell) and keeps it.

# %%
@lab.mine
def my_mutual_information(a: torch.Tensor, c: torch.Tensor) -> float:
    """a, c [N] bool -> I(A; C) in bits"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Four cells: (active, chosen), (active, not chosen), (inactive, chosen), (inactive, not chosen). Each cell compares
# how often it happens with how often it would if A and C were independent, p(a) p(c). A cell with no tokens adds
# nothing (p log p → 0 as p → 0), so skip it rather than take the log of 0.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Two loops over `x in (True, False)` and `y in (True, False)`: `p_xy = ((a == x) & (c == y)).double().mean()`,
# `p_x = (a == x).double().mean()`, `p_y` likewise; add `p_xy * math.log2(p_xy / (p_x * p_y))` when `p_xy > 0`.

# %% [markdown] tags=["solution"]
# Four cells, skipping the empty ones (p log p → 0):

# %% tags=["solution"]
# Solution (click to show)
import math


def solution_mutual_information(a: torch.Tensor, c: torch.Tensor) -> float:
    total = 0.0
    for x in (True, False):
        for y in (True, False):
            p_xy = ((a == x) & (c == y)).double().mean().item()
            p_x, p_y = (a == x).double().mean().item(), (c == y).double().mean().item()
            if p_xy > 0:
                total += p_xy * math.log2(p_xy / (p_x * p_y))
    return total


print(exercises.check_mutual_information(solution_mutual_information))
#
# ## Which features an expert's output is made of
#
# The other direction: take one expert's output and ask which transcoder features it lies along. For the tokens
# routed to expert e, the share of its (weighted) output w·o along feature f's term a_f W_dec[f] is
# Σ⟨a_f W_dec[f], w·o⟩ / Σ|w·o|² (`features.expert_attribution`). Summed over features it says how much of the
# expert's output the transcoder accounts for.

# %%
attribution = features.expert_attribution(model, transcoder, heldout, max_len=384, progress=False)
busiest = int(attribution.tokens.argmax())
print(f"layer {attribution.layer}: the features account for {attribution.explained.median():.2f} of an expert's "
      f"output (median over experts); expert {busiest} took the most tokens ({int(attribution.tokens[busiest])})")
top_features = attribution.top_features(busiest, n=8)
for i, share in top_features:
    print(f"  feature {i:>4}: {share:+.3f} of its output; {pure.distribution[i, busiest]:.0%} of the feature's tokens "
          f"went to it; {moe_trace.top_contexts(i, tok.decode, n=1, before=3)[0]!r}")

# %% tags=["nbval-ignore-output"]
viz.attribution_figure([f"feature {i}: {moe_trace.top_contexts(i, tok.decode, n=1, before=1)[0][-12:]!r}"
                        for i, _ in top_features], torch.tensor([s for _, s in top_features]),
                       x_title=f"share of expert {busiest}'s output",
                       title=f"What expert {busiest}'s output is made of")

# %% [markdown]
# No single feature makes an expert: the largest carries a few percent of its output, and the top eight together
# under a fifth. The features that do carry it mostly send their tokens to it, so output and routing agree: an
# expert is a *bundle* of many features, each of which it shares with a few other experts.
#
# ## A feature ablated, the router watched
#
# Correlation is not cause. The SAE sits on the residual stream that layer 4's router reads (after layer 4's
# attention adds to it). Take the SAE feature whose tokens go to one layer-4 expert most beyond the within-token
# baseline, zero it (error term kept, so only that feature's term leaves the stream) and watch where its tokens go.
# As a control, zero another feature of similar frequency. **Predict**: what share of its tokens still choose the
# expert?

# %%
sae_active = sae_trace.active()
sae_pure = features.purity(sae_active, sae_trace.chosen(4), within=sae_trace.tokens())
target, expert, *_ = sae_pure.purest(n=1, min_active=200)[0]
counts = sae_pure.active
control = int((counts - counts[target]).abs().masked_fill(torch.arange(len(counts)) == target, 1e9).argmin())


def zero_feature(i: int):
    def hook(f: torch.Tensor, hook) -> torch.Tensor:  # f [B, T, F]
        f = f.clone()
        f[..., i] = 0
        return f
    return hook


feature_probe = sae.probe + ".hook_features"


def routing_of_target_tokens(ablated: int | None) -> torch.Tensor:
    """[E] the share of the target feature's tokens that chose each layer-4 expert, with ``ablated`` zeroed."""
    hooks = [] if ablated is None else [(feature_probe, zero_feature(ablated))]
    with interventions.splice(model, sae.probe, sae, keep_error=True), model.hooks(fwd_hooks=hooks):
        tr = routing.trace_dataset(model, heldout, max_len=384, progress=False)  # the same texts, in the same order
    idx = tr.indices[tr.row(4)][tr.real_tokens()]  # [N, k]
    chosen = torch.nn.functional.one_hot(idx, model.config.n_routed_experts).sum(1)  # [N, E]
    return chosen[sae_active[:, target]].float().mean(0)


shares = {name: routing_of_target_tokens(i) for name, i in
          (("clean", None), (f"feature {target} zeroed", target), (f"feature {control} zeroed", control))}
print(f"feature {target} ({int(counts[target])} tokens) -> expert {expert}; control feature {control} "
      f"({int(counts[control])} tokens)")
for name, share in shares.items():
    print(f"  {name:<20} {share[expert]:.2f} of feature {target}'s tokens choose expert {expert}")

# %%
# NBVAL_CHECK_OUTPUT
before, after, after_control = (share[expert].item() for share in shares.values())
print("zeroing the feature sends most of its tokens elsewhere:", after < before / 2)
print("zeroing the control moves fewer than 5% of them:", abs(after_control - before) < 0.05)

# %% tags=["nbval-ignore-output"]
viz.expert_share_heatmap(torch.stack(list(shares.values())), list(shares),
                         title=f"Layer 4: where feature {target}'s tokens go, before and after ablation")

# %% [markdown]
# Zeroing the feature empties its expert of most of its tokens (0.58 to 0.15), which move to other experts, while
# zeroing a feature of the same frequency leaves the routing as it was. The feature is upstream of the router's
# decision, not only beside it. It is a feature of the text inside string literals:

# %%
for context in sae_trace.top_contexts(target, tok.decode, n=4):
    print(repr(context[-40:]))

# %% [markdown]
# ## The `]` / `)` task through features
#
# [07](07_interventions.ipynb) patched whole activations. Here the task is which bracket closes a list: after
# `x = [1, 2, 3` the model should prefer `]`, after `x = (1, 2, 3` it should prefer `)`. LD = logit(`]`) −
# logit(`)`). Patch the clean run's layer-3 residual stream into the corrupted run one position at a time, then
# only its SAE features (error term of the corrupted run kept): how much of the restoration do the features carry?

# %%
# NBVAL_CHECK_OUTPUT
from k2lab.analysis.interventions import patch

clean, corrupt = model.to_tokens("x = [1, 2, 3"), model.to_tokens("x = (1, 2, 3")
close_square, close_round = 93, 41  # `]` and `)`
assert tok.encode("]") == [close_square] and tok.encode(")") == [close_round]
ld = lambda out: (out[0, -1, close_square] - out[0, -1, close_round]).item()  # noqa: E731
ld_clean, ld_corrupt = ld(model(clean)), ld(model(corrupt))
restored = lambda out: (ld(out) - ld_corrupt) / (ld_clean - ld_corrupt)  # noqa: E731
T = clean.shape[1]
_, clean_cache = model.run_with_cache(clean, names=sae.probe)
with interventions.splice(model, sae.probe, sae, keep_error=True):
    _, clean_features = model.run_with_cache(clean, names=feature_probe)
    _, corrupt_features = model.run_with_cache(corrupt, names=feature_probe)
    by_features = []
    for t in range(T):
        with patch(model, clean_features, feature_probe, positions=[t]):
            by_features.append(restored(model(corrupt)))
by_stream = []
for t in range(T):
    with patch(model, clean_cache, sae.probe, positions=[t]):
        by_stream.append(restored(model(corrupt)))
print(f"LD clean {ld_clean:+.1f}, corrupted {ld_corrupt:+.1f}")
for t in (2, T - 1):
    print(f"position {t} {tok.id_to_piece(int(clean[0, t]))!r}: the stream restores {by_stream[t]:.2f}, "
          f"its features {by_features[t]:.2f}")

# %% tags=["nbval-ignore-output"]
viz.effect_heatmap(torch.tensor([by_stream, by_features]), ["layer 3 stream", "its SAE features"],
                   [tok.id_to_piece(i) for i in clean[0].tolist()], colorbar_title="restored",
                   title="Patching layer 3 into the corrupted run: the stream against its features")

# %% [markdown]
# The bracket is carried in two places at layer 3: on the opening bracket itself and at the last position, where
# the prediction is made. The features carry most of each (0.53 of 0.63 and 0.34 of 0.39); the rest is in the
# reconstruction error, which the features do not see. Which features? Rank those that differ most between the runs
# at the last position, and patch each alone:

# %%
last = T - 1
difference = clean_features[feature_probe][0, last] - corrupt_features[feature_probe][0, last]  # [F]
candidates = difference.abs().topk(6).indices.tolist()
single = {}
with interventions.splice(model, sae.probe, sae, keep_error=True):
    for i in candidates:
        def patch_one(f: torch.Tensor, hook, i=i) -> torch.Tensor:
            f = f.clone()
            f[:, last, i] = clean_features[feature_probe][:, last, i]
            return f
        with model.hooks(fwd_hooks=[(feature_probe, patch_one)]):
            single[i] = restored(model(corrupt))
for i in candidates:
    print(f"feature {i:>4}: clean {clean_features[feature_probe][0, last, i]:.2f}, corrupted "
          f"{corrupt_features[feature_probe][0, last, i]:.2f}; patched alone restores {single[i]:+.2f}")
bracket = max(single, key=single.get)

# %% tags=["nbval-ignore-output"]
viz.attribution_figure([f"feature {i}" for i in single], torch.tensor(list(single.values())),
                       x_title="share of LD restored", title="Patching one feature at the last position")

# %% [markdown]
# One feature carries more than the rest together. What is it, and where does the router send its tokens?

# %%
print(f"feature {bracket}: active on {int(sae_pure.active[bracket])} held-out tokens; at layer 4, "
      f"{sae_pure.purity[bracket]:.2f} of them choose expert {int(sae_pure.top_expert[bracket])} "
      f"(within-token chance {sae_pure.baseline[bracket]:.2f})")
for context in sae_trace.top_contexts(bracket, tok.decode, n=5):
    print("   ", repr(context[-40:]))

# %% [markdown]
# It is active on the first tokens inside an open square bracket (an index, a character class), so it says "a
# bracket is open", not "the last token was `[`". Its tokens spread over experts (its purity equals the within-token
# chance), so the fact that decides `]` against `)` lives in a feature that no expert owns.
#
# ## What K2-nano allows one to conclude, and what not
#
# K2-nano has 6 blocks, a residual stream 128 wide and 32 experts of which 4 are chosen, trained for under an hour
# on 11 M tokens.
# What held here:
#
# * the tools work and agree: splicing with the error kept leaves the model unchanged; features are pure and
#   informative far beyond shuffled routing; ablating a feature moves the router as the purity said it would;
# * on this model most of the agreement between features and experts goes through the token id. Only at the layer
#   whose router reads the features does a clear excess remain.
#
# What it does not show: that K2's experts, 384 per layer over 61 layers, trained on trillions of tokens, are
# organised the same way. A 128-wide stream holds few features, so a dictionary of 1,024 or 2,048 is as wide as the
# model can fill, and a small model routes by token more than a large one may. The dictionaries reconstruct 83-89%
# of the variance: what the error term holds is invisible to every measure above. And both sides are small samples:
# about 11,000 held-out tokens from 32 texts. Run the same cells on a larger model (`K2LAB_MODEL`, and a dictionary
# trained on it with `dictionary.train_sae`) before believing any of it of K2.

# %% [markdown]
# ## More exercises
#
# ### Exercise 3 ★ · Predict, then run: steering
#
# Add feature `bracket` at the corrupted prompt's last position, with strength 2, 5 and 10 (a hook on the features
# probe that adds to it, inside the splice with the error kept). At which strength does `]` beat `)`, that is, does
# LD turn positive? Predict first.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Patching this feature alone restored the share of LD printed above; adding it at a strength larger than its clean
# activation pushes further along the same direction. How large is its clean activation at the last position?

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# A hook `def add(f, hook): f = f.clone(); f[:, -1, bracket] += strength; return f` on `feature_probe`, run as
# `with interventions.splice(model, sae.probe, sae, keep_error=True), model.hooks(fwd_hooks=[(feature_probe, add)]):`
# and `ld(model(corrupt))` inside.

# %% [markdown] tags=["solution"]
# The feature's direction, added where the prediction is made; the printed LDs answer at which strength `]` wins:

# %% tags=["solution"]
# Solution (click to show)
def add_feature(strength: float):
    def hook(f: torch.Tensor, hook) -> torch.Tensor:
        f = f.clone()
        f[:, -1, bracket] += strength
        return f
    return hook


with interventions.splice(model, sae.probe, sae, keep_error=True):
    for strength in (2.0, 5.0, 10.0):
        with model.hooks(fwd_hooks=[(feature_probe, add_feature(strength))]):
            print(f"+{strength:>4}: LD {ld(model(corrupt)):+.2f} (corrupted {ld_corrupt:+.2f}, clean {ld_clean:+.2f})")

# %% [markdown]
# ### Exercise 4 ★★ · Change a knob: rare features
#
# Run `features.information` on the transcoder's features with `min_active=10` and compare each layer's plug-in share
# (`mean_share_plugin`) with the corrected one (`mean_share`) and its interval. How large is the correction, against
# the default's, and why does the default count only features active on 50 tokens or more?

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# The plug-in estimate of information from few tokens is biased upward: a feature seen ten times looks tied to
# whatever its ten tokens chose. A bootstrap resample repeats texts, which makes the feature's tokens look even more
# alike: the resamples' excess over the estimate measures the bias, which `information` subtracts.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `features.information(active, moe_trace.chosen(), moe_trace.sequences(), layers=moe_trace.routing.layers,
# min_active=10, num_boot=100)`, then for each layer `mean_share_plugin[j] - mean_share[j]`, against the same for
# `info` (the default).

# %% [markdown] tags=["solution"]
# The plug-in information of a feature seen ten times is biased upward (it shares a lot with some expert by chance),
# and a resample, which repeats texts, is biased about as much again: a plain percentile interval would lie wholly
# above the estimate. `information` measures that bias by the resamples and subtracts it, so the corrected share sits
# inside its interval; but with rare features counted the correction is about twice the default's, as large as the
# interval is wide, and the answer leans on how well the bootstrap measures it. Counting only features seen often
# keeps it small:

# %% tags=["solution"]
# Solution (click to show)
rare = features.information(active, moe_trace.chosen(), moe_trace.sequences(), layers=moe_trace.routing.layers,
                            min_active=10, num_boot=100)
for j, i in enumerate(rare.layers):
    low, high = rare.mean_share_ci[:, j].tolist()
    print(f"layer {i}: plug-in {rare.mean_share_plugin[j]:.3f}, corrected {rare.mean_share[j]:.3f} "
          f"[{low:.3f}, {high:.3f}]: a correction of {rare.mean_share_plugin[j] - rare.mean_share[j]:.3f}, "
          f"against {info.mean_share_plugin[j] - info.mean_share[j]:.3f} with the default min_active=50")
