"""00 and 09: the whole model. Greedy decoding (``check_greedy``) and K2 assembled from its state dict with the
learner's own pieces (``check_model_from_weights``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...config import K2Config
from ...model.inputs import prepare_inputs
from ...model.layers import HookPoint
from ...model.rope import RotaryTable
from ...model.transformer import K2Model
from .checking import Verdict, call, checker, compare, generator

# --- greedy decoding ----------------------------------------------------------------------------------------------


@checker
def check_greedy(fn: Callable, model: torch.nn.Module, ids: torch.Tensor, new_tokens: int = 6) -> Verdict:
    """``fn(model, ids [1, T], n) -> [1, T + n]``: n greedy steps (argmax of the last position's logits, appended).
    ``fn`` gets the ids on the model's device, where the model's logits are, so that it can append to them."""
    from ...model.generate import generate

    ids = torch.as_tensor(ids, device=model.device)
    expected = generate(model, ids, max_new_tokens=new_tokens)
    out, error = call(fn, model, ids.clone(), new_tokens)
    if error is not None:
        return error
    n_out = expected.shape[1] - ids.shape[1]
    first = expected[:, ids.shape[1]: ids.shape[1] + 1]
    mistakes = [("you returned only the new tokens; return the prompt followed by them", expected[:, ids.shape[1]:]),
                ("every new token is the same: feed each chosen token back in before the next step",
                 torch.cat([ids, first.expand(1, n_out)], dim=1))]
    return compare("greedy decoding", out, expected, mistakes, atol=0, rtol=0)


# --- the whole model from its weights -----------------------------------------------------------------------------


def small_k2(seed: int = 31) -> K2Model:
    """A small K2 with random weights under which the usual assembly mistakes show: every switch of K2 (q and kv
    latents, YaRN, a dense first block, then MoE blocks with a sigmoid router, a NON-ZERO correction bias that
    changes choices, renormalised and scaled weights, a shared expert), norm weights far from one, an untied head."""
    cfg = K2Config.nano().replace(num_hidden_layers=3, vocab_size=96, n_routed_experts=8, num_experts_per_tok=3,
                                  bos_token_id=None, eos_token_id=None)
    model = K2Model(cfg)
    g = generator(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                fan_in = p.shape[-1] if not name.startswith("embed_tokens") else 1
                p.copy_(torch.randn(p.shape, generator=g) * fan_in**-0.5)
        for layer in model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.3)
    return model.eval()


def _with_router_edit(model: K2Model, ids: torch.Tensor, edit: str) -> torch.Tensor:
    """The model's logits with one usual router mistake made in every MoE block, through its probes: "bias in the
    weights", "no scaling", "no renormalisation", "choice without bias" or "no shared expert"."""
    seen: dict[str, torch.Tensor] = {}
    scaling = model.config.routed_scaling_factor

    def keep(t: torch.Tensor, hook: HookPoint) -> None:
        seen[hook.name.rsplit(".", 1)[-1]] = t

    def weights(t: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        source = seen["hook_choice_scores"] if edit == "bias in the weights" else seen["hook_scores"]
        w = source.gather(-1, seen["hook_topk_idx"])
        if edit == "no scaling":
            return w / w.sum(-1, keepdim=True)
        if edit == "no renormalisation":
            return w * scaling
        return w / w.sum(-1, keepdim=True) * scaling

    hooks = [(name, keep) for name in ("mlp.gate.hook_scores", "mlp.gate.hook_choice_scores", "mlp.gate.hook_topk_idx")]
    if edit == "choice without bias":
        hooks.insert(1, ("mlp.gate.hook_choice_scores", lambda t, hook: seen["hook_scores"]))
    elif edit == "no shared expert":
        hooks.append(("mlp.hook_shared_out", lambda t, hook: torch.zeros_like(t)))
    else:
        hooks.append(("mlp.gate.hook_topk_weights", weights))
    with model.hooks(fwd_hooks=hooks):
        return model(ids)


def _with_plain_rope(model: K2Model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits with RoPE's plain frequencies, theta^(-2i/R), instead of YaRN's."""
    cfg = model.config
    saved = model.rotary
    R = cfg.qk_rope_head_dim
    plain = 1.0 / cfg.rope_theta ** (torch.arange(0, R, 2, dtype=torch.float32) / R)
    model.rotary = RotaryTable(plain, 1.0, cfg.max_position_embeddings)
    try:
        return model(ids)
    finally:
        model.rotary = saved


def _model_mistakes(model: K2Model, ids: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The logits of the usual assembly mistakes, each with what went wrong."""
    inputs = prepare_inputs(model, ids)
    x = model.run_blocks(model.embed(inputs.ids), inputs)  # [B, T, D] the last residual
    final = model.norm(x)
    mistakes = [
        ("you tied the head to the embedding; K2's lm_head is a matrix of its own (lm_head.weight)",
         F.linear(final, model.embed_tokens.weight).float()),
        ("you forgot the final norm: the head reads norm(x) after the last block", model.lm_head(x).float()),
        ("the correction bias is in your expert weights: it decides WHICH experts are chosen, the weights come "
         "from the sigmoid scores alone", _with_router_edit(model, ids, "bias in the weights")),
        ("you forgot routed_scaling_factor: the routed experts' weights sum to it, not to 1",
         _with_router_edit(model, ids, "no scaling")),
        ("you did not renormalise the chosen experts' weights (divide by their sum) before scaling",
         _with_router_edit(model, ids, "no renormalisation")),
        ("you chose the experts by the sigmoid scores alone: the choice is top-k of scores + correction bias",
         _with_router_edit(model, ids, "choice without bias")),
        ("you forgot the shared expert: every MoE block adds it for every token",
         _with_router_edit(model, ids, "no shared expert")),
    ]
    if model.config.rope_type == "yarn":
        mistakes.append(("your rotations use plain RoPE frequencies: K2's are YaRN's (02), the slow pairs divided "
                         "by the factor", _with_plain_rope(model, ids)))
    return mistakes


@checker
def check_model_from_weights(fn: Callable, model: K2Model | None = None, ids: torch.Tensor | None = None) -> Verdict:
    """``fn(state_dict: dict[str, Tensor], cfg: K2Config, ids [B, T]) -> logits [B, T, V]``: the whole K2 computed
    from its weights with your own pieces, equal to ``k2lab.K2Model`` within 1e-5.

    ``state_dict`` is ``model.state_dict()``: the checkpoint's names without the leading ``model.``
    (``layers.0.self_attn.q_a_proj.weight``, ``layers.1.mlp.gate.e_score_correction_bias``, ``norm.weight``,
    ``lm_head.weight``), except that each MoE block's routed experts are stacked: ``layers.i.mlp.experts.gate_proj``
    [E, I, D], ``up_proj`` [E, I, D], ``down_proj`` [E, D, I]. The positions are 0 .. T-1, the attention causal.

    By default the check uses a small K2 with random weights and a non-zero router bias (``small_k2``); pass
    ``model`` (K2-nano from ``k2lab.load_nano()``, say) and ``ids`` to check against that one."""
    model = small_k2() if model is None else model
    ids = torch.tensor([[5, 17, 2, 88, 41, 9, 63], [1, 1, 30, 30, 72, 15, 0]]) if ids is None else torch.as_tensor(ids)
    ids = ids.to(model.device)
    state_dict = {name: t.detach().clone() for name, t in model.state_dict().items()}
    with torch.no_grad():
        expected = model(ids)
        out, error = call(fn, state_dict, model.config, ids.clone())
        if error is not None:
            return error
        verdict = compare("K2 from its weights", out, expected, _model_mistakes(model, ids), atol=1e-5, rtol=1e-5)
    if verdict.ok:
        agree = (torch.as_tensor(out).detach().cpu().argmax(-1) == expected.cpu().argmax(-1)).float().mean().item()
        return Verdict(True, f"{verdict.message}; your model picks the same next token at {agree:.0%} of positions")
    return verdict
