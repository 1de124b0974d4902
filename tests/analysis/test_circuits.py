"""Attribution graphs (k2lab/analysis/circuits.py): the local replacement model against the real forward and against
autograd, a toy model's edges against a hand computation, completeness on every node of a real K2-nano graph, the
pruning and the graph's predictions against ablations in the real model, and the refusals."""

from __future__ import annotations

import pytest
import torch
from tiny import MICRO, TINY, random_model, token_ids

from k2lab.analysis import circuits
from k2lab.analysis.circuits import EMBEDDING, ERROR, FEATURE, TARGET
from k2lab.analysis.dictionary import Transcoder

pytestmark = pytest.mark.usefixtures("no_grad")

NANO_PROMPT = 'x = ["a", "b'  # K2-nano closes the string with `",` (58%) rather than `',`


def random_transcoders(model, d_sae: int = 24, k: int = 3, seed: int = 0) -> list[Transcoder]:
    """One random TopK transcoder per block of ``model``, in its dtype, most features active somewhere."""
    D, g = model.config.hidden_size, torch.Generator().manual_seed(seed)
    out = []
    for layer in range(len(model.layers)):
        tc = Transcoder(D, D, d_sae, k, {"hook_name": f"layers.{layer}.post_attention_layernorm.hook_out",
                                         "hook_name_out": f"layers.{layer}.hook_mlp_out"}).to(model.dtype)
        for p in tc.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        tc.b_enc += 1.0
        out.append(tc)
    return out


@pytest.fixture(scope="module")
def nano():
    import k2lab

    return k2lab.load_nano()


@pytest.fixture(scope="module")
def nano_graph(nano):
    model, _ = nano
    transcoders = circuits.nano_transcoders()
    return transcoders, circuits.attribute(model, transcoders, NANO_PROMPT, target=('",', "',"))


def test_the_replacement_reproduces_the_forward_and_its_transpose_is_autograds():
    model = random_model(TINY, seed=1)
    ids = token_ids(TINY, batch=1, length=9)
    _, cache = model.run_with_cache(ids, names=circuits.replacement_probes(model) + ["norm.hook_out"])
    replacement = circuits.replacement_of(model, cache)
    L = len(model.layers)
    sources = torch.stack([cache["embed_tokens.hook_out"][0]] + [cache[f"layers.{i}.hook_mlp_out"][0]
                                                                 for i in range(L)])  # [L + 1, T, D]
    reads = replacement.forward(sources[None])[0]
    for i in range(L):
        torch.testing.assert_close(reads[i], cache[f"layers.{i}.post_attention_layernorm.hook_out"][0],
                                   rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reads[L], cache["norm.hook_out"][0], rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(3)
    for slot in range(L + 1):
        positions = torch.tensor([0, 4, 8, 8])
        vectors = torch.randn(4, TINY.hidden_size, generator=g)
        with torch.enable_grad():
            leaf = sources[None].repeat(4, 1, 1, 1).requires_grad_()
            out = replacement.forward(leaf)[torch.arange(4), slot, positions]  # [4, D]
            (want,) = torch.autograd.grad((out * vectors).sum(), leaf)
        got = replacement.read_gradients(slot, positions, vectors)
        torch.testing.assert_close(got, want[:, :slot + 1], rtol=1e-5, atol=1e-6)
        if slot < L:
            assert want[:, slot + 1:].abs().max() == 0  # later sources never reach the read


def _hand_made_toy():
    """MICRO in float64 (block 0 dense, block 1 MoE) with block 0's attention writing nothing, random transcoders."""
    model = random_model(MICRO, seed=2).double()
    model.layers[0].self_attn.o_proj.weight.zero_()
    return model, random_transcoders(model, d_sae=16, k=3, seed=5)


def test_a_toy_models_edges_equal_the_hand_computed_ones():
    """Block 0's attention is silenced, so a source reaches block 1 through the residual (same position) and block
    1's attention only: with x the source vector at position p', the read at p is
    u . (s[p] * (x [p == p'] + sum_h pattern_h[p, p'] W_O,h W_UV,h (c[p'] * W_KV (a[p'] * x))))
    with a, c, s the frozen norm scales (weight / rms). Computed here from the weights and the cache, not through
    k2lab's replacement."""
    model, transcoders = _hand_made_toy()
    ids = token_ids(MICRO, batch=1, length=5, seed=4)
    graph = circuits.attribute(model, transcoders, ids[0], target=(3, 7), position=3)
    _, cache = model.run_with_cache(ids, names=circuits.replacement_probes(model) + ["norm.hook_out"])
    c = {name: value[0].double() for name, value in cache.items()}
    attn, block = model.layers[1].self_attn, model.layers[1]
    H, V, C, N = attn.num_heads, attn.v_dim, attn.kv_lora_rank, attn.nope_dim

    def scale(norm, x):  # weight / rms(x), per position
        return norm.weight / (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()

    a_in = scale(block.input_layernorm, c["layers.1.hook_resid_pre"])  # [T, D]
    w_kv = attn.kv_a_proj_with_mqa.weight[:C]
    c_kv = scale(attn.kv_a_layernorm, c["layers.1.input_layernorm.hook_out"] @ w_kv.T)  # [T, C]
    w_uv = attn.kv_b_proj.weight.view(H, N + V, C)[:, N:]  # [H, V, C]
    w_o = attn.o_proj.weight.view(-1, H, V)  # [D, H, V]
    pattern = c["layers.1.self_attn.hook_pattern"]  # [H, T, T]
    s1 = scale(block.post_attention_layernorm, c["layers.1.hook_resid_mid"])
    s0 = scale(model.layers[0].post_attention_layernorm, c["layers.0.hook_resid_mid"])
    s_final = scale(model.norm, c["layers.1.hook_resid_post"])

    def path(p: int, q: int) -> torch.Tensor:  # [D, D]: a source vector at q -> resid_mid of block 1 at p
        through = sum(pattern[h, p, q] * w_o[:, h] @ w_uv[h] @ torch.diag(c_kv[q]) @ w_kv @ torch.diag(a_in[q])
                      for h in range(H))
        return through + (torch.eye(MICRO.hidden_size, dtype=torch.float64) if p == q else 0)

    T = ids.shape[1]
    embed = c["embed_tokens.hook_out"]
    feature0 = transcoders[0].encode(c["layers.0.post_attention_layernorm.hook_out"])  # [T, F]
    errors0 = c["layers.0.hook_mlp_out"] - transcoders[0](c["layers.0.post_attention_layernorm.hook_out"])
    feature1 = transcoders[1].encode(c["layers.1.post_attention_layernorm.hook_out"])
    errors1 = c["layers.1.hook_mlp_out"] - transcoders[1](c["layers.1.post_attention_layernorm.hook_out"])

    def node(kind, layer, position, feature=-1) -> int:
        match = (graph.kind == kind) & (graph.layer == layer) & (graph.position == position) & \
            (graph.feature == feature)
        (index,) = match.nonzero()[:, 0].tolist()
        return index

    def expected_row(read: torch.Tensor, p: int, paths: bool, later: torch.Tensor | None) -> torch.Tensor:
        """The row of a node reading ``read`` [D] (already through its norm scale) at position p."""
        row = torch.zeros(graph.num_nodes, dtype=torch.float64)
        for q in range(T):
            w = (path(p, q).T @ read) if paths else (read if q == p else torch.zeros_like(read))
            row[node(EMBEDDING, -1, q)] = embed[q] @ w
            if paths:  # block 0's outputs sit before block 1's attention
                row[node(ERROR, 0, q)] = errors0[q] @ w
                for f in feature0[q].nonzero()[:, 0].tolist():
                    row[node(FEATURE, 0, q, f)] = feature0[q, f] * transcoders[0].W_dec[f] @ w
            if later is not None and q == p:  # block 1's outputs reach the final norm at their own position
                row[node(ERROR, 1, q)] = errors1[q] @ read
                for f in feature1[q].nonzero()[:, 0].tolist():
                    row[node(FEATURE, 1, q, f)] = feature1[q, f] * transcoders[1].W_dec[f] @ read
        return row

    checked = 0
    for p in range(T):
        for f in feature1[p].nonzero()[:, 0].tolist():  # block 1's features: both paths
            want = expected_row(transcoders[1].W_enc[:, f] * s1[p], p, paths=True, later=None)
            torch.testing.assert_close(graph.adjacency[node(FEATURE, 1, p, f)], want, rtol=1e-9, atol=1e-12)
            checked += 1
        for f in feature0[p].nonzero()[:, 0].tolist():  # block 0's features: the embedding at their position only
            want = expected_row(transcoders[0].W_enc[:, f] * s0[p], p, paths=False, later=None)
            torch.testing.assert_close(graph.adjacency[node(FEATURE, 0, p, f)], want, rtol=1e-9, atol=1e-12)
            checked += 1
    unembed = model.lm_head.weight
    want = expected_row((unembed[3] - unembed[7]) * s_final[3], 3, paths=True, later=True)
    torch.testing.assert_close(graph.adjacency[node(TARGET, 2, 3)], want, rtol=1e-9, atol=1e-12)
    assert checked == int((graph.kind == FEATURE).sum()) > 20


def test_a_toy_models_router_read_is_the_edge_into_the_router_logits():
    """Block 0's features reach block 1's router logits W_gate (s1 * x) through the residual and block 1's
    attention: at their own position that is the same hand computation as above, with the router's rows as u."""
    model, transcoders = _hand_made_toy()
    ids = token_ids(MICRO, batch=1, length=5, seed=4)
    graph = circuits.attribute(model, transcoders, ids[0])
    reference = circuits.attribute(model.float(), [tc.float() for tc in transcoders], ids[0])
    for g in (graph, reference):
        assert g.router_layers == [1]
    features0 = ((graph.kind == FEATURE) & (graph.layer == 0)).nonzero()[:, 0]
    assert not graph.router_read[features0].isnan().any()
    assert graph.router_read[(graph.kind != FEATURE) | (graph.layer == 1)].isnan().all()
    # float32 and float64 agree: the read does not hang on rounding
    torch.testing.assert_close(reference.router_read[features0].double(), graph.router_read[features0],
                               rtol=1e-4, atol=1e-5)
    assert graph.router_completeness < 1e-5  # router logits are float32 in the real model


def test_every_node_of_a_real_graph_is_complete(nano_graph):
    """Incoming edges plus bias equal the pre-activation in the real forward on every feature and the target of a
    K2-nano graph with the shipped transcoders, to float32 rounding."""
    _, graph = nano_graph
    error = graph.completeness()
    receivers = (graph.kind == FEATURE) | (graph.kind == TARGET)
    assert not error[receivers].isnan().any() and error[~receivers].isnan().all()
    largest = graph.pre_activation[receivers].abs().max().item()
    assert error[receivers].abs().max().item() <= 1e-5 * max(1.0, largest)
    assert graph.router_completeness <= 1e-5 * max(1.0, largest)
    # Not a tautology: the sum is spread over many sources, and the real value comes from the real forward.
    assert (graph.adjacency[receivers] != 0).sum(1).float().mean() > 50
    s = graph.summary()
    assert s["features"] > 1000 and 0 < s["kept_features"] < s["features"] and s["kept_edges"] < s["edges"]


def test_ablating_the_top_features_moves_the_target_the_graphs_way(nano, nano_graph):
    model, _ = nano
    transcoders, graph = nano_graph
    check = circuits.check_by_ablation(model, transcoders, graph, n=20)
    assert len(check.nodes) == 20
    # measured on this prompt (one thread): total effect same sign 95%, r 0.65; direct edge same sign 90%, r 0.87
    assert check.sign_agreement("total") >= 0.8 and check.sign_agreement("direct") >= 0.8, str(check)
    assert check.correlation("direct") >= 0.7 and check.correlation("total") >= 0.4, str(check)
    assert check.joint_measured * check.joint_predicted > 0 and abs(check.joint_measured) > 1.0
    with pytest.raises(ValueError, match="prediction must be 'total' or 'direct'"):
        check.correlation("both")


def test_pruning_keeps_the_stated_share_of_influence(nano_graph):
    _, graph = nano_graph
    candidates = (graph.kind == FEATURE) | (graph.kind == ERROR)
    total = graph.influence[candidates].sum()
    for threshold in (0.5, 0.8, 0.95):
        circuits.prune(graph, node_threshold=threshold, edge_threshold=1.0)
        # before the clean-up of nodes left without edges, the kept candidates carry at least the threshold
        kept_share = graph.influence[candidates & graph.node_mask].sum() / total
        assert kept_share >= threshold - 0.05
    circuits.prune(graph)  # as the fixture had it
    assert graph.node_mask[(graph.kind == EMBEDDING) | (graph.kind == TARGET)].all()
    assert not (graph.edge_mask & ~graph.node_mask[:, None]).any()


def test_influence_on_a_hand_made_graph():
    """A -> B -> target and A -> target: |row| normalisation then the sum of paths."""
    A = torch.zeros(3, 3)
    A[1, 0] = 2.0  # B from A
    A[2, 0], A[2, 1] = 1.0, -3.0  # target from A and B
    influence = circuits.node_influence(A, target=2)
    # target row normalised: A 1/4, B 3/4; B's row: A 1. A's influence: 1/4 + 3/4 * 1
    torch.testing.assert_close(influence, torch.tensor([1.0, 0.75, 0.0]))


def test_total_effect_follows_every_path_per_unit_of_activation():
    kind = torch.tensor([EMBEDDING, FEATURE, FEATURE, TARGET])
    A = torch.zeros(4, 4)
    A[1, 0] = 1.0  # feature 1 from the embedding
    A[2, 1] = 4.0  # feature 2 from feature 1 (activation 2: 2 per unit)
    A[3, 1], A[3, 2] = 0.5, 3.0  # the target from both (feature 2's activation 6: 0.5 per unit)
    graph = circuits.AttributionGraph(
        token_ids=[0], tokens=["a"], target=circuits.Target([0], ["a"], 0, 0.0), kind=kind,
        layer=torch.tensor([-1, 0, 1, 2]), position=torch.zeros(4, dtype=torch.long),
        feature=torch.tensor([-1, 0, 0, -1]), activation=torch.tensor([1.0, 2.0, 6.0, 0.0]), adjacency=A,
        bias=torch.zeros(4), pre_activation=torch.full((4,), float("nan")), router_read=torch.zeros(4, 0, 0),
        router_layers=[], router_completeness=0.0)
    effect = graph.total_effect()
    # feature 2: its edge, 3.0. Feature 1: direct 0.5, plus its 4.0 into feature 2 at 0.5 per unit of feature 2: 2.5
    # (1.25 per unit of feature 1). The embedding: its 1.0 into feature 1 at 1.25 per unit: 1.25
    torch.testing.assert_close(effect, torch.tensor([1.25, 2.5, 3.0, 0.0]))


def test_attribute_refuses_what_it_cannot_explain():
    model = random_model(MICRO, seed=0)
    transcoders = random_transcoders(model)
    ids = token_ids(MICRO, batch=1, length=4)[0]
    with pytest.raises(ValueError, match="one per block"):
        circuits.attribute(model, transcoders[:1], ids)
    with pytest.raises(ValueError, match=r"none given for \[1\]"):
        circuits.attribute(model, {0: transcoders[0]}, ids)
    swapped = [transcoders[1], transcoders[0]]
    with pytest.raises(ValueError, match="was trained on layers.1.post_attention_layernorm.hook_out"):
        circuits.attribute(model, swapped, ids)
    with pytest.raises(ValueError, match="one sequence"):
        circuits.attribute(model, transcoders, token_ids(MICRO, batch=2, length=4))
    with pytest.raises(ValueError, match="same token twice"):
        circuits.attribute(model, transcoders, ids, target=(5, 5))
    with pytest.raises(ValueError, match="must be an id in 0..63"):
        circuits.attribute(model, transcoders, ids, target=64)
    with pytest.raises(ValueError, match="position must be an int in -4..3"):
        circuits.attribute(model, transcoders, ids, position=4)
    with pytest.raises(ValueError, match="more than max_nodes=10"):
        circuits.attribute(model, transcoders, ids, max_nodes=10)
    with pytest.raises(ValueError, match="node_threshold must lie in"):
        circuits.attribute(model, transcoders, ids, node_threshold=0)
    with pytest.raises(TypeError, match="transcoders\\[0\\] must be a transcoder"):
        circuits.attribute(model, [torch.nn.Linear(2, 2), transcoders[1]], ids)
    graph = circuits.attribute(model, transcoders, ids)
    embedding = int((graph.kind == EMBEDDING).nonzero()[0])
    with pytest.raises(ValueError, match="not a feature"):
        circuits.ablate_features(model, transcoders, graph, [embedding])


def test_a_multi_token_target_is_refused_by_name(nano):
    model, _ = nano
    transcoders = circuits.nano_transcoders()
    with pytest.raises(ValueError, match=r"target 'hello world' is 5 tokens \['he', 'l'"):
        circuits.attribute(model, transcoders, "x = 1", target="hello world")


def test_a_hooked_model_is_refused_rather_than_explained_wrongly():
    model = random_model(MICRO, seed=0)
    transcoders = random_transcoders(model)
    ids = token_ids(MICRO, batch=1, length=4)[0]
    with model.hooks(fwd_hooks=[("layers.0.hook_attn_out", lambda x, hook: 2 * x)]):
        with pytest.raises(RuntimeError, match="does not reproduce block 0's feed-forward input"):
            circuits.attribute(model, transcoders, ids)
