"""K2's training recipe, piece by piece: MuonClip (Muon with update-RMS matching and weight decay, plus
QK-Clip), aux-loss-free expert balancing through the router's correction bias, and the WSD schedule.

Each piece is a small function on tensors, so a notebook can show one rule acting on one matrix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ..model.moe import MoE
from ..model.transformer import K2Model

# Quintic Newton-Schulz coefficients (Keller Jordan's Muon): five steps push every singular value near 1.
NEWTON_SCHULZ_COEFFS = (3.4445, -4.7750, 2.0315)


def native_bfloat16(device: torch.device | str) -> bool:
    """Whether matmuls on ``device`` run natively in bfloat16: CUDA GPUs from Ampere on, and CPUs that oneDNN has
    bfloat16 kernels for (AVX-512 or AMX). An AVX2-only CPU emulates them, many times slower than float32
    (docs/experiments.md)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def newton_schulz(grad: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximately orthogonalise the last two dims of ``grad`` [..., A, B]: U V^T of its SVD, which keeps the
    directions of the update and sets all their magnitudes (singular values) to about one.

    The iteration runs in ``dtype``; by default bfloat16 as in Muon's reference where the device has native
    bfloat16 matmuls (about twice as fast: it only has to land singular values in a band around one), float32
    elsewhere. The result comes back in ``grad``'s dtype."""
    if dtype is None:
        dtype = torch.bfloat16 if native_bfloat16(grad.device) else torch.float32
    a, b, c = NEWTON_SCHULZ_COEFFS
    x = (grad / (grad.norm(dim=(-2, -1), keepdim=True) + eps)).to(dtype)  # spectral norm <= 1: it converges
    wide = x.shape[-2] > x.shape[-1]
    if wide:
        x = x.transpose(-2, -1)  # iterate on the smaller Gram matrix
    for _ in range(steps):
        gram = x @ x.transpose(-2, -1)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.transpose(-2, -1) if wide else x).to(grad.dtype)


def muon_update(grad: torch.Tensor, ns_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Muon's step direction for a matrix (or a stack of matrices [E, A, B]), scaled by 0.2 * sqrt(max(A, B))
    so that its RMS matches a typical AdamW update (Moonlight's rule): one learning rate serves both."""
    rows, cols = grad.shape[-2:]
    return newton_schulz(grad, dtype=ns_dtype) * (0.2 * math.sqrt(max(rows, cols)))


class MuonClip(torch.optim.Optimizer):
    """Muon for hidden matrices (2-D weights and stacked experts), AdamW for everything else (embedding, head,
    norms), decoupled weight decay for both. QK-Clip is applied after the step by ``qk_clip``, because it
    needs the attention logits of the forward pass.

    Param groups carry ``use_muon`` and ``lr_scale`` (a group steps with ``lr * lr_scale``, so one schedule sets
    every group's ``lr``); ``MuonClip.for_model(model, lr, weight_decay)`` builds them. ``ns_dtype`` is the dtype
    Newton-Schulz iterates in (None: bfloat16 where matmuls are native in it, else float32).
    """

    def __init__(self, params, lr: float = 2e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, ns_dtype: torch.dtype | None = None):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, betas=betas, eps=eps, use_muon=False,
                        ns_dtype=ns_dtype, lr_scale=1.0)
        super().__init__(params, defaults)

    @classmethod
    def for_model(cls, model: K2Model, lr: float, weight_decay: float = 0.1, embed_lr_scale: float = 1.0,
                  head_lr_scale: float = 1.0, **options) -> MuonClip:
        """Muon for the hidden matrices; AdamW for the embedding (at ``embed_lr_scale * lr``), the head (at
        ``head_lr_scale * lr``) and the norms (undecayed)."""
        muon, norms = [], []
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "lm_head")):
                continue
            (muon if p.dim() >= 2 else norms).append(p)
        groups = [
            {"params": muon, "use_muon": True},
            {"params": [model.embed_tokens.weight], "lr_scale": embed_lr_scale},
            {"params": [model.lm_head.weight], "lr_scale": head_lr_scale},
            # Norm weights get no decay (decaying them towards zero would fight the normalisation).
            {"params": norms, "weight_decay": 0.0},
        ]
        return cls(groups, lr=lr, weight_decay=weight_decay, **options)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient: Muon (Nesterov momentum, orthogonalised by Newton-Schulz) for
        the matrices, AdamW for the embedding, head and norms, each with decoupled weight decay. QK-Clip runs apart
        (``qk_clip``)."""
        for group in self.param_groups:
            lr, wd = group["lr"] * group["lr_scale"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["use_muon"]:
                    buf = state.setdefault("momentum", torch.zeros_like(p))
                    buf.mul_(group["momentum"]).add_(p.grad)
                    update = muon_update(p.grad.add(buf, alpha=group["momentum"]), group["ns_dtype"])  # Nesterov
                else:
                    beta1, beta2 = group["betas"]
                    state["step"] = state.get("step", 0) + 1
                    m = state.setdefault("exp_avg", torch.zeros_like(p))
                    v = state.setdefault("exp_avg_sq", torch.zeros_like(p))
                    m.lerp_(p.grad, 1 - beta1)
                    v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    m_hat = m / (1 - beta1 ** state["step"])
                    v_hat = v / (1 - beta2 ** state["step"])
                    update = m_hat / (v_hat.sqrt() + group["eps"])
                p.mul_(1 - lr * wd).add_(update, alpha=-lr)


@torch.no_grad()
def qk_clip(model: K2Model, max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """QK-Clip as the K2 report defines it for MLA, per layer and head.

    ``max_logits`` [L, H]: each head's largest pre-softmax logit in the last forward. For a head whose max
    exceeds tau, gamma = tau / max; its content (nope) query and key weights are scaled by sqrt(gamma) and its
    rotary query weights by gamma, so the whole logit q_nope.k_nope + q_pe.k_pe shrinks by gamma. The shared
    rotary key (kv_a_proj_with_mqa) is untouched: it is shared by all heads. Returns gamma [L, H] (1 = no clip).
    """
    cfg = model.config
    H, N, R, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    gamma = (tau / max_logits.float()).clamp(max=1.0)  # [L, H]
    for layer, g in zip(model.layers, gamma, strict=True):
        if bool((g >= 1).all()):
            continue
        attn = layer.self_attn
        q_weight = (attn.q_proj if cfg.q_lora_rank is None else attn.q_b_proj).weight.view(H, N + R, -1)
        q_weight[:, :N] *= g.sqrt()[:, None, None].to(q_weight.dtype)  # query content rows of each head
        q_weight[:, N:] *= g[:, None, None].to(q_weight.dtype)  # query rotary rows
        kv_weight = attn.kv_b_proj.weight.view(H, N + V, -1)
        kv_weight[:, :N] *= g.sqrt()[:, None, None].to(kv_weight.dtype)  # key content rows; values untouched
    return gamma


@torch.no_grad()
def balance_router_bias(model: K2Model, expert_counts: Iterable[torch.Tensor], step_size: float) -> None:
    """Aux-loss-free balancing: each MoE layer's correction bias moves by +u for experts that got fewer tokens
    than the mean and -u for those that got more (sign of the load error), so load drifts towards uniform
    without a loss term. ``expert_counts``: one [E] count tensor per MoE layer, in layer order."""
    gates = [layer.mlp.gate for layer in model.layers if isinstance(layer.mlp, MoE)]
    for gate, counts in zip(gates, expert_counts, strict=True):
        counts = counts.float()
        gate.e_score_correction_bias += step_size * torch.sign(counts.mean() - counts)


def wsd_lr(step: int, total: int, peak: float, warmup: int, decay_fraction: float = 0.2,
           final_fraction: float = 0.0) -> float:
    """Warmup-stable-decay: linear warmup to ``peak``, flat, then linear decay to ``final_fraction * peak``
    over the last ``decay_fraction`` of the steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    decay_start = int(total * (1 - decay_fraction))
    if step < decay_start:
        return peak
    progress = (step - decay_start) / max(1, total - decay_start)
    return peak * (1 - progress * (1 - final_fraction))
