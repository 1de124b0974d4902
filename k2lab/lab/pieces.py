"""The course's "write it yourself" exercises as pieces of the learner's own K2 (``k2lab.lab.learner``): for each,
where it is asked, the checker that judges it, and the reference that stands in while the learner has not written
it (or while their answer fails its check).

The references are k2lab's own modules, or the formula k2lab implements, called with the exercise's signature.
They are written so that gradients flow through the weights they are given (10 trains the learner's model, in
which a reference may stand in for a piece): modules run through ``torch.func.functional_call`` on a module built
on the meta device, so no weights are copied. The reference for the whole model (``my_k2``) assembles K2 from the
module's other pieces, so the learner's pieces run inside it wherever they were written.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call

from ..config import K2Config
from .exercises.checking import Verdict
from .exercises.decode import nano_and_prompt, reference_cached_mla
from .own_training import meta_mla, training_step


@dataclass(frozen=True)
class Piece:
    """One exercise whose answer belongs to the learner's module."""

    name: str  # the function's name in the notebook and in mine.py, "my_rms_norm"
    where: str  # "04b, exercise 1"
    what: str  # "RMSNorm"
    check_name: str  # the checker, as exercises names it
    check: Callable[[Callable], Verdict]  # the learner's function -> verdict
    reference: Callable[[types.ModuleType], Callable]  # the loaded module -> the reference function


def _checker(name: str, *args, **kwargs) -> Callable[[Callable], Verdict]:
    """``exercises.<name>(fn, *args, **kwargs)``, imported when first used."""

    def check(fn: Callable) -> Verdict:
        from . import exercises

        return getattr(exercises, name)(fn, *args, **kwargs)

    return check


@functools.cache
def _on_nano(name: str, **kwargs) -> Callable[[Callable], Verdict]:
    def check(fn: Callable) -> Verdict:
        from . import exercises

        model, ids = nano_and_prompt()
        return getattr(exercises, name)(fn, model, ids, **kwargs)

    return check


# --- references -----------------------------------------------------------------------------------------------------


@functools.cache
def _router_module(num_experts: int, hidden: int, top_k: int, scaling: float) -> torch.nn.Module:
    from ..model.moe import Router

    cfg = K2Config.nano().replace(n_routed_experts=num_experts, hidden_size=hidden, num_experts_per_tok=top_k,
                                  routed_scaling_factor=scaling)
    with torch.device("meta"):
        return Router(cfg)


def reference_mla(w: dict[str, torch.Tensor], cfg: K2Config, hidden: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """03's ``my_mla``: k2lab's MultiHeadLatentAttention with the weights ``w`` (the naive path)."""
    return functional_call(meta_mla(cfg), w, (hidden, cos, sin), {"attn_impl": "naive"})


def reference_mla_absorbed(w: dict[str, torch.Tensor], cfg: K2Config, hidden: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> torch.Tensor:
    """03's ``my_mla_absorbed``: the same module on its absorbed path."""
    return functional_call(meta_mla(cfg), w, (hidden, cos, sin), {"attn_impl": "absorbed"})


def reference_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """04a's ``my_router``: k2lab's Router with this gate and correction bias; x [N, D] -> (idx, weights) [N, k]."""
    router = _router_module(weight.shape[0], weight.shape[1], top_k, float(scaling))
    idx, w = functional_call(router, {"weight": weight, "e_score_correction_bias": bias}, (x[None],))
    return idx[0], w[0]


def reference_group_router(s: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                           topk_group: int) -> torch.Tensor:
    """04a's ``my_group_router``: DeepSeek-V3's group-limited choice, ``k2lab.routing.select_experts``."""
    from ..analysis.routing import select_experts

    return select_experts(s + bias, top_k, n_group, topk_group)


def reference_yarn(cfg: K2Config) -> tuple[torch.Tensor, float]:
    """02's ``my_yarn``: k2lab's YaRN frequencies and the config's softmax scale."""
    from ..model.rope import inverse_frequencies

    return inverse_frequencies(cfg).double(), cfg.softmax_scale  # float64, as the exercise's own answer


def reference_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """02's ``my_rotate``: k2lab's rotary rotation in the rotate-half layout."""
    from ..model.attention import apply_rotary

    angles = positions[:, None].to(inv_freq.dtype) * inv_freq  # [T, R/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, R]: pair i's angle for features i and i + R/2
    return apply_rotary(x, angles.cos(), angles.sin(), interleaved=False)


def reference_k2(module: types.ModuleType) -> Callable:
    """09's ``my_k2``, assembled from the module's own pieces (the learner's where they wrote them): the embedding,
    each block (MLA, then the dense SwiGLU or the MoE), the final norm and the untied head."""

    def my_k2(state_dict: dict[str, torch.Tensor], cfg: K2Config, ids: torch.Tensor) -> torch.Tensor:
        from ..model.rope import cos_sin_scale

        sd, eps = state_dict, cfg.rms_norm_eps
        inv_freq, _ = module.my_yarn(cfg)  # [R/2]
        angles = torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32)[:, None] * inv_freq.to(
            ids.device, torch.float32)  # [T, R/2] position t, pair i, in float32 as k2lab's model computes them
        angles = torch.cat([angles, angles], dim=-1)  # [T, R]: pair i's angle for features i and i + R/2
        cos, sin = angles.cos() * cos_sin_scale(cfg), angles.sin() * cos_sin_scale(cfg)  # YaRN's factor: 1 for K2
        x = sd["embed_tokens.weight"][ids]  # [B, T, D]
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            attn = {n.removeprefix(p + "self_attn."): t for n, t in sd.items() if n.startswith(p + "self_attn.")}
            x = x + module.my_mla(attn, cfg, module.my_rms_norm(x, sd[p + "input_layernorm.weight"], eps), cos, sin)
            h = module.my_rms_norm(x, sd[p + "post_attention_layernorm.weight"], eps)  # [B, T, D]
            if not cfg.is_moe_layer(i):
                x = x + module.my_swiglu(h, *(sd[p + f"mlp.{m}_proj.weight"] for m in ("gate", "up", "down")))
                continue
            flat = h.flatten(0, 1)  # [N, D]
            idx, w = module.my_router(flat, sd[p + "mlp.gate.weight"], sd[p + "mlp.gate.e_score_correction_bias"],
                                      cfg.num_experts_per_tok, cfg.routed_scaling_factor)  # [N, k] each
            experts = [sd[p + f"mlp.experts.{m}_proj"] for m in ("gate", "up", "down")]  # [E, I, D], ..., [E, D, I]
            routed = flat.new_zeros(*idx.shape, flat.shape[-1])  # [N, k, D]
            for e in idx.unique().tolist():  # each chosen expert once, on the rows (and slots) that chose it
                rows, slots = torch.where(idx == e)
                routed[rows, slots] = module.my_swiglu(flat[rows], *(m[e] for m in experts))
            shared = module.my_swiglu(flat, *(sd[p + f"mlp.shared_experts.{m}_proj.weight"]
                                             for m in ("gate", "up", "down")))
            # The router computes its weights in float32; the stream keeps its own dtype (bfloat16 in 08).
            x = x + module.my_combine(shared, routed, w.to(h.dtype)).view_as(h)
        return module.my_rms_norm(x, sd["norm.weight"], eps) @ sd["lm_head.weight"].T  # [B, T, V], untied head

    return my_k2


def reference_generate(state_dict: dict[str, torch.Tensor], cfg: K2Config, ids: torch.Tensor,
                       new_tokens: int) -> torch.Tensor:
    """09's ``my_generate``: ``k2lab.generate`` (greedy, through k2lab's latent cache) on a K2Model holding these
    weights (no copy)."""
    from ..model import K2Model, generate

    model = K2Model(cfg, device="meta")
    model.load_state_dict(state_dict, assign=True)
    return generate(model.eval(), ids, max_new_tokens=new_tokens)


def reference_release_to_state_dict(tensors: dict[str, torch.Tensor], cfg: K2Config,
                                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """08's ``my_release_to_state_dict``: the release's tensors (FP8 with 128 x 128 block scales, one tensor per
    expert) as K2Model's state dict in ``dtype``: names without ``model.``, each MoE layer's experts stacked."""
    from ..weights.quant.fp8 import dequantize
    from ..weights.schema import EXPERT_PROJS, checkpoint_tensors, expert_tensor

    def value(name: str, keep: torch.dtype | None = None) -> torch.Tensor:
        scale = tensors.get(name + "_scale_inv")
        t = tensors[name]
        return dequantize(t, scale, (128, 128), dtype) if scale is not None else t.to(keep or dtype)

    out = {}
    for spec in checkpoint_tensors(cfg):
        if ".mlp.experts." in spec.name:
            continue
        out[spec.name.removeprefix("model.")] = value(spec.name, spec.dtype)  # the bias stays float32
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            for proj in EXPERT_PROJS:
                out[f"layers.{i}.mlp.experts.{proj}"] = torch.stack(
                    [value(expert_tensor(i, e, proj)) for e in range(cfg.n_routed_experts)])
    return out


def reference_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """08's ``my_dequantize``: e4m3 values times their 128 x 128 block's scale, in float32."""
    from ..weights.quant.fp8 import dequantize

    return dequantize(weight, scale_inv, (128, 128), torch.float32)


def reference_next_token_loss(logits: torch.Tensor, ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """10's ``my_next_token_loss``: the mean cross-entropy (nats) of each next token, over the positions whose token
    and next token are both real (K2Model's ``return_type="loss"`` rule)."""
    real = ids != pad_id  # [B, T]
    scored = real[:, :-1] & real[:, 1:]  # [B, T-1]
    per_position = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    return (per_position * scored.flatten()).sum() / scored.sum()


def reference_adamw_step(p: torch.Tensor, grad: torch.Tensor, state: dict, lr: float, weight_decay: float,
                         betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> torch.Tensor:
    """10's ``my_adamw_step``: one AdamW step (decoupled weight decay, bias-corrected moments, as torch's AdamW and
    k2lab's MuonClip take it); ``state`` holds ``step``, ``exp_avg``, ``exp_avg_sq`` between calls."""
    beta1, beta2 = betas
    state["step"] = state.get("step", 0) + 1
    m = state["exp_avg"] = torch.lerp(state.get("exp_avg", torch.zeros_like(p)), grad, 1 - beta1)
    v = state["exp_avg_sq"] = state.get("exp_avg_sq", torch.zeros_like(p)) * beta2 + (1 - beta2) * grad * grad
    update = (m / (1 - beta1 ** state["step"])) / ((v / (1 - beta2 ** state["step"])).sqrt() + eps)
    return p * (1 - lr * weight_decay) - lr * update


def reference_muon_step(module: types.ModuleType) -> Callable:
    """10's ``my_muon_step``, with the module's Newton-Schulz: momentum, Nesterov, RMS matching, decoupled decay."""

    def my_muon_step(p: torch.Tensor, grad: torch.Tensor, state: dict, lr: float, weight_decay: float,
                     momentum: float = 0.95) -> torch.Tensor:
        buf = state["momentum"] = state.get("momentum", torch.zeros_like(p)) * momentum + grad
        nesterov = grad + momentum * buf
        if module.my_newton_schulz is module.__references__["my_newton_schulz"]:
            ortho = module.my_newton_schulz(nesterov, 5)  # k2lab's takes a stack [E, A, B] at once
        else:  # an exercise's Newton-Schulz is written for one matrix: each matrix on its own
            ortho = torch.stack([module.my_newton_schulz(g, 5) for g in nesterov.reshape(-1, *p.shape[-2:])])
        ortho = ortho.view_as(p)
        update = ortho * (0.2 * math.sqrt(max(p.shape[-2:])))
        return p * (1 - lr * weight_decay) - lr * update

    return my_muon_step


def reference_qk_clip(head: dict[str, torch.Tensor], max_logit: float, tau: float) -> dict[str, torch.Tensor]:
    """10's ``my_qk_clip``: one head's rows scaled as ``k2lab.training.optim.qk_clip`` scales them."""
    gamma = min(1.0, tau / max_logit)
    factors = {"q_nope": gamma**0.5, "k_nope": gamma**0.5, "q_pe": gamma}
    return {part: t * factors.get(part, 1.0) for part, t in head.items()}


def reference_train_step(module: types.ModuleType) -> Callable:
    """10's ``my_train_step``: ``k2lab.lab.own_training.training_step`` with the module's pieces."""

    def my_train_step(params, opt_state, batch, cfg, lr, tau, bias_step, pad_id):
        return training_step(module, params, opt_state, batch, cfg, lr, tau, bias_step, pad_id)

    return my_train_step


def _function(fn: Callable) -> Callable[[types.ModuleType], Callable]:
    return lambda module: fn


def _piece(name: str, where: str, what: str, check_name: str, reference: Callable[[types.ModuleType], Callable],
           check: Callable[[Callable], Verdict] | None = None) -> Piece:
    return Piece(name, where, what, check_name, check or _checker(check_name), reference)


def reference_greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """00's ``my_greedy``: greedy decoding by hand, the whole sequence through the model at each step (what
    ``k2lab.generate`` does through its latent cache)."""
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)  # [B, T + 1]
    return ids


def reference_train_bpe(texts: list[str], num_merges: int, pre_tokenize: Callable) -> list[tuple[bytes, bytes]]:
    """01's ``my_train_bpe``: the checker's own trainer."""
    from .exercises import train_bpe

    return train_bpe(texts, num_merges, pre_tokenize)


def reference_bpe(ranks: dict[bytes, int], piece: bytes) -> list[bytes]:
    """01's ``my_bpe``: k2lab's rank-BPE."""
    from ..tokenizer import rank_bpe

    return rank_bpe(ranks, piece)


def reference_kv_cache_bytes(cfg: K2Config, tokens: int) -> int:
    """03's ``my_kv_cache_bytes``: ``k2lab.kv_cache_bytes``, the latent cache in bfloat16."""
    from ..analysis.accounting import kv_cache_bytes

    return kv_cache_bytes(cfg, tokens)


def reference_absorbed_score(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                             w_uk: torch.Tensor, scale: float) -> torch.Tensor:
    """03's ``my_absorbed_score``: W_UK folded into the query, [H, T, S]."""
    return scale * (torch.einsum("thn,hnc->htc", q_nope, w_uk) @ c_kv.T + torch.einsum("thr,sr->hts", q_pe, k_pe))


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """04b's ``my_rms_norm``: torch's RMSNorm."""
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def reference_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """04b's ``my_swiglu``: down(silu(gate x) * up x), weights stored [out, in]."""
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def reference_combine(shared: torch.Tensor, expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """04b's ``my_combine``: the shared output plus the routed outputs weighted slot by slot."""
    return shared + (weights[..., None] * expert_out).sum(-2)


def reference_block(x: torch.Tensor, input_norm: Callable, attn: Callable, post_norm: Callable,
                    ffn: Callable) -> torch.Tensor:
    """04b's ``my_block``: the pre-norm block."""
    x = x + attn(input_norm(x))
    return x + ffn(post_norm(x))


def reference_max_violation(counts: torch.Tensor) -> torch.Tensor:
    """05's ``my_max_violation``: ``k2lab.routing.max_violation``."""
    from ..analysis.routing import max_violation

    return max_violation(counts)


def reference_attribution(component: torch.Tensor, x_final: torch.Tensor, norm_weight: torch.Tensor,
                          unembed_row: torch.Tensor, eps: float) -> float:
    """06's ``my_attribution``: u . (g * c) / rms(x_L), the final norm's scale frozen at the whole stream."""
    return ((unembed_row * norm_weight * component).sum() / (x_final.pow(2).mean() + eps).sqrt()).item()


def reference_patch(activation: torch.Tensor, source: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """07's ``my_patch``: a copy of the activation with the source's values at the positions."""
    out = activation.clone()
    out[:, positions] = source[:, positions].to(out.dtype)
    return out


def reference_moe_block_parameters(cfg: K2Config) -> int:
    """08's ``my_moe_block_parameters``: ``k2lab.analysis.accounting.block_parameters`` of the first MoE block."""
    from ..analysis.accounting import block_parameters

    return block_parameters(cfg, cfg.first_k_dense_replace)


def reference_logit_lens(resid: torch.Tensor, norm: Callable, head: Callable) -> torch.Tensor:
    """09's ``my_logit_lens``: the final norm and the head, in float32."""
    return head(norm(resid)).float()


def reference_newton_schulz(G: torch.Tensor, steps: int) -> torch.Tensor:
    """10's ``my_newton_schulz``: k2lab's, in float32."""
    from ..training.optim import newton_schulz

    return newton_schulz(G, steps, dtype=torch.float32)


def reference_bias_update(bias: torch.Tensor, counts: torch.Tensor, u: float) -> torch.Tensor:
    """10's ``my_bias_update``: DeepSeek-V3's rule, a new tensor."""
    counts = counts.float()
    return bias + u * torch.sign(counts.mean(-1, keepdim=True) - counts)


def reference_purity(active: torch.Tensor, chosen: torch.Tensor) -> float:
    """11's ``my_purity``: the share of the feature's tokens that chose its most frequent expert."""
    return (chosen[active].sum(0).max() / active.sum()).item()


def reference_mutual_information(a: torch.Tensor, c: torch.Tensor) -> float:
    """11's ``my_mutual_information``: I(A; C) in bits over the four cells, an empty cell adding 0."""
    total = 0.0
    for x in (True, False):
        for y in (True, False):
            p_xy = ((a == x) & (c == y)).double().mean().item()
            if p_xy > 0:
                total += p_xy * math.log2(p_xy / ((a == x).double().mean().item() * (c == y).double().mean().item()))
    return total


# Every exercise whose answer belongs to the learner's module, by the name its stub gives the function.
PIECES: dict[str, Piece] = {p.name: p for p in [
    _piece("my_greedy", "00, exercise 3", "greedy decoding", "check_greedy", _function(reference_greedy),
           check=_on_nano("check_greedy")),
    _piece("my_train_bpe", "01, exercise 1", "BPE training", "check_bpe_training", _function(reference_train_bpe)),
    _piece("my_bpe", "01, exercise 2", "rank-BPE", "check_bpe", _function(reference_bpe)),
    _piece("my_rotate", "02, exercise 1", "the rotation", "check_rotation", _function(reference_rotate)),
    _piece("my_yarn", "02, exercise 2", "YaRN", "check_yarn_frequencies", _function(reference_yarn)),
    _piece("my_kv_cache_bytes", "03, exercise 1", "the cache's bytes", "check_kv_cache_bytes",
           _function(reference_kv_cache_bytes)),
    _piece("my_mla", "03, exercise 2", "MLA", "check_mla_forward", _function(reference_mla)),
    _piece("my_absorbed_score", "03, exercise 3", "the absorbed score", "check_absorbed_score",
           _function(reference_absorbed_score)),
    _piece("my_mla_absorbed", "03, exercise 4", "absorbed MLA", "check_mla_forward",
           _function(reference_mla_absorbed), check=_checker("check_mla_forward", absorbed=True)),
    _piece("my_router", "04a, exercise 1", "the router", "check_router", _function(reference_router)),
    _piece("my_group_router", "04a, exercise 2", "group-limited routing", "check_group_router",
           _function(reference_group_router)),
    _piece("my_rms_norm", "04b, exercise 1", "RMSNorm", "check_rms_norm", _function(reference_rms_norm)),
    _piece("my_swiglu", "04b, exercise 2", "SwiGLU", "check_swiglu", _function(reference_swiglu)),
    _piece("my_combine", "04b, exercise 3", "the MoE combine", "check_moe_combine", _function(reference_combine)),
    _piece("my_block", "04b, exercise 4", "the pre-norm block", "check_block", _function(reference_block)),
    _piece("my_max_violation", "05, exercise 1", "MaxVio", "check_max_violation",
           _function(reference_max_violation)),
    _piece("my_attribution", "06, exercise 1", "direct logit attribution", "check_logit_attribution",
           _function(reference_attribution)),
    _piece("my_patch", "07, exercise 1", "a patching hook", "check_patch_hook", _function(reference_patch)),
    _piece("my_moe_block_parameters", "08, exercise 3", "one MoE block's parameters", "check_moe_block_parameters",
           _function(reference_moe_block_parameters)),
    _piece("my_dequantize", "08, exercise 1", "FP8 dequantisation", "check_dequantize",
           _function(reference_dequantize)),
    _piece("my_release_to_state_dict", "08, exercise 2", "the release as a state dict", "check_release_state_dict",
           _function(reference_release_to_state_dict)),
    _piece("my_k2", "09, exercise 1", "K2 from its weights", "check_model_from_weights", reference_k2),
    _piece("my_cached_mla", "09, exercise 2", "MLA over your own latent cache", "check_cached_mla",
           _function(reference_cached_mla)),
    _piece("my_generate", "09, exercise 4", "greedy generation with your cache", "check_cached_generate",
           _function(reference_generate), check=_on_nano("check_cached_generate")),
    _piece("my_logit_lens", "09, exercise 5", "the logit lens", "check_logit_lens", _function(reference_logit_lens)),
    _piece("my_newton_schulz", "10, exercise 1", "Newton-Schulz", "check_newton_schulz",
           _function(reference_newton_schulz)),
    _piece("my_qk_clip", "10, exercise 2", "QK-Clip for one head", "check_qk_clip", _function(reference_qk_clip)),
    _piece("my_bias_update", "10, exercise 3", "the bias step", "check_bias_update", _function(reference_bias_update)),
    _piece("my_next_token_loss", "10, exercise 4", "the next-token loss", "check_next_token_loss",
           _function(reference_next_token_loss)),
    _piece("my_adamw_step", "10, exercise 5", "AdamW's step", "check_adamw_step", _function(reference_adamw_step)),
    _piece("my_muon_step", "10, exercise 6", "Muon's step", "check_muon_step", reference_muon_step),
    _piece("my_train_step", "10, exercise 7", "the training step", "check_train_step", reference_train_step),
    _piece("my_purity", "11, exercise 1", "a feature's purity", "check_feature_purity", _function(reference_purity)),
    _piece("my_mutual_information", "11, exercise 2", "mutual information", "check_mutual_information",
           _function(reference_mutual_information)),
]}
