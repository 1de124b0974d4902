"""The eager floor of a decode step: one K2 decode step written out by hand with as few PyTorch ops as eager
execution allows, over a model's own weights and latent cache.

Its products with a weight are the model's ``linear`` (few-row products split over threads), and its experts run in
pairs through the model's own ``RoutedExperts.run_groups`` (one batched product per pair). It has no modules, probes or
input checks and handles only what the benchmark needs (batch 1, one new token, float32, a q latent, interleaved
rotary pairs, one expert group). Whatever a decode step costs on top of its GEMVs here is the price of eager PyTorch
itself on this CPU (one dispatch per small op); what the model's step costs on top of this floor is the price of its
generality (probes, modules, shapes, checks). ``benchmarks.vs_hf`` times it beside the model; its logits are checked
against the model's before anything is timed. It is a measuring stick, not a second implementation to use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k2lab.model.attention import LatentCache
from k2lab.model.linear import linear
from k2lab.model.moe import MoE
from k2lab.model.transformer import K2Model


def _rotate(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary pairs x [..., R] times e^(i angle) [R/2] -> rotate-half layout [..., R]."""
    turned = torch.view_as_complex(x.unflatten(-1, (-1, 2))) * turn
    return torch.view_as_real(turned).transpose(-1, -2).flatten(-2)


def check_supported(model: K2Model) -> None:
    """Raise unless the model is of the narrow kind ``minimal_decode_step`` is written for."""
    cfg = model.config
    required = {"float32 weights": model.dtype == torch.float32, "a q latent": cfg.q_lora_rank is not None,
                   "interleaved rotary pairs": cfg.rope_interleave, "one expert group": cfg.n_group == 1,
                   "the sigmoid router": cfg.scoring_func == "sigmoid", "normalised top-k weights": cfg.norm_topk_prob}
    missing = [name for name, ok in required.items() if not ok]
    if missing:
        raise ValueError(f"the eager-floor step is written for {', '.join(missing)} only")


@torch.no_grad()
def minimal_decode_step(model: K2Model, cache: LatentCache, token: int) -> torch.Tensor:
    """Logits [1, V] of ``token`` after the cached context. Writes the token's latents after the cached ones but
    does not advance the cache, so the next call (or the model) overwrites them."""
    cfg = model.config
    H, N, R, V, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    eps = cfg.rms_norm_eps
    position = cache.length
    cos, sin = model.rotary_emb.cos_sin(torch.tensor([position]))  # [1, R]
    turn = torch.complex(cos[0, : R // 2], sin[0, : R // 2])  # [R/2]
    x = model.embed_tokens.weight[token][None]  # [1, D]
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        h = F.rms_norm(x, x.shape[-1:], layer.input_layernorm.weight, eps)
        q_latent = F.rms_norm(linear(h, attn.q_a_proj.weight), (cfg.q_lora_rank,), attn.q_a_layernorm.weight, eps)
        q = linear(q_latent, attn.q_b_proj.weight).view(H, N + R)
        kv = linear(h, attn.kv_a_proj_with_mqa.weight)  # [1, C + R]
        entry = torch.cat((F.rms_norm(kv[:, :C], (C,), attn.kv_a_layernorm.weight, eps), _rotate(kv[:, C:], turn)), -1)
        entries = cache.append(i, entry[None])[0]  # [S, C + R]
        w_kv_b = attn.kv_b_proj.weight.view(H, N + V, C)
        q_absorbed = torch.bmm(q[:, None, :N], w_kv_b[:, :N])[:, 0]  # [H, C]
        query = torch.cat((q_absorbed, _rotate(q[:, N:], turn)), -1)  # [H, C + R]
        pattern = torch.softmax((entries @ query.T).T * attn.softmax_scale, -1)  # [H, S], cache rows first
        z = torch.bmm((pattern @ entries[:, :C])[:, None], w_kv_b[:, N:].transpose(1, 2))  # [H, 1, V]
        x = x + linear(z.view(1, H * V), attn.o_proj.weight)
        h = F.rms_norm(x, x.shape[-1:], layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            scores = linear(h, mlp.gate.weight).sigmoid()[0]  # [E]
            chosen = (scores + mlp.gate.e_score_correction_bias).topk(cfg.num_experts_per_tok).indices.sort().values
            weights = scores[chosen]
            weights = weights * (cfg.routed_scaling_factor / weights.sum())  # [k]
            shared = mlp.shared_experts
            out = linear(F.silu(linear(h, shared.gate_proj.weight)) * linear(h, shared.up_proj.weight),
                           shared.down_proj.weight)
            experts = chosen.tolist()  # in id order: each pair one strided view of the stacks, an odd one out alone
            groups = [tuple(experts[i : i + 2]) for i in range(0, len(experts), 2)]
            outs = mlp.experts.run_groups(groups, [h.expand(len(g), 1, -1) for g in groups])  # [g, 1, D] each
            out = out + weights[None] @ torch.cat(outs).view(len(experts), -1)  # [1, D]
        else:
            out = linear(F.silu(linear(h, mlp.gate_proj.weight)) * linear(h, mlp.up_proj.weight),
                           mlp.down_proj.weight)
        x = x + out
    return linear(F.rms_norm(x, x.shape[-1:], model.norm.weight, eps), model.lm_head.weight)
