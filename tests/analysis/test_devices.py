"""Routing metrics and interventions follow the device of what they are given (issue #43: on a GPU, tensors the
library made on the CPU met the model's). A CPU has no second device, so the parts that need no values run on
``meta``: torch refuses to combine a meta tensor with a CPU one, so a CPU tensor made inside a function and combined
with its inputs fails here. The parts that read values are checked on CUDA, where there is one."""

from __future__ import annotations

import pytest
import torch
from tiny import TINY, random_model, token_ids

from k2lab import K2Model
from k2lab import routing as R
from k2lab.analysis.interventions import ablate_experts, attribution_patch, edit_bias, force_route, patch

pytestmark = pytest.mark.usefixtures("no_grad")

META = torch.device("meta")
L, B, T, E, K = 2, 2, 5, TINY.n_routed_experts, TINY.num_experts_per_tok


def _meta_trace(length: int = T, token_mask: torch.Tensor | None = None) -> R.RoutingTrace:
    """A trace of shapes only: every tensor on meta, [L, B, length, ...]."""
    idx = torch.empty(L, B, length, K, dtype=torch.long, device=META)
    scores = torch.empty(L, B, length, E, device=META)
    return R.RoutingTrace([1, 2], idx, torch.empty(L, B, length, K, device=META), scores, scores, idx,
                          torch.empty(L, B, length, dtype=torch.bool, device=META), token_mask)


def _cpu_trace(length: int) -> R.RoutingTrace:
    """A trace with values, on the CPU: token t of every row and layer chose experts t, t + 1, ... (mod E)."""
    idx = (torch.arange(length)[:, None] + torch.arange(K)).remainder(E).expand(L, B, length, K)
    scores = torch.full((L, B, length, E), 0.5)
    return R.RoutingTrace([1, 2], idx, torch.full(idx.shape, 1 / K), scores, scores, idx,
                          torch.zeros(L, B, length, dtype=torch.bool))


# ---- routing, without values -------------------------------------------------------------------------------------
def test_concat_joins_traces_on_the_first_ones_device():
    joined = R.RoutingTrace.concat([_meta_trace(), _cpu_trace(length=3)])
    fields = ("indices", "weights", "scores", "choice_scores", "unbiased_indices", "bias_flips", "token_mask")
    assert {getattr(joined, f).device for f in fields} == {META}
    assert joined.indices.shape == (L, 2 * B, T, K) and joined.token_mask.shape == (2 * B, T)


def test_a_trace_uses_its_token_mask_on_its_own_device():
    tr = _meta_trace(token_mask=torch.ones(B, T, dtype=torch.bool))  # a CPU mask, as a user may pass it
    assert tr.real_tokens().device == META
    assert tr.flip_counts.device == META and tr.flip_counts.shape == (L,)


@pytest.mark.parametrize("metric, shape", [
    (R.coactivation, (L, E, E)),
    (R.router_entropy, (L, B, T)),
    (lambda tr: R.router_entropy(tr, over="weights"), (L, B, T)),
])
def test_value_free_metrics_stay_on_the_traces_device(metric, shape):
    out = metric(_meta_trace(token_mask=torch.ones(B, T, dtype=torch.bool)))
    assert out.device == META and out.shape == shape


def test_vocabulary_specialization_keeps_its_tensors_with_the_counts():
    U = 3  # occurrences and ids as a user would build them, on the CPU; counts where the trace was
    vs = R.VocabularySpecialization([1, 2], torch.arange(U), torch.tensor([5, 1, 12]),
                                    torch.empty(L, U, E, dtype=torch.long, device=META), top=1)
    assert vs.token_ids.device == vs.occurrences.device == META
    assert vs.ratio.device == META and vs.ratio.shape == (L, U, E)
    assert vs.mean_max(min_count=2).device == META and vs.mean_max(min_count=2).shape == (L,)


def test_vocabulary_specialization_and_contrast_answer_on_the_traces_device():
    tr = _cpu_trace(length=4)
    vs = R.vocabulary_specialization(tr, token_ids(TINY, batch=B, length=4))
    assert {vs.token_ids.device, vs.occurrences.device, vs.counts.device} == {tr.indices.device}
    c = R.contrast(tr, tr, num_boot=10)
    assert {t.device for t in (c.share_a, c.ratio, c.weight_ratio, c.ratio_ci)} == {tr.indices.device}


# ---- interventions, without values -------------------------------------------------------------------------------
def test_edit_bias_writes_a_cpu_bias_into_a_meta_model():
    model = K2Model(TINY, device="meta")
    bias = model.layers[1].mlp.gate.e_score_correction_bias
    with edit_bias(model, {1: torch.zeros(E, dtype=torch.float64), 2: 0.5}):
        assert bias.device == META and bias.dtype == torch.float32
    assert bias.device == META and bias.dtype == torch.float32


@pytest.mark.parametrize("mode, probes", [
    ("zero", {"gate.hook_topk_idx": (B, T, K), "hook_expert_out": (B, T, K, TINY.hidden_size)}),
    ("renormalize", {"gate.hook_scores": (B, T, E), "gate.hook_topk_idx": (B, T, K),
                     "gate.hook_topk_weights": (B, T, K)}),
])
def test_ablation_masks_follow_the_activations(mode, probes):
    """A CPU model whose probes fire with meta activations: the ablation mask (made beside the router's weight)
    must go where the activations are."""
    model = K2Model(TINY)
    with ablate_experts(model, {1: [3]}, mode=mode):
        for name, shape in probes.items():
            dtype = torch.long if name.endswith("idx") else torch.float32
            out = model.hook_point(f"layers.1.mlp.{name}")(torch.empty(shape, dtype=dtype, device=META))
            assert out.device == META and out.shape == shape


# ---- on a GPU ------------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def models() -> tuple[K2Model, K2Model]:
    """The same seeded TINY model on the CPU and on the GPU."""
    cpu = random_model(TINY, seed=0)
    return cpu, random_model(TINY, seed=0).cuda()


def _moved(tr: R.RoutingTrace, device: str) -> R.RoutingTrace:
    return R.RoutingTrace(**{f: v.to(device) if isinstance(v, torch.Tensor) else v for f, v in vars(tr).items()})


@cuda
def test_on_cuda_routing_metrics_take_cpu_ids_and_answer_on_the_gpu(models):
    cpu, gpu = models
    ids = token_ids(TINY, batch=2, length=12)  # on the CPU, as a user makes them
    tr = R.trace(gpu, ids)
    tr_cpu = _moved(tr, "cpu")  # the same values on the CPU: the reference, free of GPU-CPU rounding differences
    assert tr.indices.is_cuda and tr.token_mask is None
    counts = R.expert_counts(tr)
    assert counts.is_cuda and R.max_violation(counts).is_cuda and R.domain_specialization(tr).is_cuda
    vs, vs_cpu = R.vocabulary_specialization(tr, ids), R.vocabulary_specialization(tr_cpu, ids.cuda())
    assert vs.counts.is_cuda and vs.occurrences.is_cuda and vs_cpu.counts.device.type == "cpu"
    torch.testing.assert_close(vs.ratio.cpu(), vs_cpu.ratio)  # CUDA's division against the CPU's: to rounding
    assert vs.mean_max(min_count=1).is_cuda
    assert torch.allclose(vs.mean_max(min_count=2).cpu(), vs_cpu.mean_max(min_count=2), equal_nan=True)
    assert vs.top_tokens(1, 0, min_count=1) == vs_cpu.top_tokens(1, 0, min_count=1)
    joined = R.RoutingTrace.concat([tr, R.trace(cpu, ids[:, :7])])
    assert joined.indices.is_cuda and joined.token_mask.is_cuda
    c, c_cpu = R.contrast(tr, tr_cpu, num_boot=50), R.contrast(tr_cpu, tr_cpu, num_boot=50)
    assert c.ratio.is_cuda and c.ratio_ci.is_cuda  # the same CPU bootstrap: the same numbers (NaN where 0 / 0)
    assert torch.allclose(c.ratio_ci.cpu(), c_cpu.ratio_ci, rtol=0, atol=0, equal_nan=True)
    assert c.specialised(1) == c_cpu.specialised(1)
    for metric in (R.coactivation, R.consecutive_same_expert_rate, R.router_entropy):
        assert metric(tr).is_cuda


@cuda
def test_on_cuda_interventions_take_cpu_tensors(models):
    cpu, gpu = models
    ids = token_ids(TINY, batch=2, length=9)
    new_bias = torch.linspace(-0.1, 0.1, E, dtype=torch.float64)  # on the CPU, and not float32
    interventions = {
        "edit_bias": lambda m: edit_bias(m, {1: new_bias, 2: lambda b: b * 0.5}),
        "ablate zero": lambda m: ablate_experts(m, {1: [0, 1, 2]}, mode="zero"),
        "ablate renormalize": lambda m: ablate_experts(m, {1: [0, 1, 2]}, mode="renormalize"),
        "ablate reroute": lambda m: ablate_experts(m, {1: list(range(8))}, mode="reroute"),
        "force list": lambda m: force_route(m, {1: [5, 6]}, positions=torch.tensor([0, -1])),
        "force tensor": lambda m: force_route(m, {2: torch.arange(K)[None, None]}, positions=torch.ones(9).bool()),
        "force fn on the cpu": lambda m: force_route(m, {1: lambda idx, choice: idx.flip(-1).cpu()}, positions=[2]),
    }
    for name, intervention in interventions.items():
        logits = []
        for model in (gpu, cpu):
            with intervention(model):
                logits.append(model(ids).cpu())
        assert torch.allclose(*logits, atol=1e-3), name
    gpu_bias, cpu_bias = (m.layers[1].mlp.gate.e_score_correction_bias for m in (gpu, cpu))
    assert gpu_bias.dtype == torch.float32 and torch.equal(gpu_bias.cpu(), cpu_bias)  # restored on exit
    _, clean = cpu.run_with_cache(ids, names="hook_resid_pre")  # a CPU cache patched into the GPU model
    with patch(gpu, clean, "layers.1.hook_resid_pre", positions=torch.tensor([3])):
        assert gpu(ids).is_cuda
    metric = lambda logits: logits[0, -1, 0]
    with torch.enable_grad():
        estimates = attribution_patch(gpu, ids, ids.flip(-1), metric, names="hook_resid_pre")
        expected = attribution_patch(cpu, ids, ids.flip(-1), metric, names="hook_resid_pre")
    for name in expected:
        assert estimates[name].is_cuda and torch.allclose(estimates[name].cpu(), expected[name], atol=1e-3), name
