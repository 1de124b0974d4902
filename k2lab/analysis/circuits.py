"""Attribution graphs through the experts: the circuit-tracing method of Ameisen et al. (2025, "Circuit Tracing:
Revealing Computational Graphs in Language Models") for K2, whose feed-forward blocks are mixtures of experts.

    transcoders = circuits.nano_transcoders()                    # one per FFN of K2-nano: block 0's MLP, 1-5's MoE
    graph = circuits.attribute(model, transcoders, 'x = ["a", "b', target=('",', "',"))  # logit difference
    graph.summary()                    # nodes and edges before and after pruning, the completeness error
    check = circuits.check_by_ablation(model, transcoders, graph)          # the graph against the real model
    viz.circuit_figure(graph, circuits.top_activations(model, transcoders, graph, texts))

**The local replacement model.** For one prompt, K2's forward is rewritten so that the target is a linear function
of a set of nodes, frozen at the real forward's values where the model is not linear:

- every feed-forward block (block 0's dense MLP, every MoE block: shared expert, routed experts and router alike) is
  replaced by its transcoder: its output at (layer l, position t) is sum_f a_f W_dec[f] + b_dec + e_{l,t}, where the
  features a_f = TopK(ReLU(W_enc x + b_enc)) are read from the block's real input x and the **error** e_{l,t} is
  what the real block wrote minus the reconstruction;
- every RMSNorm's denominator (the blocks' input and post-attention norms, the kv latent's norm inside MLA and the
  final norm) is frozen: a norm is the multiplication by g / rms(x_real), a fixed diagonal;
- attention patterns are frozen: attention is the linear map x -> o_proj(sum_s pattern[t, s] W_UV c_KV(x_s)), its
  value path through the frozen norms (queries, keys and the rotary part enter only through the pattern).

With these frozen, every quantity read from the residual stream (a transcoder's pre-activation W_enc . x + b_enc,
the target logit, a router's logits W_gate . x) is a sum over sources: the token embeddings, each active feature's
decoder vector a_f W_dec[f], each error e_{l,t} and the transcoders' decoder biases. The **direct effect** of a
source on a node is that source's term in the sum: the path through the residual stream and frozen attention, not
through any other feature. Error nodes and embeddings only send; the target only receives.

**Routing in the replacement.** The MoE is replaced as a whole, so the router is not on any path to the target: the
experts the real forward chose enter through the error nodes, frozen as attention's patterns are. What an MoE
adds is that its router reads the same normalised residual the transcoder reads, so router logits are linear
read-outs of the replacement model too: logit_e = W_gate[e] . x. Each feature node carries its **router read**,
its direct effect on every later MoE layer's router logits at its own position (``AttributionGraph.router_read``),
computed like any edge. What the graph cannot hold is a flip of the top-k choice (a non-linearity, like TopK
itself): ``check_by_ablation`` measures what that costs.

**Completeness.** Each feature's and the target's incoming edges plus its bias (b_enc and the decoder biases'
effect) equal its pre-activation in the real forward, to float32 rounding (``AttributionGraph.completeness``).

**Pruning** (Ameisen et al.'s): the absolute edges normalised per target node, A_hat; a node's influence on the
target is its row of w^T (A_hat + A_hat^2 + ...); feature and error nodes are kept in order of influence until
they carry ``node_threshold`` of it; edges, scored by their normalised weight times their target's influence,
until they carry ``edge_threshold``; then nodes left without a kept edge in (features) or out go too. Embeddings and
the target stay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .routing import moe_layers

if TYPE_CHECKING:
    from ..model import K2Model

__all__ = [
    "EMBEDDING", "ERROR", "FEATURE", "TARGET", "AblationCheck", "AttributionGraph", "LocalReplacement", "Target",
    "ablate_features", "attribute", "check_by_ablation", "nano_transcoders", "node_influence", "prune",
    "replacement_of", "replacement_probes", "top_activations",
]

EMBEDDING = 0
"""The kind of a graph node that is a token's embedding (``AttributionGraph.kind``)."""
FEATURE = 1
"""The kind of a node that is a transcoder feature active at a (layer, position)."""
ERROR = 2
"""The kind of an error node: what a transcoder misses of its FFN's output at a (layer, position)."""
TARGET = 3
"""The kind of the target node: the logit (or logit difference) the graph explains."""
KIND_NAMES = ("embedding", "feature", "error", "target")
TargetSpec = int | str | tuple[int | str, int | str] | None
ROW_BATCH = 256  # rows (nodes read) per batched backward through the replacement model


# ---- the local replacement model -----------------------------------------------------------------------------------
@dataclass
class LocalReplacement:
    """K2's forward for one prompt with the norms' denominators and the attention patterns frozen and the feed-forward
    blocks taken out: a linear map from the sources (the embeddings and each block's feed-forward output) to what
    the rest of the model reads (each block's feed-forward input, and the final norm's output). L blocks, T
    positions, D width, H heads, C kv latent width, V value head width; float32 (float64 for a float64 model)."""

    attn_in_scale: torch.Tensor  # [L, T, D] input_layernorm.weight / rms(resid_pre)
    kv_scale: torch.Tensor  # [L, T, C] kv_a_layernorm.weight / rms(kv latent before its norm)
    w_kv: torch.Tensor  # [L, C, D] the rows of kv_a_proj_with_mqa that make the kv latent (not the rotary key)
    w_uv: torch.Tensor  # [L, H, V, C] the value rows of kv_b_proj, per head
    w_o: torch.Tensor  # [L, D, H * V] o_proj
    pattern: torch.Tensor  # [L, H, T, T] attention patterns
    ffn_in_scale: torch.Tensor  # [L, T, D] post_attention_layernorm.weight / rms(resid_mid)
    final_scale: torch.Tensor  # [T, D] norm.weight / rms(last resid_post)

    @property
    def num_layers(self) -> int:
        """L."""
        return self.attn_in_scale.shape[0]

    def attention(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Block ``layer``'s attention with its pattern and norms frozen: residual [B, T, D] -> its write [B, T, D]."""
        latent = (x * self.attn_in_scale[layer]) @ self.w_kv[layer].T * self.kv_scale[layer]  # [B, T, C]
        v = torch.einsum("btc,hvc->bthv", latent, self.w_uv[layer])  # [B, T, H, V]
        z = torch.einsum("hts,bshv->bthv", self.pattern[layer], v)  # [B, T, H, V]
        return z.flatten(2) @ self.w_o[layer].T  # [B, T, D]

    def attention_transposed(self, layer: int, g: torch.Tensor) -> torch.Tensor:
        """The transpose of ``attention(layer, .)``: a gradient on its write [B, T, D] -> on its input [B, T, D]."""
        B, T, _ = g.shape
        H, V, _ = self.w_uv[layer].shape
        gz = (g @ self.w_o[layer]).view(B, T, H, V)  # [B, T, H, V]
        gv = torch.einsum("hts,bthv->bshv", self.pattern[layer], gz)  # [B, S, H, V]
        g_latent = torch.einsum("bshv,hvc->bsc", gv, self.w_uv[layer]) * self.kv_scale[layer]  # [B, S, C]
        return (g_latent @ self.w_kv[layer]) * self.attn_in_scale[layer]  # [B, S, D]

    def forward(self, sources: torch.Tensor) -> torch.Tensor:
        """sources [B, L + 1, T, D] (slot 0 the embeddings, slot 1 + l block l's feed-forward output) -> the reads
        [B, L + 1, T, D]: slot l block l's feed-forward input (after its frozen norm), slot L the final norm's
        output."""
        x = sources[:, 0]  # [B, T, D]
        reads = []
        for layer in range(self.num_layers):
            x = x + self.attention(layer, x)  # resid_mid
            reads.append(x * self.ffn_in_scale[layer])
            x = x + sources[:, 1 + layer]  # resid_post
        reads.append(x * self.final_scale)
        return torch.stack(reads, 1)

    def read_gradients(self, slot: int, positions: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
        """The gradient of the reads u_b . reads[slot, p_b] (one per row b: ``positions`` [B], ``vectors`` [B, D])
        with respect to the sources: [B, slot + 1, T, D] (the sources of later slots do not reach this read). This
        is the transpose of ``forward``, row by row."""
        B, D = vectors.shape
        T = self.final_scale.shape[0]
        rows = torch.arange(B, device=vectors.device)
        g = vectors.new_zeros(B, T, D)  # [B, T, D] d read / d residual
        scale = self.final_scale if slot == self.num_layers else self.ffn_in_scale[slot]  # [T, D]
        g[rows, positions] = vectors * scale[positions]
        grads = vectors.new_zeros(B, slot + 1, T, D)
        for layer in reversed(range(min(slot + 1, self.num_layers))):
            if layer < slot:  # the read lies after this block's feed-forward output: it reaches it as it is
                grads[:, 1 + layer] = g
            g = g + self.attention_transposed(layer, g)  # through x + attention(x): back to resid_pre
        grads[:, 0] = g
        return grads


def replacement_of(model: K2Model, cache: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32
                   ) -> LocalReplacement:
    """The local replacement model of the prompt a run cached (``run_with_cache`` of one sequence, batch 1, with
    ``replacement_probes(model)``): the norms' denominators and the patterns it saw, frozen, and the model's weights
    of the attention's value path, in ``dtype``."""
    def rows(name: str) -> torch.Tensor:
        return cache[name][0].to(dtype)

    def norm_scale(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:  # x [T, D] -> weight / rms(x) [T, D]
        return norm.weight.to(dtype) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)

    parts: dict[str, list[torch.Tensor]] = {name: [] for name in (
        "attn_in_scale", "kv_scale", "w_kv", "w_uv", "w_o", "pattern", "ffn_in_scale")}
    for i, block in enumerate(model.layers):
        attn = block.self_attn
        C, H, V = attn.kv_lora_rank, attn.num_heads, attn.v_dim
        w_kv = attn.kv_a_proj_with_mqa.weight.to(dtype)[:C]  # [C, D]
        kv_before_norm = rows(f"layers.{i}.input_layernorm.hook_out") @ w_kv.T  # [T, C]
        w_b = attn.kv_b_proj.weight.to(dtype).view(H, attn.nope_dim + V, C)  # [H, N + V, C]
        parts["attn_in_scale"].append(norm_scale(block.input_layernorm, rows(f"layers.{i}.hook_resid_pre")))
        parts["kv_scale"].append(norm_scale(attn.kv_a_layernorm, kv_before_norm))
        parts["w_kv"].append(w_kv)
        parts["w_uv"].append(w_b[:, attn.nope_dim:])
        parts["w_o"].append(attn.o_proj.weight.to(dtype))
        parts["pattern"].append(rows(f"layers.{i}.self_attn.hook_pattern"))
        parts["ffn_in_scale"].append(norm_scale(block.post_attention_layernorm, rows(f"layers.{i}.hook_resid_mid")))
    last = rows(f"layers.{len(model.layers) - 1}.hook_resid_post")
    return LocalReplacement(**{name: torch.stack(values) for name, values in parts.items()},
                            final_scale=norm_scale(model.norm, last))


def replacement_probes(model: K2Model) -> list[str]:
    """What ``replacement_of`` and ``attribute`` read from the real forward: per block the residual before and after
    attention and after the block, the norms' outputs, the pattern and the feed-forward's output; the embeddings and
    each MoE layer's router logits."""
    names = ["embed_tokens.hook_out"]
    for i in range(len(model.layers)):
        names += [f"layers.{i}.{leaf}" for leaf in (
            "hook_resid_pre", "input_layernorm.hook_out", "self_attn.hook_pattern", "hook_resid_mid",
            "post_attention_layernorm.hook_out", "hook_mlp_out", "hook_resid_post")]
    names += [f"layers.{i}.mlp.gate.hook_logits" for i in moe_layers(model)]
    return names


# ---- the graph -----------------------------------------------------------------------------------------------------
@dataclass
class Target:
    """What the graph explains: the logit of ``tokens[0]`` at ``position``, minus that of ``tokens[1]`` when there
    are two (a logit difference)."""

    tokens: list[int]
    pieces: list[str]
    position: int
    value: float  # in the real forward

    @property
    def label(self) -> str:
        """'logit(" ")' or 'logit("]") - logit(")")'."""
        return " - ".join(f"logit({piece!r})" for piece in self.pieces)


@dataclass
class AttributionGraph:
    """An attribution graph of one prompt (see the module docstring). n nodes in the order: embeddings (one per
    position), features (by layer, position, feature index), errors (by layer, position), the target. Edges are
    direct effects, ``adjacency[t, s]`` the effect of node s on node t, in the units of t's pre-activation (rows of
    embeddings and errors are 0: they have no inputs). ``node_mask`` and ``edge_mask`` are the pruned graph's."""

    token_ids: list[int]  # [T]
    tokens: list[str]  # [T] the pieces, readable
    target: Target
    kind: torch.Tensor  # [n] int64: EMBEDDING, FEATURE, ERROR, TARGET
    layer: torch.Tensor  # [n] int64: the block (-1 for embeddings, L for the target)
    position: torch.Tensor  # [n] int64
    feature: torch.Tensor  # [n] int64: the feature index (-1 for other nodes)
    activation: torch.Tensor  # [n] a feature's activation; an error's or embedding's norm; the target's value
    adjacency: torch.Tensor  # [n, n] float32 direct effects, target node by source node
    bias: torch.Tensor  # [n] b_enc (features) plus the decoder biases' direct effect; 0 for sources
    pre_activation: torch.Tensor  # [n] features and target: the value in the real forward; NaN for sources
    router_read: torch.Tensor  # [n, L_moe, E] a feature's direct effect on later MoE routers' logits at its own
    # position (NaN for other nodes and for MoE layers at or before the feature's)
    router_layers: list[int]  # the MoE layers of router_read's second axis
    router_completeness: float  # the largest |sum of incoming effects + bias - real router logit| over every router
    influence: torch.Tensor | None = None  # [n] on the target, through the whole graph (set by prune)
    node_mask: torch.Tensor | None = None  # [n] bool, kept after pruning
    edge_mask: torch.Tensor | None = None  # [n, n] bool, kept after pruning
    node_threshold: float = 0.8
    edge_threshold: float = 0.98

    @property
    def num_nodes(self) -> int:
        """n, every node of the unpruned graph."""
        return len(self.kind)

    def completeness(self) -> torch.Tensor:
        """[n] per feature and the target: the sum of its incoming edges plus its bias minus its pre-activation in
        the real forward (0 up to float32 rounding); NaN for the sources."""
        return self.adjacency.double().sum(1) + self.bias.double() - self.pre_activation.double()

    def summary(self) -> dict:
        """Sizes before and after pruning, the share pruned, and the largest completeness error."""
        edges = self.adjacency != 0
        kept_edges = self.edge_mask & edges
        feature = self.kind == FEATURE
        error = self.completeness()
        scale = self.pre_activation[~error.isnan()].abs().max().item()
        return {"tokens": len(self.tokens), "nodes": self.num_nodes, "features": int(feature.sum()),
                "edges": int(edges.sum()), "kept_nodes": int(self.node_mask.sum()),
                "kept_features": int((self.node_mask & feature).sum()), "kept_edges": int(kept_edges.sum()),
                "pruned_node_share": 1 - self.node_mask.float().mean().item(),
                "pruned_edge_share": 1 - kept_edges.sum().item() / max(1, edges.sum().item()),
                "completeness_error": error.nan_to_num(0).abs().max().item(), "largest_pre_activation": scale,
                "router_completeness_error": self.router_completeness}

    def label(self, node: int) -> str:
        """A short name: 'emb 3 " ["', 'L2 f1234 @5', 'err L1 @5', 'logit(...)'."""
        kind, layer, position = int(self.kind[node]), int(self.layer[node]), int(self.position[node])
        if kind == EMBEDDING:
            return f"emb {position} {self.tokens[position]!r}"
        if kind == FEATURE:
            return f"L{layer} f{int(self.feature[node])} @{position}"
        if kind == ERROR:
            return f"err L{layer} @{position}"
        return self.target.label

    def total_effect(self) -> torch.Tensor:
        """[n] each node's whole effect on the target through the unpruned graph: its direct edge, plus its edges
        into features times their effect per unit of activation, and so on, every feature downstream answering
        linearly. Zeroing node s changes the target by minus entry s: the prediction ``check_by_ablation`` holds
        against the real model."""
        unit = torch.where(self.kind == FEATURE, self.activation.double(), 1.0)  # [n] a feature's activation
        per_unit = self.adjacency.double() / unit[None, :]  # [n, n] effect per unit of each source
        target = int((self.kind == TARGET).nonzero()[0])
        sensitivity = torch.zeros(self.num_nodes, dtype=torch.float64)
        step = per_unit[target]
        for _ in range(self.num_nodes):
            if not bool(step.any()):
                return (sensitivity * unit).float()
            sensitivity += step
            step = step @ per_unit
        raise RuntimeError("total_effect: the adjacency is not acyclic")

    def top_features(self, n: int = 10, kept_only: bool = True) -> list[int]:
        """The ``n`` feature nodes with the largest influence on the target (kept ones only, by default)."""
        candidates = (self.kind == FEATURE) & (self.node_mask if kept_only else True)
        scores = self.influence.masked_fill(~candidates, -1.0)
        order = scores.argsort(descending=True)[:min(n, int(candidates.sum()))]
        return order.tolist()


def node_influence(adjacency: torch.Tensor, target: int) -> torch.Tensor:
    """[n] each node's influence on node ``target``: w^T (A_hat + A_hat^2 + ...) with A_hat the absolute adjacency
    [n, n] normalised to sum 1 over each row's sources and w the target's indicator. The graph is acyclic, so the
    series ends after its depth."""
    normalised = adjacency.abs()
    normalised = normalised / normalised.sum(1, keepdim=True).clamp(min=1e-30)
    weight = torch.zeros(len(adjacency), dtype=normalised.dtype, device=adjacency.device)
    weight[target] = 1.0
    influence = torch.zeros_like(weight)
    step = weight @ normalised
    for _ in range(len(adjacency)):
        if not bool(step.any()):
            return influence
        influence += step
        step = step @ normalised
    raise RuntimeError("node_influence: the adjacency is not acyclic (influence did not die out)")


def _threshold_mask(scores: torch.Tensor, share: float) -> torch.Tensor:
    """[...] bool: the largest entries of ``scores`` (>= 0) that together carry ``share`` of their sum."""
    flat = scores.flatten()
    ordered = flat.sort(descending=True).values
    total = ordered.sum()
    if total <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    cumulative = ordered.cumsum(0) / total
    last = min(int(torch.searchsorted(cumulative, torch.tensor(share, dtype=cumulative.dtype))), len(ordered) - 1)
    return scores >= ordered[last]


def prune(graph: AttributionGraph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> AttributionGraph:
    """Set ``graph``'s influence, node_mask and edge_mask (the pruning of the module docstring) and return it."""
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0 < value <= 1:
            raise ValueError(f"{name} must lie in (0, 1] (the share of the influence kept), got {value!r}")
    kind, A = graph.kind, graph.adjacency
    target = int((kind == TARGET).nonzero()[0])
    influence = node_influence(A, target)
    candidates = (kind == FEATURE) | (kind == ERROR)
    keep = torch.zeros_like(candidates)
    keep[candidates] = _threshold_mask(influence[candidates], node_threshold)
    keep |= (kind == EMBEDDING) | (kind == TARGET)
    pruned = A * keep[:, None] * keep[None, :]
    normalised = pruned.abs() / pruned.abs().sum(1, keepdim=True).clamp(min=1e-30)
    weight = torch.zeros_like(influence)
    weight[target] = 1.0
    edge_scores = normalised * (node_influence(pruned, target) + weight)[:, None]
    edges = _threshold_mask(edge_scores, edge_threshold) & (pruned != 0)
    while True:  # drop features without a kept edge in or out, errors without one out, and their edges
        has_out, has_in = edges.any(0), edges.any(1)
        still = keep & torch.where(kind == FEATURE, has_out & has_in, torch.where(kind == ERROR, has_out, True))
        if bool((still == keep).all()):
            break
        keep = still
        edges &= keep[:, None] & keep[None, :]
    graph.influence, graph.node_mask, graph.edge_mask = influence, keep, edges
    graph.node_threshold, graph.edge_threshold = node_threshold, edge_threshold
    return graph


# ---- building a graph ----------------------------------------------------------------------------------------------
def nano_transcoders() -> list[nn.Module]:
    """The transcoders k2lab ships for K2-nano, one per block in order: block 0's dense MLP, blocks 1-5's MoE
    (``transcoder_nano_l{L}_mlp|moe`` of ``k2lab.analysis.dictionary.shipped()``)."""
    from . import dictionary

    found = {int(name.split("_")[2][1:]): name for name in dictionary.shipped()
             if name.startswith("transcoder_nano_l")}
    missing = [layer for layer in range(max(found, default=-1) + 1) if layer not in found]
    if not found or missing:
        raise FileNotFoundError(f"the shipped transcoders do not cover every block of K2-nano (found {sorted(found)}, "
                                f"missing {missing}); train them with python scripts/train_dictionaries.py")
    return [dictionary.load_shipped(found[layer]) for layer in sorted(found)]


def _transcoder_list(model: K2Model, transcoders: Sequence[nn.Module] | Mapping[int, nn.Module]) -> list[nn.Module]:
    """One transcoder per block, in block order, each reading and writing the model's width."""
    L, D = len(model.layers), model.config.hidden_size
    if isinstance(transcoders, Mapping):
        missing = [layer for layer in range(L) if layer not in transcoders]
        if missing:
            raise ValueError(f"transcoders must replace every feed-forward block (0..{L - 1}); none given for "
                             f"{missing}: the replacement model has no other way to compute them")
        transcoders = [transcoders[layer] for layer in range(L)]
    elif not isinstance(transcoders, Sequence) or len(transcoders) != L:
        got = len(transcoders) if isinstance(transcoders, Sequence) else type(transcoders).__name__
        raise ValueError(f"transcoders must be one per block ({L}: a list in block order or {{layer: transcoder}}), "
                         f"got {got}")
    for layer, tc in enumerate(transcoders):
        if not all(isinstance(getattr(tc, name, None), torch.Tensor) for name in ("W_enc", "b_enc", "W_dec", "b_dec")) \
                or not callable(getattr(tc, "encode", None)):
            raise TypeError(f"transcoders[{layer}] must be a transcoder with encode() and W_enc, b_enc, W_dec, b_dec "
                            f"(k2lab's Transcoder or SAELens's); got {type(tc).__name__}")
        if tc.W_enc.shape[0] != D or tc.W_dec.shape[1] != D:
            raise ValueError(f"transcoders[{layer}] maps {tc.W_enc.shape[0]} -> {tc.W_dec.shape[1]} wide; the "
                             f"model is {D} wide")
        metadata = getattr(tc, "metadata", {})
        want = (f"layers.{layer}.post_attention_layernorm.hook_out", f"layers.{layer}.hook_mlp_out")
        have = (metadata.get("hook_name", want[0]), metadata.get("hook_name_out", want[1]))
        if have != want:
            raise ValueError(f"transcoders[{layer}] was trained on {have[0]} -> {have[1]}, not block {layer}'s "
                             f"feed-forward ({want[0]} -> {want[1]})")
    return list(transcoders)


def _resolve_target(model: K2Model, logits: torch.Tensor, target: TargetSpec, position: int) -> Target:
    """``target`` (a token id or a one-token string, a pair of them, or None for the top prediction) at
    ``position`` of the real forward's logits [T, V]."""
    V = logits.shape[-1]
    T = logits.shape[0]
    if isinstance(position, bool) or not isinstance(position, int) or not -T <= position < T:
        raise ValueError(f"position must be an int in {-T}..{T - 1} (the prompt has {T} tokens), got {position!r}")
    position %= T
    if target is None:
        tokens = [int(logits[position].argmax())]
    else:
        specs = list(target) if isinstance(target, tuple | list) else [target]
        if len(specs) not in (1, 2):
            raise ValueError(f"target must be a token, or a pair (a, b) for logit(a) - logit(b); got {target!r}")
        tokens = [_token_id(model, spec, V) for spec in specs]
        if len(tokens) == 2 and tokens[0] == tokens[1]:
            raise ValueError(f"target {target!r} names the same token twice: its logit difference is 0")
    tokenizer = model.tokenizer
    pieces = [tokenizer.id_to_piece(t) if tokenizer is not None else str(t) for t in tokens]
    value = logits[position, tokens[0]] - (logits[position, tokens[1]] if len(tokens) == 2 else 0)
    return Target(tokens, pieces, position, float(value))


def _token_id(model: K2Model, spec: int | str, vocab: int) -> int:
    if isinstance(spec, str):
        ids = model.require_tokenizer("a target given as text").encode(spec)
        if len(ids) != 1:
            pieces = [model.tokenizer.id_to_piece(i) for i in ids]
            raise ValueError(f"target {spec!r} is {len(ids)} tokens {pieces}, not one: give a token id or one token's "
                             f"text")
        return ids[0]
    if isinstance(spec, bool) or not isinstance(spec, int) or not 0 <= spec < vocab:
        raise ValueError(f"a target token must be an id in 0..{vocab - 1} or one token's text, got {spec!r}")
    return spec


@torch.no_grad()
def attribute(model: K2Model, transcoders: Sequence[nn.Module] | Mapping[int, nn.Module],
              prompt: str | Sequence[int] | torch.Tensor, target: TargetSpec = None, *, position: int = -1,
              node_threshold: float = 0.8, edge_threshold: float = 0.98, max_nodes: int = 20_000
              ) -> AttributionGraph:
    """The attribution graph of ``prompt`` (text, or ids [T] / [1, T]) for ``target`` at ``position`` (default the
    last): a token (id or one token's text), a pair (a, b) for logit(a) - logit(b), or None for the model's top
    prediction. ``transcoders``: one per block, in block order or as {layer: transcoder} (``nano_transcoders()``
    for K2-nano). Pruned with ``node_threshold`` and ``edge_threshold`` (``prune``); refused when it would hold more
    than ``max_nodes`` nodes (the adjacency is dense: n^2 floats). The module docstring gives the method."""
    transcoders = _transcoder_list(model, transcoders)
    ids = torch.as_tensor(model.to_tokens(prompt) if isinstance(prompt, str) else prompt)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"prompt must be one sequence: text, or ids [T] or [1, T]; got shape {list(ids.shape)}")
    dtype = torch.float64 if model.dtype == torch.float64 else torch.float32
    logits, cache = model.run_with_cache(ids, names=replacement_probes(model))
    target_spec = _resolve_target(model, logits[0], target, position)
    L, T, D = len(model.layers), ids.shape[1], model.config.hidden_size
    rows = {name: cache[name][0].to(dtype) for name in cache.keys()}
    device = rows["embed_tokens.hook_out"].device

    # The nodes: features read from each block's real input, errors what each block wrote beyond its transcoder.
    active, values, errors = [], [], []  # per layer: [T, F] bool, [T, F] activations; errors [T, D]
    for layer, tc in enumerate(transcoders):
        x = rows[f"layers.{layer}.post_attention_layernorm.hook_out"]  # [T, D]
        a = tc.encode(x.to(tc.W_enc.dtype)).to(dtype)  # [T, F]
        pre = x @ tc.W_enc.to(dtype) + tc.b_enc.to(dtype)  # [T, F]
        on = a > 0
        if not torch.allclose(a[on], pre[on], rtol=1e-4, atol=1e-5):
            raise ValueError(f"transcoders[{layer}]'s active features are not their pre-activations x W_enc + b_enc: "
                             f"attribution needs a ReLU, TopK or JumpReLU transcoder without an input bias")
        active.append(on)
        values.append(a)
        errors.append(rows[f"layers.{layer}.hook_mlp_out"] - (a @ tc.W_dec.to(dtype) + tc.b_dec.to(dtype)))
    where = [on.nonzero() for on in active]  # per layer [n_l, 2] (position, feature), by position then feature
    num_features = sum(len(w) for w in where)
    n = T + num_features + L * T + 1
    if n > max_nodes:
        raise ValueError(f"this graph would hold {n:,} nodes ({num_features:,} active features over {T} tokens), "
                         f"more than max_nodes={max_nodes:,}: its adjacency alone takes n^2 floats. Shorten the "
                         f"prompt or raise max_nodes")
    replacement = replacement_of(model, cache, dtype)
    embed = rows["embed_tokens.hook_out"]  # [T, D]
    sources = torch.stack([embed, *(rows[f"layers.{i}.hook_mlp_out"] for i in range(L))])  # [L + 1, T, D]
    _check_replacement(model, replacement, sources, rows)

    # Node bookkeeping: the order of the AttributionGraph docstring.
    starts = [T + sum(len(w) for w in where[:layer]) for layer in range(L)]
    error_start, target_node = T + num_features, n - 1
    kind = torch.full((n,), FEATURE, dtype=torch.long)
    kind[:T], kind[error_start:target_node], kind[target_node] = EMBEDDING, ERROR, TARGET
    layer_of = torch.cat([torch.full((T,), -1), *(torch.full((len(w),), i) for i, w in enumerate(where)),
                          torch.arange(L).repeat_interleave(T), torch.tensor([L])])
    position_of = torch.cat([torch.arange(T), *(w[:, 0].cpu() for w in where), torch.arange(T).repeat(L),
                             torch.tensor([target_spec.position])])
    feature_of = torch.cat([torch.full((T,), -1), *(w[:, 1].cpu() for w in where), torch.full((L * T + 1,), -1)])
    error_stack = torch.stack(errors)  # [L, T, D]
    activation = torch.cat([embed.norm(dim=-1), *(values[i][w[:, 0], w[:, 1]] for i, w in enumerate(where)),
                            error_stack.norm(dim=-1).flatten(),
                            torch.tensor([target_spec.value], dtype=dtype, device=device)])
    # Per layer, the active features' decoder vectors a_f W_dec[f] padded per position to K slots, and their nodes.
    K = max([int(on.sum(-1).max()) for on in active] + [1])
    decoders = torch.zeros(L, T, K, D, dtype=dtype, device=device)  # [L, T, K, D]
    columns = torch.full((L, T, K), -1, dtype=torch.long, device=device)  # [L, T, K] node index, -1 for padding
    for layer, w in enumerate(where):
        slot = torch.cat([torch.arange(int(c), device=device) for c in active[layer].sum(-1)])  # [n_l] place in cell
        vectors = values[layer][w[:, 0], w[:, 1], None] * transcoders[layer].W_dec.to(dtype)[w[:, 1]]  # [n_l, D]
        decoders[layer, w[:, 0], slot] = vectors
        columns[layer, w[:, 0], slot] = starts[layer] + torch.arange(len(w), device=device)
    b_dec = torch.stack([tc.b_dec.to(dtype) for tc in transcoders])  # [L, D]

    adjacency = torch.zeros(n, n, dtype=dtype, device=device)  # computed where the model is, kept on the CPU
    bias = torch.zeros(n, dtype=dtype, device=device)
    pre_activation = torch.full((n,), float("nan"), dtype=dtype, device=device)

    def fill_rows(nodes: torch.Tensor, slot: int, positions: torch.Tensor, vectors: torch.Tensor) -> None:
        """Incoming edges and bias of ``nodes`` [B], each reading u . reads[slot, position]."""
        grads = replacement.read_gradients(slot, positions, vectors)  # [B, slot + 1, T, D]
        adjacency[nodes, :T] = torch.einsum("btd,td->bt", grads[:, 0], embed)
        for source in range(min(slot, L)):
            g = grads[:, 1 + source]  # [B, T, D] at block ``source``'s feed-forward output
            per_slot = torch.einsum("btd,tkd->btk", g, decoders[source])  # [B, T, K]
            valid = columns[source] >= 0  # [T, K]
            adjacency[nodes[:, None], columns[source][valid][None, :]] = per_slot[:, valid]
            adjacency[nodes, error_start + source * T:error_start + (source + 1) * T] = \
                torch.einsum("btd,td->bt", g, error_stack[source])
            bias[nodes] += torch.einsum("btd,d->b", g, b_dec[source])

    for layer, w in enumerate(where):  # feature rows: u = the encoder's column
        encoder = transcoders[layer].W_enc.to(dtype)  # [D, F]
        for chunk in torch.arange(len(w), device=device).split(ROW_BATCH):
            nodes = starts[layer] + chunk
            fill_rows(nodes, layer, w[chunk, 0], encoder[:, w[chunk, 1]].T)
            bias[nodes] += transcoders[layer].b_enc.to(dtype)[w[chunk, 1]]
            pre_activation[nodes] = values[layer][w[chunk, 0], w[chunk, 1]]
    unembed = model.lm_head.weight[target_spec.tokens].to(dtype)  # [1 or 2, D]
    direction = unembed[0] - unembed[1] if len(unembed) == 2 else unembed[0]
    fill_rows(torch.tensor([target_node], device=device), L, torch.tensor([target_spec.position], device=device),
              direction[None])
    pre_activation[target_node] = target_spec.value

    router_layers = moe_layers(model)
    router_read, router_completeness = _router_reads(model, replacement, router_layers, decoders, columns, sources,
                                                     rows, n)
    graph = AttributionGraph(
        token_ids=ids[0].tolist(), tokens=_pieces(model, ids[0]), target=target_spec, kind=kind, layer=layer_of,
        position=position_of, feature=feature_of, activation=activation.cpu(), adjacency=adjacency.cpu(),
        bias=bias.cpu(), pre_activation=pre_activation.cpu(), router_read=router_read.cpu(),
        router_layers=router_layers, router_completeness=router_completeness)
    return prune(graph, node_threshold, edge_threshold)


def _router_reads(model: K2Model, replacement: LocalReplacement, router_layers: list[int], decoders: torch.Tensor,
                  columns: torch.Tensor, sources: torch.Tensor, rows: Mapping[str, torch.Tensor], n: int
                  ) -> tuple[torch.Tensor, float]:
    """Each feature node's direct effect on the router logits of every later MoE layer at its own position:
    [n, L_moe, E] (NaN elsewhere), and the largest completeness error over every router logit (the sum of all its
    incoming effects, decoder biases included, against the real forward's)."""
    T, dtype = sources.shape[1], sources.dtype
    E = model.config.n_routed_experts
    read = torch.full((n, len(router_layers), E), float("nan"), dtype=dtype, device=sources.device)
    worst = 0.0
    per_batch = max(1, ROW_BATCH // E)  # positions per batch of rows
    for j, m in enumerate(router_layers):
        gate = model.layers[m].mlp.gate.weight.to(dtype)  # [E, D]
        real = rows[f"layers.{m}.mlp.gate.hook_logits"]  # [T, E]
        for positions in torch.arange(T, device=sources.device).split(per_batch):
            P = len(positions)
            grads = replacement.read_gradients(m, positions.repeat_interleave(E), gate.repeat(P, 1))
            grads = grads.view(P, E, m + 1, T, -1)  # [P, E, m + 1, T, D]
            total = torch.einsum("pestd,std->pe", grads, sources[:m + 1])  # [P, E] every source's effect, summed
            worst = max(worst, (total - real[positions]).abs().max().item())
            own = grads[torch.arange(P, device=grads.device), :, :, positions]  # [P, E, m + 1, D] own position
            for source in range(m):
                effect = torch.einsum("ped,pkd->pke", own[:, :, 1 + source], decoders[source, positions])  # [P,K,E]
                valid = columns[source, positions] >= 0  # [P, K]
                read[columns[source, positions][valid], j] = effect[valid]
    return read, worst


def _check_replacement(model: K2Model, replacement: LocalReplacement, sources: torch.Tensor,
                       rows: Mapping[str, torch.Tensor]) -> None:
    """The frozen linear forward must give back what the real forward read (each block's feed-forward input),
    else the graph would explain another computation: refuse, naming the block."""
    reads = replacement.forward(sources[None])[0]  # [L + 1, T, D]
    for layer in range(len(model.layers)):
        real = rows[f"layers.{layer}.post_attention_layernorm.hook_out"]
        error = (reads[layer] - real).abs().max().item()
        if error > 1e-3 * max(1.0, real.abs().max().item()):
            raise RuntimeError(f"the local replacement model does not reproduce block {layer}'s feed-forward input "
                               f"(largest error {error:.3g}): this model computes something the replacement does not "
                               f"describe (a hook attached, a padded or cached forward?)")


def _pieces(model: K2Model, ids: torch.Tensor) -> list[str]:
    tokenizer = model.tokenizer
    return [tokenizer.id_to_piece(int(i)) if tokenizer is not None else str(int(i)) for i in ids]


# ---- the graph against the real model ------------------------------------------------------------------------------
@dataclass
class AblationCheck:
    """Feature nodes zeroed in the real model (each alone, then all together), the target's change against two
    predictions of the graph: minus the node's direct edge into the target, and minus its ``total_effect`` (every
    path, the features downstream answering linearly; for all together, the sum)."""

    nodes: list[int]
    labels: list[str]
    predicted_direct: torch.Tensor  # [N] change of the target: the direct edge only
    predicted_total: torch.Tensor  # [N] change of the target: through the whole graph, linearly
    measured: torch.Tensor  # [N] change of the target, in the real model
    joint_predicted: float  # all N zeroed together: the sum of the total effects
    joint_measured: float

    def sign_agreement(self, prediction: str = "total") -> float:
        """The share of the nodes whose measured change has the predicted sign (``prediction``: "total" or
        "direct")."""
        return (torch.sign(self._prediction(prediction)) == torch.sign(self.measured)).float().mean().item()

    def correlation(self, prediction: str = "total") -> float:
        """Pearson's r between predicted (``prediction``: "total" or "direct") and measured changes over the nodes
        (NaN for fewer than 2)."""
        if len(self.nodes) < 2:
            return float("nan")
        return torch.corrcoef(torch.stack([self._prediction(prediction), self.measured]).double())[0, 1].item()

    def _prediction(self, which: str) -> torch.Tensor:
        if which not in ("total", "direct"):
            raise ValueError(f"prediction must be 'total' or 'direct', got {which!r}")
        return self.predicted_total if which == "total" else self.predicted_direct

    def __str__(self) -> str:
        return (f"{len(self.nodes)} features zeroed one at a time, the measured change against the graph's "
                f"prediction: total effect: same sign for {self.sign_agreement('total'):.0%}, r = "
                f"{self.correlation('total'):.2f}; direct edge: same sign for {self.sign_agreement('direct'):.0%}, "
                f"r = {self.correlation('direct'):.2f}. All together: predicted {self.joint_predicted:+.2f}, "
                f"measured {self.joint_measured:+.2f}")


@torch.no_grad()
def ablate_features(model: K2Model, transcoders: Sequence[nn.Module] | Mapping[int, nn.Module],
                    graph: AttributionGraph, nodes: Sequence[int]) -> float:
    """The target's value in the real model with the feature ``nodes`` of ``graph`` zeroed at their positions:
    each block's transcoder spliced in with its error kept (``interventions.splice(..., keep_error=True)``), so the
    rest of the forward, the routers and experts included, is the model's own."""
    from .splicing import splice

    transcoders = _transcoder_list(model, transcoders)
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for node in nodes:
        if int(graph.kind[node]) != FEATURE:
            raise ValueError(f"node {node} is {KIND_NAMES[int(graph.kind[node])]} {graph.label(node)!r}, not a "
                             "feature: only features can be zeroed")
        by_layer.setdefault(int(graph.layer[node]), []).append((int(graph.position[node]), int(graph.feature[node])))
    ids = torch.tensor([graph.token_ids], device=model.device)
    with ExitStack() as stack:
        for layer, zeroed in by_layer.items():
            probe = (f"layers.{layer}.post_attention_layernorm.hook_out", f"layers.{layer}.hook_mlp_out")
            features = stack.enter_context(splice(model, probe, transcoders[layer], keep_error=True))
            positions, indices = (torch.tensor(column) for column in zip(*zeroed, strict=True))

            def zero(f: torch.Tensor, hook, positions=positions, indices=indices) -> torch.Tensor:  # f [1, T, F]
                f = f.clone()
                f[0, positions, indices] = 0
                return f

            stack.enter_context(model.hooks(fwd_hooks=[(features.name, zero)]))
        logits = model(ids)[0, graph.target.position]  # [V]
    tokens = graph.target.tokens
    return (logits[tokens[0]] - (logits[tokens[1]] if len(tokens) == 2 else 0)).item()


def check_by_ablation(model: K2Model, transcoders: Sequence[nn.Module] | Mapping[int, nn.Module],
                      graph: AttributionGraph, n: int = 10) -> AblationCheck:
    """Zero the ``n`` kept features of largest influence in the real model (``ablate_features``), each alone and
    then all together, and hold the target's change against the graph's predictions (the direct edge, and
    ``total_effect``). The total effect treats every downstream feature as linear; a feature pushed below zero stops
    at zero (ReLU) or leaves the top k, so the total effect of an early feature overstates what zeroing it does."""
    nodes = graph.top_features(n)
    if not nodes:
        raise ValueError("the pruned graph keeps no feature node: nothing to ablate")
    effect = graph.total_effect()
    target = int((graph.kind == TARGET).nonzero()[0])
    clean = graph.target.value
    measured = torch.tensor([ablate_features(model, transcoders, graph, [node]) - clean for node in nodes])
    joint = ablate_features(model, transcoders, graph, nodes) - clean
    return AblationCheck(nodes, [graph.label(node) for node in nodes], -graph.adjacency[target, nodes].float(),
                         -effect[nodes].float(), measured.float(), -effect[nodes].sum().item(), joint)


@torch.no_grad()
def top_activations(model: K2Model, transcoders: Sequence[nn.Module] | Mapping[int, nn.Module],
                    graph: AttributionGraph, texts: Sequence[str], n: int = 5, max_len: int = 256,
                    context: int = 6) -> dict[tuple[int, int], list[str]]:
    """For each kept feature node of ``graph``, ``(layer, feature)`` -> the ``n`` contexts in ``texts`` where the
    feature is most active, each the ``context`` tokens before and the token itself in brackets, with its
    activation: ``'...return x + [y] (3.2)'``. What the figure's hover shows."""
    from .datasets import batches
    from .features import record_probes

    transcoders = _transcoder_list(model, transcoders)
    wanted = sorted({(int(graph.layer[i]), int(graph.feature[i]))
                     for i in (graph.node_mask & (graph.kind == FEATURE)).nonzero()[:, 0].tolist()})
    if not wanted:
        return {}
    layers = sorted({layer for layer, _ in wanted})
    best: dict[tuple[int, int], list[tuple[float, list[int], int]]] = {key: [] for key in wanted}
    names = [f"layers.{layer}.post_attention_layernorm.hook_out" for layer in layers]
    for ids, mask in batches(model, list(texts), max_len=max_len, padding_side="right", progress=False):
        cache = record_probes(model, ids, names, attention_mask=mask)  # the forward stops after the last block read
        for layer, name in zip(layers, names, strict=True):
            tc = transcoders[layer]
            features = tc.encode(cache[name].to(tc.W_enc.dtype)).float()  # [B, T, F]
            features = features * mask[..., None].to(features.dtype)
            for key in [k for k in wanted if k[0] == layer]:
                column = features[..., key[1]]  # [B, T]
                top = column.flatten().topk(min(n, column.numel()))
                for value, flat in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                    if value > 0:
                        row, t = divmod(flat, column.shape[1])
                        best[key].append((value, ids[row, max(0, t - context):t + 1].tolist(), t))
    pieces = model.require_tokenizer("top_activations").id_to_piece
    out = {}
    for key, found in best.items():
        found.sort(key=lambda item: -item[0])
        out[key] = ["".join(pieces(i) for i in window[:-1]) + f"[{pieces(window[-1])}] ({value:.1f})"
                    for value, window, _ in found[:n]]
    return out
