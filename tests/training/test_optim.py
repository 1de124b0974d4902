"""The training recipe's pieces: Muon's orthogonalisation, QK-Clip, bias balancing, WSD, and a few real steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import TRAINABLE as CFG

from k2lab import K2Model
from k2lab.training.optim import MuonClip, balance_router_bias, native_bfloat16, newton_schulz, qk_clip, wsd_lr
from k2lab.training.train import StepProbes, recipe_step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_newton_schulz_flattens_the_spectrum(dtype):
    g = torch.randn(3, 48, 80) @ torch.diag(torch.logspace(-1.5, 1, 80))  # singular values spread 300x
    out = newton_schulz(g, dtype=dtype)
    assert out.dtype == torch.float32  # iterated in dtype, returned in the gradient's dtype
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.6 and s.max() < 1.25  # the quintic iteration's band around 1
    u, _, vh = torch.linalg.svd(g[0], full_matrices=False)
    assert F.cosine_similarity(out[0].flatten(), (u @ vh).flatten(), dim=0) > 0.95


def test_newton_schulz_iterates_in_bfloat16_only_where_matmuls_are_native(monkeypatch):
    g = torch.randn(2, 16, 24)
    for native, dtype in [(True, torch.bfloat16), (False, torch.float32)]:
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda native=native: native)
        assert native_bfloat16("cpu") is native
        assert torch.equal(newton_schulz(g), newton_schulz(g, dtype=dtype))
        assert not torch.equal(newton_schulz(g), newton_schulz(g, dtype=torch.float64))  # dtype does matter


def _max_logits(model: K2Model, ids: torch.Tensor) -> torch.Tensor:
    probes = StepProbes()
    with torch.no_grad(), model.hooks(probes.hooks(model)):
        model(ids, attn_impl="naive")
    return torch.stack(probes.max_logits)  # [L, H]


def test_qk_clip_caps_every_head_and_touches_only_the_named_weights():
    torch.manual_seed(0)
    model = K2Model(CFG)
    model.init_weights(std=0.3, seed=0)  # large weights -> large logits
    ids = torch.randint(0, CFG.vocab_size, (2, 24))
    before = _max_logits(model, ids)
    tau = before.median().item()
    assert (before > tau).any()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    gamma = qk_clip(model, before, tau)
    # Layer 0 sees the same input, so its clipped heads now peak exactly at tau (later layers' inputs moved).
    after = _max_logits(model, ids)[0]
    assert (after <= tau * (1 + 1e-4)).all()
    clipped = before[0] > tau
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-4, atol=0)
    torch.testing.assert_close(gamma, (tau / before).clamp(max=1))

    H, N, R, V = CFG.num_attention_heads, CFG.qk_nope_head_dim, CFG.qk_rope_head_dim, CFG.v_head_dim
    for name, p in model.named_parameters():
        old = weights[name]
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        if name.endswith("q_b_proj.weight"):
            g = gamma[layer][:, None, None]
            expected = old.view(H, N + R, -1) * torch.cat([g.sqrt().expand(H, N, 1), g.expand(H, R, 1)], dim=1)
            torch.testing.assert_close(p.detach(), expected.view_as(old))
        elif name.endswith("kv_b_proj.weight"):
            g = gamma[layer][:, None, None]
            scale = torch.cat([g.sqrt().expand(H, N, 1), torch.ones(H, V, 1)], dim=1)
            torch.testing.assert_close(p.detach(), (old.view(H, N + V, -1) * scale).view_as(old))
        else:  # the shared rotary key (kv_a_proj_with_mqa) and everything else untouched
            assert torch.equal(p.detach(), old), name


def test_bias_balancing_moves_a_skewed_router_towards_uniform():
    torch.manual_seed(0)
    model = K2Model(CFG)
    gate = model.layers[1].mlp.gate
    with torch.no_grad():
        gate.weight.normal_(0, CFG.hidden_size**-0.5)  # logits ~ N(0, 1)
        gate.weight[:2] += 0.005  # with inputs of mean 1, experts 0 and 1 win most tokens
    x = torch.randn(1, 512, CFG.hidden_size) + 1

    def counts():
        with torch.no_grad():
            idx, _ = gate(x)
        return torch.bincount(idx.flatten(), minlength=CFG.n_routed_experts).float()

    start = counts()
    for _ in range(60):
        balance_router_bias(model, [counts()], step_size=0.02)
    end = counts()
    uniform = start.mean()
    assert (end - uniform).abs().max() < 0.5 * (start - uniform).abs().max()
    heavy = start.argmax()
    assert start[heavy] > 2 * uniform  # the skew was real
    assert gate.e_score_correction_bias[heavy] < 0  # and the overloaded expert was pushed down


def test_wsd_schedule_shape():
    lrs = [wsd_lr(s, 100, 1.0, warmup=10, decay_fraction=0.2) for s in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0 and lrs[50] == 1.0 and lrs[79] == 1.0
    assert all(a >= b for a, b in zip(lrs[80:], lrs[81:], strict=False)) and lrs[-1] < 0.1


def test_a_few_steps_lower_the_loss():
    torch.manual_seed(0)
    model = K2Model(CFG)
    model.init_weights(seed=0)
    opt = MuonClip.for_model(model, lr=3e-3)
    batch = torch.randint(0, CFG.vocab_size, (4, 33))
    losses = []
    for _ in range(8):
        loss, max_logits, gamma, probes = recipe_step(model, opt, batch, qk_clip_tau=30.0, bias_step=1e-3)
        losses.append(loss.item())
    assert max_logits.shape == gamma.shape == (CFG.num_hidden_layers, CFG.num_attention_heads)
    assert losses[-1] < losses[0] - 0.5
    assert len(probes.expert_counts) == 1 and int(probes.expert_counts[0].sum()) == 4 * 32 * 2


def test_embedding_and_head_step_at_their_own_learning_rate_scale():
    """AdamW's first step moves every weight with a gradient by lr * lr_scale (m_hat / sqrt(v_hat) = +-1)."""
    batch = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    moved = {}
    for scales in [(1.0, 1.0), (10.0, 0.5)]:
        model = K2Model(CFG)
        model.init_weights(seed=0)
        opt = MuonClip.for_model(model, lr=1e-3, weight_decay=0.0, embed_lr_scale=scales[0], head_lr_scale=scales[1])
        before = [p.detach().clone() for p in (model.embed_tokens.weight, model.lm_head.weight,
                                               model.layers[0].self_attn.o_proj.weight)]
        recipe_step(model, opt, batch, qk_clip_tau=1e9, bias_step=0.0)
        after = (model.embed_tokens.weight, model.lm_head.weight, model.layers[0].self_attn.o_proj.weight)
        moved[scales] = [(a - b).abs().max().item() for a, b in zip(after, before, strict=True)]
    embed, head, hidden = (m / m1 for m, m1 in zip(moved[(10.0, 0.5)], moved[(1.0, 1.0)], strict=True))
    assert embed == pytest.approx(10.0, rel=1e-3) and head == pytest.approx(0.5, rel=1e-3)
    assert hidden == pytest.approx(1.0, rel=1e-3)  # Muon's matrices keep lr
    assert moved[(1.0, 1.0)][0] == pytest.approx(1e-3, rel=1e-3)
