"""Features against experts (k2lab/analysis/features.py): purity, mutual information and expert attribution on
constructed cases whose answers are known (a feature that fires exactly on one expert's tokens, one shuffled free of
the routing), then collected from K2-nano with a dictionary spliced in, against the same computations by hand."""

from __future__ import annotations

import math

import pytest
import torch

import k2lab
from k2lab.analysis import features as fx
from k2lab.analysis import routing
from k2lab.analysis.dictionary import TopKSAE, Transcoder
from k2lab.analysis.splicing import splice

E, K = 8, 2  # experts, chosen per token
TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n",
         "for item in [1, 2, 3]:\n    print(item)\n"]


def random_routing(tokens: int, seed: int = 0) -> torch.Tensor:
    """[N, E] bool: each token chooses K distinct experts, uniformly."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(tokens, E, generator=g).topk(K, dim=-1).indices  # [N, K]
    return torch.zeros(tokens, E, dtype=torch.bool).scatter_(1, picks, True)


def by_hand_bits(a: torch.Tensor, c: torch.Tensor) -> float:
    """I(A; C) in bits of two bool vectors, from the four cells written out."""
    total = 0.0
    for x in (True, False):
        for y in (True, False):
            p_xy = ((a == x) & (c == y)).double().mean().item()
            p_x, p_y = (a == x).double().mean().item(), (c == y).double().mean().item()
            total += 0.0 if p_xy == 0 else p_xy * math.log2(p_xy / (p_x * p_y))
    return total


def bernoulli_bits(p: float) -> float:
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


@pytest.fixture(scope="module")
def constructed():
    """2,000 tokens in 40 texts; feature 0 fires exactly on the tokens that chose expert 3, feature 1 is feature 0
    shuffled across tokens (same count, no link to the routing), feature 2 fires exactly where expert 5 is NOT
    chosen, feature 3 never fires."""
    chosen = random_routing(2000)
    g = torch.Generator().manual_seed(1)
    active = torch.zeros(2000, 4, dtype=torch.bool)
    active[:, 0] = chosen[:, 3]
    active[:, 1] = chosen[torch.randperm(2000, generator=g), 3]
    active[:, 2] = ~chosen[:, 5]
    sequences = torch.arange(2000) // 50
    return active, chosen, sequences


def test_a_feature_on_exactly_one_experts_tokens_is_pure(constructed):
    active, chosen, _ = constructed
    p = fx.purity(active, chosen)
    assert p.purity[0].item() == 1.0 and int(p.top_expert[0]) == 3
    assert p.active[0].item() == chosen[:, 3].sum().item()
    torch.testing.assert_close(p.counts[0], (chosen[chosen[:, 3]]).sum(0).float())
    torch.testing.assert_close(p.distribution[:3].sum(-1), torch.full((3,), float(K)))  # each token chose K experts
    assert math.isnan(p.purity[3]) and math.isnan(p.baseline[3])
    # Shuffled routing: each expert has about K / E of any feature's tokens; the max over 8 experts a little more.
    assert 0.25 < p.baseline[0].item() < 0.4
    assert abs(p.purity[1].item() - p.baseline[1].item()) < 0.05  # the shuffled feature is at its baseline
    assert p.purest(n=1)[0][:3] == (0, 3, 1.0)


def test_mutual_information_is_the_experts_entropy_for_a_pure_feature(constructed):
    active, chosen, sequences = constructed
    info = fx.information(active, chosen[None], sequences, layers=[4], num_boot=100)
    h_expert = bernoulli_bits(chosen[:, 3].double().mean().item())
    assert info.bits[0, 0].item() == pytest.approx(h_expert, rel=1e-6)  # I(A; C) = H(C) when A is C
    assert int(info.best_expert[0, 0]) == 3 and info.share[0, 0].item() == pytest.approx(1.0)
    assert info.bits[0, 2].item() == pytest.approx(bernoulli_bits(chosen[:, 5].double().mean().item()), rel=1e-6)
    assert info.share[0, 2].item() == pytest.approx(1.0)  # "not chosen" tells as much as "chosen"
    for f in (0, 1, 2):  # the best expert's information, written out
        want = max(by_hand_bits(active[:, f], chosen[:, e]) for e in range(E))
        assert info.bits[0, f].item() == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert info.share[0, 1].item() < 0.01  # shuffled free of the routing: next to nothing
    assert not info.counted[3] and math.isnan(info.bits[0, 3])
    assert info.mean_share_plugin[0].item() == pytest.approx(info.share[0, :3].mean().item(), rel=1e-6)
    low, high = info.mean_share_ci[:, 0].tolist()
    assert low <= info.mean_share[0].item() <= high
    assert info.mean_share[0] < info.mean_share_plugin[0]  # the correction takes the plug-in's upward bias off
    assert info.baseline[0].item() < 0.01  # shuffling the routing cuts every link
    assert (info.num_sequences, info.num_tokens) == (40, 2000)


def test_the_bootstrap_resamples_texts(constructed):
    active, chosen, sequences = constructed
    # Forty copies of one text: every resample holds the same counts in proportion, so the interval is a point.
    copies = fx.information(active[:50].repeat(40, 1), chosen[:50].repeat(40, 1)[None], sequences, layers=[1],
                            num_boot=50)
    torch.testing.assert_close(copies.mean_share_ci[0], copies.mean_share_ci[1])
    one_text = fx.information(active, chosen[None], torch.zeros(2000, dtype=torch.long), layers=[1], num_boot=50)
    torch.testing.assert_close(one_text.mean_share_ci[:, 0], one_text.mean_share.expand(2))  # nothing to resample
    torch.testing.assert_close(one_text.mean_share, one_text.mean_share_plugin)  # and no bias to measure
    first, second = (fx.information(active, chosen[None], sequences, layers=[1], num_boot=50, seed=3)
                     for _ in range(2))
    assert torch.equal(first.mean_share_ci, second.mean_share_ci)  # seeded


def test_information_per_layer_keeps_the_layers_apart(constructed):
    active, chosen, sequences = constructed
    other = random_routing(2000, seed=7)  # a second layer whose routing has nothing to do with the features
    info = fx.information(active, torch.stack([chosen, other]), sequences, layers=[2, 3], num_boot=20)
    assert info.layers == [2, 3] and info.share.shape == (2, 4)
    assert info.mean_share[0] > 0.6 and info.mean_share[1] < 0.02
    assert info.mean_share_ci[0, 0] > info.mean_share_ci[1, 1]  # the intervals do not touch



def linked_features(generator: torch.Generator, texts: int, per_text: int, experts: int, features: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """A population whose mean share is known: each expert is chosen with a rate of its text's (0.25 +- 0.1, so tokens
    of a text are not independent); features 0..F/2-1 follow an expert, each flipped with a probability eps_f, the
    rest fire at their own rate whatever the routing. Returns active [N, F], chosen [N, E], sequences [N] and the
    population's mean over features of max_e I(A_f; C_e) / H(A_f). For a linked feature the best expert is its own
    (A depends on the routing only through it), I = H(p_a) - H(eps), p_a = p_c (1 - eps) + (1 - p_c) eps, p_c = 0.25
    (the mean of the texts' rates); for the others I = 0."""
    N = texts * per_text
    sequences = torch.arange(N) // per_text
    rates = 0.25 + 0.1 * (2 * torch.rand(texts, experts, generator=generator) - 1)  # [S, E]
    chosen = torch.rand(N, experts, generator=generator) < rates[sequences]  # [N, E]
    linked = features // 2
    eps = torch.linspace(0.15, 0.4, linked).tolist()
    flips = torch.rand(N, linked, generator=generator) < torch.tensor(eps)  # [N, F/2]
    rates_free = torch.linspace(0.1, 0.4, features - linked)
    free = torch.rand(N, features - linked, generator=generator) < rates_free  # [N, F/2]
    active = torch.cat([chosen[:, torch.arange(linked) % experts] ^ flips, free], 1)  # [N, F]
    shares = [1 - bernoulli_bits(e) / bernoulli_bits(0.25 * (1 - e) + 0.75 * e) for e in eps]
    return active, chosen, sequences, sum(shares) / features


def test_the_interval_covers_a_known_information():
    """500 tokens in 20 texts, 48 features, 16 experts: the plug-in mean share lies above the truth by more than the
    resamples' spread (averaging over features shrinks the noise, not the bias), so a percentile interval covers the
    truth 0.07 of the time and misses its own estimate 0.27 of the time (the plain percentile interval, over 400
    populations). The corrected one must hold its estimate and cover the truth about as often as it claims, 0.95
    (0.95 over the same 400; 37 of these 40)."""
    g = torch.Generator().manual_seed(11)
    trials, covered, held, results = 40, 0, 0, []
    for trial in range(trials):
        active, chosen, sequences, truth = linked_features(g, texts=20, per_text=25, experts=16, features=48)
        info = fx.information(active, chosen[None], sequences, layers=[1], min_active=20, num_boot=100,
                              num_shuffles=1, seed=trial)
        low, high = info.mean_share_ci[:, 0].tolist()
        covered += low <= truth <= high
        held += low <= info.mean_share[0].item() <= high
        results.append((info, truth))
    assert held == trials  # the interval holds its own estimate
    assert covered / trials >= 0.85
    bias = sum(info.mean_share_plugin[0].item() - truth for info, truth in results) / trials
    corrected = sum(info.mean_share[0].item() - truth for info, truth in results) / trials
    assert bias > 0.005 and abs(corrected) < bias / 4  # the correction takes most of the plug-in's bias off


def test_information_labels_its_rows_by_model_layer(nano):
    model, _ = nano
    sae = random_dictionary(TopKSAE(128, 96, 6, {"hook_name": "layers.3.hook_resid_post"}))
    ft = fx.trace_features(model, sae, TEXTS, batch_size=2, progress=False)
    info = fx.information(ft, min_active=1, num_boot=5, num_shuffles=1)
    assert info.layers == ft.routing.layers == [1, 2, 3, 4, 5]  # K2-nano's block 0 is dense
    given = fx.information(ft.active(), ft.chosen(), ft.sequences(), layers=ft.routing.layers, min_active=1,
                           num_boot=5, num_shuffles=1)
    torch.testing.assert_close(given.share, info.share, equal_nan=True)
    with pytest.raises(ValueError, match=r"give layers=, the model layer of each of chosen's 5 rows"):
        fx.information(ft.active(), ft.chosen(), ft.sequences())
    with pytest.raises(TypeError, match="reads chosen, sequences and layers from the trace; drop layers"):
        fx.information(ft, layers=[0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"layers must be model layer indices \(ints\), got \['1', '2', '3', "):
        fx.information(ft.active(), ft.chosen(), ft.sequences(), layers=list("12345"))

def test_shuffling_within_token_ids_keeps_what_the_token_explains():
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 30, (3000,), generator=g)  # [N] token ids
    by_token = random_routing(30, seed=3)  # [30, E] each token id always goes to the same experts
    chosen = by_token[tokens]  # [N, E]
    active = torch.stack([tokens % 3 == 0, torch.rand(3000, generator=g) < 0.2], 1)  # by token; by chance
    order = fx._shuffled_order(3000, tokens, g)
    assert sorted(order.tolist()) == list(range(3000)) and torch.equal(tokens[order], tokens)
    assert not torch.equal(order, torch.arange(3000))
    p = fx.purity(active, chosen, within=tokens)
    torch.testing.assert_close(p.baseline, p.purity)  # routing is the token's: nothing left to shuffle away
    info = fx.information(active, chosen[None], torch.arange(3000) // 100, layers=[1], within=tokens, num_boot=10)
    low, high = info.mean_share_ci[:, 0].tolist()
    assert low <= info.baseline[0].item() <= high  # the same counts, corrected from resamples of their own
    assert fx.purity(active, chosen).baseline[0] < p.purity[0] - 0.1  # a plain shuffle does cut the link
    with pytest.raises(ValueError, match=r"within must be None or integer labels \[N\] = \[3000\]"):
        fx.purity(active, chosen, within=tokens[:10])


def test_expert_attribution_finds_the_feature_each_expert_writes():
    g = torch.Generator().manual_seed(0)
    N, D = 60, 6
    decoder = torch.eye(D)[:4]  # [F=4, D] orthonormal directions
    indices = torch.stack([torch.arange(N) % 3, (torch.arange(N) + 1) % 3], 1)  # [N, 2] two experts of 3
    weights = torch.rand(N, 2, generator=g) + 0.5
    values = torch.rand(N, 4, generator=g) + 0.1  # [N, F]
    # Expert e writes exactly feature e's term, spread over its slot weight; feature 3 fires but no expert writes it.
    expert_out = torch.stack([values[torch.arange(N), indices[:, j], None] * decoder[indices[:, j]]
                              / weights[:, j, None] for j in range(2)], 1)  # [N, 2, D]
    along, energy, pairs = fx.attribution_sums(values, decoder, expert_out, indices, weights, num_experts=3)
    shares = along / energy[:, None]
    torch.testing.assert_close(shares, torch.eye(3, 4), rtol=1e-5, atol=1e-6)
    assert pairs.tolist() == [40, 40, 40]
    attribution = fx.ExpertAttribution(layer=1, shares=shares, tokens=pairs)
    assert attribution.top_features(2, n=1) == [(2, pytest.approx(1.0))]
    torch.testing.assert_close(attribution.explained, torch.ones(3))
    # Half of expert 0's output along a second direction that no feature has: features explain half its energy.
    bent = expert_out.clone()
    bent[..., 5] = torch.where(indices == 0, expert_out.norm(dim=-1), 0.0)
    along, energy, _ = fx.attribution_sums(values, decoder, bent, indices, weights, num_experts=3)
    assert (along / energy[:, None])[0, 0].item() == pytest.approx(0.5, rel=1e-5)


@pytest.fixture(scope="module")
def nano():
    return k2lab.load_nano()


def random_dictionary(dictionary, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in dictionary.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return dictionary


def test_trace_features_records_features_and_the_models_own_routing(nano):
    model, tok = nano
    sae = random_dictionary(TopKSAE(128, 96, 6, {"hook_name": "layers.3.hook_resid_post"}))
    ft = fx.trace_features(model, sae, TEXTS, batch_size=2, progress=False)
    plain = routing.trace_dataset(model, TEXTS, batch_size=2, progress=False)
    assert torch.equal(ft.routing.indices, plain.indices)  # the error term kept: the routing is unchanged
    lengths = [len(tok.encode(t)) for t in TEXTS]
    assert ft.features.shape == (3, max(lengths), 96) and ft.probe == "layers.3.hook_resid_post.hook_features"
    for row, text in enumerate(TEXTS):
        with torch.no_grad(), splice(model, sae.probe, sae) as point:
            _, cache = model.run_with_cache(torch.tensor([tok.encode(text)]), names=point.name)
        torch.testing.assert_close(ft.features[row, :lengths[row]], cache[point.name][0], rtol=1e-4, atol=1e-5)
        assert (ft.features[row, lengths[row]:] == 0).all()  # pads
    N = sum(lengths)
    assert ft.active().shape == (N, 96) and ft.chosen().shape == (5, N, 32) and ft.chosen(4).shape == (N, 32)
    assert ft.sequences().tolist() == [b for b, n in enumerate(lengths) for _ in range(n)]
    assert (ft.chosen().sum(-1) == 4).all()
    torch.testing.assert_close(ft.chosen(4).sum(0), routing.expert_counts(plain)[plain.row(4)])
    strongest = int(ft.features.amax((0, 1)).argmax())
    text, position, value = ft.top_activations(strongest, n=1)[0]
    assert value == ft.features.max().item() and ft.features[text, position, strongest].item() == value


def test_expert_attribution_on_nano_against_a_loop_over_tokens(nano):
    model, tok = nano
    read, write = "layers.3.post_attention_layernorm.hook_out", "layers.3.hook_mlp_out"
    transcoder = random_dictionary(Transcoder(128, 128, 64, 8, {"hook_name": read, "hook_name_out": write}))
    attribution = fx.expert_attribution(model, transcoder, TEXTS[:2], progress=False)
    along, energy = torch.zeros(32, 64), torch.zeros(32)
    names = [write + ".hook_features", "layers.3.mlp.hook_expert_out", "layers.3.mlp.gate.hook_topk_idx",
             "layers.3.mlp.gate.hook_topk_weights"]
    for text in TEXTS[:2]:
        with torch.no_grad(), splice(model, (read, write), transcoder):
            _, cache = model.run_with_cache(torch.tensor([tok.encode(text)]), names=names)
        features, expert_out, indices, weights = (cache[name][0] for name in names)
        for t in range(len(features)):
            for j in range(4):
                e, c = int(indices[t, j]), weights[t, j] * expert_out[t, j]
                energy[e] += c.pow(2).sum()
                for f in features[t].nonzero().flatten().tolist():
                    along[e, f] += features[t, f] * (transcoder.W_dec[f].detach() @ c)
    assert attribution.layer == 3 and attribution.tokens.sum() == 4 * sum(len(tok.encode(t)) for t in TEXTS[:2])
    torch.testing.assert_close(attribution.shares, along / energy.clamp(min=1e-30)[:, None], rtol=1e-3, atol=1e-5)


def test_features_refuse_what_they_cannot_measure(nano, constructed):
    model, _ = nano
    active, chosen, sequences = constructed
    with pytest.raises(ValueError, match=r"active must be a bool tensor \[N, F\]"):
        fx.purity(active.float(), chosen)
    with pytest.raises(ValueError, match=r"chosen must be a bool tensor \[N, E\] .* N = 2000"):
        fx.purity(active, chosen[:10])
    with pytest.raises(ValueError, match=r"chosen must be a bool tensor \[L_moe, N, E\]"):
        fx.information(active, chosen, sequences, layers=[1])
    with pytest.raises(ValueError, match="layers names 2 layers but chosen holds 1"):
        fx.information(active, chosen[None], sequences, layers=[1, 2])
    with pytest.raises(ValueError, match=r"sequences must be integer text indices \[N\]"):
        fx.information(active, chosen[None], sequences.float(), layers=[1])
    with pytest.raises(ValueError, match=r"sequences must be integer text indices \[N\] = \[2000\], got list"):
        fx.information(active, chosen[None], sequences.tolist(), layers=[1])
    with pytest.raises(ValueError, match="no feature is active on min_active=2001 tokens or more"):
        fx.information(active, chosen[None], sequences, layers=[1], min_active=2001)
    with pytest.raises(ValueError, match="num_boot must be a positive integer, got 0"):
        fx.information(active, chosen[None], sequences, num_boot=0, layers=[1])
    with pytest.raises(ValueError, match="confidence must lie in"):
        fx.information(active, chosen[None], sequences, confidence=1.0, layers=[1])
    with pytest.raises(ValueError, match="records no probe; pass probe="):
        fx.trace_features(model, TopKSAE(128, 64, 4), TEXTS)
    with pytest.raises(ValueError, match="writes an MoE layer's hook_mlp_out .* got layers.3.hook_resid_post"):
        fx.expert_attribution(model, TopKSAE(128, 64, 4), TEXTS, probe="layers.3.hook_resid_post")
    with pytest.raises(ValueError, match=r"layers \[1, 2, 3, 4, 5\]\), got layers.0.hook_mlp_out"):
        fx.expert_attribution(model, Transcoder(128, 128, 64, 4), TEXTS,
                              probe=("layers.0.post_attention_layernorm.hook_out", "layers.0.hook_mlp_out"))
    with pytest.raises(ValueError, match=r"expert_out must be \[N, k, D\]"):
        fx.attribution_sums(torch.zeros(3, 4), torch.zeros(4, 5), torch.zeros(3, 5), torch.zeros(3, 1).long(),
                            torch.zeros(3, 1), 2)


# ---- figures (k2lab/viz/features.py) --------------------------------------------------------------------------------
def test_figures_draw_what_they_are_given():
    viz = pytest.importorskip("k2lab.viz")
    purity, baseline = torch.tensor([1.0, 0.5, float("nan")]), torch.tensor([0.3, 0.3, float("nan")])
    fig = viz.purity_figure({"purity": purity, "routing shuffled": baseline})
    drawn = {trace.name: dict(zip(trace.x, trace.y, strict=True)) for trace in fig.data}  # bin centre -> share
    assert list(drawn) == ["purity (mean 0.75)", "routing shuffled (mean 0.30)"]  # NaN: never active, left out
    assert {round(x, 4): y for x, y in drawn["purity (mean 0.75)"].items() if y} == {0.5125: 0.5, 0.9875: 0.5}
    (centre, share), = ((x, y) for x, y in drawn["routing shuffled (mean 0.30)"].items() if y)
    assert abs(centre - 0.3) <= 0.0125 + 1e-9 and share == 1.0
    shares = torch.tensor([[0.5, 1.0, 0.5], [0.0, 0.25, 0.75]])
    heat = viz.expert_share_heatmap(shares, ["feature 1", "feature 2"])
    assert heat.data[0].zmin == 0 and heat.data[0].zmax == 1.0 and list(heat.data[0].x) == [0, 1, 2]
    share, interval = torch.tensor([0.2, 0.3]), torch.tensor([[0.15, 0.25], [0.3, 0.32]])
    bars = viz.information_figure([1, 2], share, interval, {"routing shuffled": torch.tensor([0.01, 0.02])})
    assert list(bars.data[0].error_y.array) == pytest.approx([0.1, 0.02])
    assert list(bars.data[0].error_y.arrayminus) == pytest.approx([0.05, 0.05])
    assert list(bars.data[1].y) == pytest.approx([0.01, 0.02]) and list(bars.data[0].x) == ["1", "2"]


def test_figures_name_a_bad_input():
    viz = pytest.importorskip("k2lab.viz")
    with pytest.raises(ValueError, match=r"series\['purity'\] holds only NaN"):
        viz.purity_figure({"purity": torch.tensor([float("nan")])})
    with pytest.raises(ValueError, match="row_labels has 1 entries but shares"):
        viz.expert_share_heatmap(torch.zeros(2, 3), ["one"])
    with pytest.raises(ValueError, match=r"layers has 3 entries but interval \[2, L_moe\]"):
        viz.information_figure([1, 2, 3], torch.zeros(3), torch.zeros(2, 2), {})
