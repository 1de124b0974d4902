# %% [markdown]
# # 12 · Circuits through the experts
#
# Notebook [11](11_features_experts.ipynb) held features against experts and found that most of what they share is
# the token. Correlation cannot say what a feature *does*. This notebook asks the causal question with the field's
# tool for it, the **[attribution graph](GLOSSARY.md#attribution-graph)** (Ameisen et al., 2025, "Circuit Tracing";
# the open circuit-tracer library does it for dense models): for one prompt and one prediction, which features, at
# which layer and position, push the prediction, and through which other features. K2 adds a question no dense model
# has: each of those features also pushes the **router** of every MoE layer after it.
#
# The method rewrites the model, for this prompt only, as a **[local replacement model](GLOSSARY.md#local-replacement-model)**
# that is linear in its parts:
#
# * every feed-forward block (block 0's MLP, the MoE of blocks 1 to 5) is replaced by its
#   [transcoder](GLOSSARY.md#transcoder), whose features are read from the block's real input;
# * what the transcoder misses, the real block's output minus the reconstruction, becomes an
#   **[error node](GLOSSARY.md#error-node)** per block and position, so nothing is lost;
# * every RMSNorm's denominator and every attention pattern is frozen at the real forward's value, so norms are fixed
#   scalings and attention a fixed mixing of positions.
#
# Then the target logit, and every feature's pre-activation, is a sum of terms, one per source (an embedding, a
# feature's decoder vector times its activation, an error). An **edge** is one such term: the source's *direct*
# effect, through the residual stream and frozen attention, not through any other feature.
#
# | tool | what it does |
# | --- | --- |
# | `circuits.nano_transcoders()` | the six shipped transcoders, one per feed-forward block of K2-nano |
# | `circuits.attribute(model, transcoders, prompt, target=)` | the graph: nodes, edges, pruning by influence, router reads |
# | `circuits.check_by_ablation(model, transcoders, graph)` | zero the top features in the real model, against the graph |
# | `features.router_read`, `features.routing_effect` | a feature's direct read by a router; its measured effect on routing |
# | `viz.circuit_figure(graph, top_tokens)` | the graph, layer × position, with contexts and router reads on hover |

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
model, tok = lab.load_nano()  # the shipped transcoders were trained on K2-nano's activations
print(lab.describe(model, "K2-nano (bundled)"))

# %%
import torch

from k2lab import circuits, interventions, viz
from k2lab.analysis import features
from k2lab.training import corpus

heldout = [doc.text for doc in corpus.documents("heldout")]  # never trained on, by the model or the transcoders

# %% [markdown]
# ## The behaviour: which quote closes the string?
#
# Python lets a string open with `"` or `'`, and it must close with the same one. After `x = ["a", "b` the next token
# should carry a double quote; after `x = ['a', 'b`, a single one. K2-nano's tokenizer merges a quote with what
# follows it, so the candidates are whole tokens such as `",` and `',`. The metric is the **logit difference**
# logit(`",`) − logit(`',`). **Predict**: which tokens of the prompt will the graph say carry the choice?

# %%
# NBVAL_CHECK_OUTPUT
prompt, twin = 'x = ["a", "b', "x = ['a', 'b"
double, single = '",', "',"
for text in (prompt, twin):
    ids = model.to_tokens(text)
    probs = model(ids)[0, -1].softmax(-1)
    top = [tok.id_to_piece(int(i)) for i in probs.topk(3).indices]
    print(f"{text!r:<16} {model.to_str_tokens(text)}: p({double!r}) = {probs[tok.encode(double)[0]]:.2f}, "
          f"p({single!r}) = {probs[tok.encode(single)[0]]:.2f}; top 3 {top}")

# %% [markdown]
# ## The replacement's parts
#
# One transcoder per feed-forward block, each 2,048 features with k = 32 active per token, trained on K2-nano's
# corpus (`python scripts/train_dictionaries.py`). Each one's held-out figures: the variance of its block's output it
# leaves unexplained (FVU), the dead features, and what splicing it in alone costs in next-token loss.

# %%
# NBVAL_CHECK_OUTPUT
transcoders = circuits.nano_transcoders()
for layer, tc in enumerate(transcoders):
    m = tc.metadata["k2lab_heldout"]
    print(f"block {layer} ({'MLP' if layer == 0 else 'MoE'}): FVU {m['fvu']:.2f}, dead {m['dead_fraction']:.1%}, "
          f"splice costs {m['ce_spliced'] - m['ce_clean']:.3f} nats")

# %% [markdown]
# The MoE blocks' transcoders leave more of their block unexplained than the dense MLP's: every token's output there
# is a different sum of four experts and the shared one, which a single dictionary has to imitate. All of it stays in
# the graph as error nodes. **Predict**: will the error nodes matter for this prompt?
#
# ## One graph
#
# `attribute` runs the real forward once, freezes it, then asks, for each feature and for the target, how much each
# source contributes (one backward pass through the frozen linear model per batch of nodes). It then **prunes**:
# each node's **[influence](GLOSSARY.md#influence)** on the target is the sum over all paths of the products of the
# edges' shares, and the nodes that together carry 80% of it are kept.

# %%
import time

start = time.perf_counter()
graph = circuits.attribute(model, transcoders, prompt, target=(double, single))
seconds = time.perf_counter() - start
s = graph.summary()
print(f"{graph.target.label} = {graph.target.value:.2f}, built in {seconds:.1f} s")
print(f"{s['nodes']:,} nodes ({s['features']:,} active features), {s['edges']:,} edges; kept "
      f"{s['kept_features']} features and {s['kept_edges']:,} edges ({s['pruned_node_share']:.0%} of the nodes pruned)")

# %% [markdown]
# **Completeness** is what makes the edges trustworthy: for every feature and for the target, the incoming edges
# plus the node's bias (its encoder bias and the transcoders' decoder biases) add up to its value in the real
# forward. Nothing is approximated yet; the approximation comes when we read the graph as saying what would happen
# if a feature changed.

# %%
# NBVAL_CHECK_OUTPUT
error = graph.completeness()
receivers = ~error.isnan()
print(f"{int(receivers.sum()):,} nodes with inputs; largest |edges + bias - real value| <= 1e-5: "
      f"{error[receivers].abs().max().item() <= 1e-5}")

# %% [markdown]
# ## The graph
#
# Embeddings sit at the bottom, each block's kept features (circles, larger when more influential) and error nodes
# (grey diamonds) in its row, the target on top. Blue edges push their target up, red ones down; width follows the
# weight. Hover a feature for the contexts in held-out text where it is most active and for its router read.

# %%
top_tokens = circuits.top_activations(model, transcoders, graph, heldout[:16], max_len=256)

# %% tags=["nbval-ignore-output"]
viz.circuit_figure(graph, top_tokens)

# %% [markdown]
# Where does the influence sit? By kind of node, then summed over the kept nodes of each block and position:

# %%
kinds = {"embeddings": circuits.EMBEDDING, "features": circuits.FEATURE, "errors": circuits.ERROR}
total = sum(graph.influence[graph.kind == kind].sum() for kind in kinds.values())
print(", ".join(f"{name} {graph.influence[graph.kind == kind].sum() / total:.0%}" for name, kind in kinds.items()),
      "of the influence on the target")

# %% tags=["nbval-ignore-output"]
viz.influence_heatmap(graph)

# %% [markdown]
# The quote's tokens carry the choice: the opening ` ["` and the second string's ` "`, their embeddings and the
# features of the first blocks on them, then features at the last position in the last blocks. The error nodes
# carry a small share: the transcoders explain most of what matters here.
#
# The most influential features, with their total effect on the target (every path, each downstream feature
# answering linearly: what zeroing the feature should cost) and where they fire in held-out text:

# %%
total_effect = graph.total_effect()  # [n]
for node in graph.top_features(8):
    key = (int(graph.layer[node]), int(graph.feature[node]))
    print(f"{graph.label(node):<12} on {graph.tokens[int(graph.position[node])]!r:>5}: activation "
          f"{graph.activation[node]:.2f}, influence {graph.influence[node]:.3f}, total effect "
          f"{total_effect[node]:+.2f}; most active on {top_tokens.get(key, ['-'])[0][-28:]!r}")

# %% [markdown]
# ## Does the real model agree?
#
# The graph is a claim about the replacement. To hold it against K2-nano itself, zero each of the most influential
# features in the real model: its block's transcoder is spliced in with its error kept, so the only change is that
# feature's term, and everything after it (attention, the other blocks, every router and expert) is the model's own.
# The graph offers two predictions: minus the feature's **direct** edge into the target, and minus its **total**
# effect, every path through the features downstream, each answering linearly. **Predict**: which one overshoots?

# %%
check = circuits.check_by_ablation(model, transcoders, graph, n=20)
for label, direct, total, measured in zip(check.labels, check.predicted_direct, check.predicted_total,
                                          check.measured, strict=True):
    print(f"{label:<16} predicted: direct {direct:+.3f}, total {total:+.3f}; measured {measured:+.3f}")
print(check)

# %%
# NBVAL_CHECK_OUTPUT
print(f"the measured change has the sign of the total effect for at least 16 of 20: "
      f"{check.sign_agreement('total') >= 0.8}")
print(f"zeroing all twenty moves the logit difference the predicted way: "
      f"{check.joint_measured * check.joint_predicted > 0}")

# %% tags=["nbval-ignore-output"]
viz.prediction_figure({"direct edge": check.predicted_direct, "total effect": check.predicted_total}, check.measured,
                      check.labels, title="Zeroing each top feature: the graph against K2-nano")

# %% [markdown]
# ## Features that steer the router
#
# In a dense model the story would end here. In K2, each feature on the way also writes into the residual stream
# that every later router reads: the router's logits are W_gate · (g ⊙ x / rms(x)), linear in x with the norm frozen,
# so a feature's **[router read](GLOSSARY.md#router-read)** is an edge like any other, into the router's logits at its
# own position. The graph's routing is frozen in its error nodes, as attention's patterns are, so these edges change
# nothing in the graph; they say which experts the feature votes for.
#
# The router reads of the top features at the first MoE layer after each (a feature of the last block has none):

# %%
reads, labels = [], []
for node in graph.top_features(8):
    later = [j for j, layer in enumerate(graph.router_layers) if layer > int(graph.layer[node])]
    if later:
        reads.append(graph.router_read[node, later[0]])
        labels.append(f"{graph.label(node)} → L{graph.router_layers[later[0]]}")

# %% tags=["nbval-ignore-output"]
viz.router_read_figure(torch.stack(reads), labels,
                       title="How the top features push the next MoE router's logits (direct effect)")

# %% [markdown]
# Is a router read real? Take the kept feature with the largest read and zero it in the real model, at its position:
# the next MoE router's logits there move. Part of the move is the read; the rest comes through the features and
# experts in between and the norm's denominator, which the read holds fixed. **Predict**: how closely does the move
# follow the read?

# %%
def largest_read(node: int) -> tuple[float, int]:
    """(the node's largest |router read| at the first MoE layer after it, that layer's row); (0, -1) if none."""
    later = [j for j, layer in enumerate(graph.router_layers) if layer > int(graph.layer[node])]
    return (graph.router_read[node, later[0]].abs().max().item(), later[0]) if later else (0.0, -1)


kept_features = (graph.node_mask & (graph.kind == circuits.FEATURE)).nonzero()[:, 0].tolist()
steer_node = max(kept_features, key=lambda node: largest_read(node)[0])
j = largest_read(steer_node)[1]
layer, position, feature = (int(graph.layer[steer_node]), int(graph.position[steer_node]),
                            int(graph.feature[steer_node]))
router_layer, tc = graph.router_layers[j], transcoders[layer]
probe = f"layers.{router_layer}.mlp.gate.hook_logits"
ids = model.to_tokens(prompt)
_, clean_cache = model.run_with_cache(ids, names=probe)


def zero_feature(f: torch.Tensor, hook) -> torch.Tensor:  # f [1, T, F]
    f = f.clone()
    f[0, position, feature] = 0
    return f


with interventions.splice(model, tc.probe, tc, keep_error=True) as point, \
        model.hooks(fwd_hooks=[(point.name, zero_feature)]):
    _, ablated_cache = model.run_with_cache(ids, names=probe)
measured = (ablated_cache[probe] - clean_cache[probe])[0, position]  # [E]
read = graph.router_read[steer_node, j].float()  # [E]
agreement = torch.corrcoef(torch.stack([measured, -read]))[0, 1]
print(f"{graph.label(steer_node)} on {graph.tokens[position]!r}: pushes block {router_layer}'s expert "
      f"{int(read.argmax())} up by {read.max():.2f} and expert {int(read.argmin())} down by {-read.min():.2f}")
print(f"zeroed: the 32 router logits move with r = {agreement:.2f} against minus the read")

# %% [markdown]
# One token is one sample. Over held-out text, `features.routing_effect` zeroes the feature on every token where it
# fires and counts how those tokens' expert choices change at each later MoE layer, against control features of the
# same frequency zeroed the same way on their own tokens, with bootstrap intervals over texts:

# %%
effect = features.routing_effect(model, tc, feature, heldout[:16], probe=tc.probe, num_controls=4, max_len=256,
                                 num_boot=100, progress=False)
print(effect)
row = effect.layers.index(router_layer)
for expert in effect.rate_change[row].abs().topk(3).indices.tolist():
    low, high = effect.rate_change_ci[:, row, expert].tolist()
    print(f"block {router_layer}, expert {expert}: the share of the feature's tokens choosing it changes by "
          f"{effect.rate_change[row, expert]:+.1%} [{low:+.1%}, {high:+.1%}]; the feature's read on it "
          f"{graph.router_read[steer_node, j, expert]:+.2f}")

# %% [markdown]
# Read the two parts apart. Zeroing the feature moves far more of its tokens' choices than zeroing a control of the
# same frequency, at the next MoE layer and, fading, at later ones. Which experts gain and lose is another matter:
# a router read says which *logits* move, but the router keeps its top 4, so an expert the read pushes down gains
# tokens once the feature is gone, and the experts that make room for it may be ones the read hardly touches. Who
# is chosen is decided by who was near the edge of the top 4: the one non-linearity the graph freezes.

# %% [markdown]
# ## What K2-nano can and cannot show
#
# K2-nano has 6 blocks, a residual stream 128 wide, 32 experts of which 4 are chosen, and was trained for under an
# hour. What held here:
#
# * the machinery is exact where it claims to be: the edges add up to every node's real value, and on a toy model
#   they equal a hand computation (`tests/analysis/test_circuits.py`);
# * the graph's predictions carry over to the real model, with every router and expert left live: the signs for
#   most of the top features, the sizes roughly for the direct edge, while the total effect overstates what zeroing
#   an early feature does (downstream features stop at zero or leave the top k; the graph lets them go on linearly);
# * router reads are edges like any other; zeroing a feature moves its router's logits along its read, and over
#   held-out text it moves routing beyond matched controls.
#
# What it cannot show: that K2's circuits look like this. A 128-wide stream holds few features, a 2,048-feature
# transcoder per block is as wide as it can fill, and the error nodes hold what the transcoders leave (the FVU printed
# above), unexplained. Attention is taken as given: which positions a head reads is not explained. The graph is
# linear: where zeroing a feature flips an expert in or out of a token's top 4, the real model leaves the graph's
# arithmetic, and the check above measures how far that goes, for twenty features on one prompt. Run the same cells
# on a larger model, with transcoders trained on it (`dictionary.train_transcoder` per block), before believing any of
# it of K2.

# %% [markdown]
# ## Exercises
#
# ### Exercise 1 ★ · Predict, then run: how much of the graph is needed?
#
# Prune the same graph at node thresholds 0.5 and 0.95 (`circuits.prune(graph, node_threshold=...)`), and count the
# kept features each time. Predict first: does keeping 95% of the influence take about twice the features of 50%,
# or many more? Restore 0.8 afterwards.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1: the idea**
#
# Influence is spread thinly over a long tail: each extra share of it costs more features than the last.

# %% [markdown] tags=["hint"]
# **Hint 2: the code**
#
# `circuits.prune(graph, node_threshold=t)` sets `graph.node_mask`; count `(graph.node_mask & (graph.kind ==
# circuits.FEATURE)).sum()`. Call `circuits.prune(graph)` at the end to return to the defaults.

# %% [markdown] tags=["solution"]
# Many more: the last few percent of the influence sit in a long tail of small contributions.

# %% tags=["solution"]
for threshold in (0.5, 0.8, 0.95):
    circuits.prune(graph, node_threshold=threshold)
    print(f"node threshold {threshold}: {int((graph.node_mask & (graph.kind == circuits.FEATURE)).sum())} features "
          f"kept")
circuits.prune(graph)

# %% [markdown]
# ### Exercise 2 ★★ · Write it yourself: a feature's router read
#
# Given a router's weight `gate` [E, D], its block's post-attention norm weight `norm_weight` [D] and a dictionary's
# decoder `decoder` [F, D], return the change of each expert's router logit per unit of each feature's activation,
# [F, E], with the norm's denominator held fixed (k2lab's `features.router_read`).

# %%
from k2lab.lab.exercises import check_influence, check_router_read


def my_router_read(gate: torch.Tensor, norm_weight: torch.Tensor, decoder: torch.Tensor) -> torch.Tensor:
    """gate [E, D], norm_weight [D], decoder [F, D] -> [F, E]"""
    raise NotImplementedError


print(check_router_read(my_router_read))

# %% [markdown] tags=["hint"]
# **Hint 1: the idea**
#
# The router computes logits = W_gate · (g ⊙ x / rms(x)). Hold rms(x) fixed and add a · W_dec[f] to x: what is added
# to the logits, per unit of a?

# %% [markdown] tags=["hint"]
# **Hint 2: the code**
#
# Scale every decoder row by the norm weight (broadcast over F), then multiply by the router's weight transposed:
# `(decoder * norm_weight) @ gate.T`.

# %% [markdown] tags=["solution"]
# The norm's weight scales the feature's direction, the router's rows read it:

# %% tags=["solution"]
def my_router_read(gate: torch.Tensor, norm_weight: torch.Tensor, decoder: torch.Tensor) -> torch.Tensor:
    return (decoder * norm_weight) @ gate.T  # [F, E]


print(check_router_read(my_router_read))
block = model.layers[router_layer]
mine = my_router_read(block.mlp.gate.weight, block.post_attention_layernorm.weight, tc.W_dec)  # tc: block `layer`
print(f"against features.router_read for block {layer}'s transcoder at block {router_layer}: max |difference| "
      f"{(mine - features.router_read(model, tc, router_layer)).abs().max():.1e}")

# %% [markdown]
# ### Exercise 3 ★★★ · Write it yourself: influence
#
# Given an adjacency matrix `A` [n, n] (A[t, s] the direct effect of node s on node t) and the target's index, return
# every node's influence on the target: normalise the absolute edges so that each node's incoming edges sum to 1, then
# add up the products along every path that ends at the target, of every length.

# %%
def my_influence(A: torch.Tensor, target: int) -> torch.Tensor:
    """A [n, n], target an index -> [n]"""
    raise NotImplementedError


print(check_influence(my_influence))

# %% [markdown] tags=["hint"]
# **Hint 1: the idea**
#
# With Â the normalised matrix and w the target's indicator row, the paths of length 1 are w Â, of length 2 w Â²,
# and so on. The graph has no cycles, so the terms reach zero after as many steps as it has layers.

# %% [markdown] tags=["hint"]
# **Hint 2: the code**
#
# `M = A.abs() / A.abs().sum(1, keepdim=True).clamp(min=1e-30)`; start from `step = w @ M` with `w` zero but a 1 at
# the target; loop `total += step; step = step @ M` while `step` has a non-zero entry.

# %% [markdown] tags=["solution"]
# Row-normalise the absolute edges, then walk back from the target one step at a time until nothing is left:

# %% tags=["solution"]
def my_influence(A: torch.Tensor, target: int) -> torch.Tensor:
    M = A.abs() / A.abs().sum(1, keepdim=True).clamp(min=1e-30)  # each node's incoming edges sum to 1
    w = torch.zeros(len(A), dtype=A.dtype)
    w[target] = 1.0
    total, step = torch.zeros_like(w), w @ M
    while bool(step.any()):
        total, step = total + step, step @ M
    return total


print(check_influence(my_influence))
target_node = int((graph.kind == circuits.TARGET).nonzero()[0])
print(f"on the graph: max |yours - graph.influence| = "
      f"{(my_influence(graph.adjacency, target_node) - graph.influence).abs().max():.1e}")
