"""00 and 09: the whole model. Greedy decoding (``check_greedy``) and K2 assembled from its state dict with the
learner's own pieces (``check_model_from_weights``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ...config import K2Config
from ...model import HookPoint, K2Model, generate, prepare_inputs
from ...model.rope import RotaryTable, cos_sin_scale, inverse_frequencies
from .attention import _mla_variant, mla_slips
from .checking import Verdict, call, checker, compare, generator, named

# --- the model the learner's function is handed: it must come back as it was -------------------------------------

_TORCH_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_PROBE_HOOKS = ("fns", "bwd_fns")  # a k2lab probe's own lists of attached functions
_COPY_LIMIT_BYTES = 2**28  # models up to this size are copied whole to compare (and put back) every value


class ModelState:
    """What a learner's function could change in a model it is handed: each module's train/eval flag, the hooks
    attached to it (PyTorch's and k2lab probes'), its parameters and buffers (their values where the model is small
    enough to copy, else their identity and version counters). ``restore`` puts back what it can and says what had
    changed."""

    def __init__(self, model: torch.nn.Module):
        self.modules = dict(model.named_modules())
        self.training = {name: m.training for name, m in self.modules.items()}
        self.hooks = {name: {attr: (dict(getattr(m, attr)) if isinstance(getattr(m, attr, None), dict)
                                    else list(getattr(m, attr))) for attr in (*_TORCH_HOOKS, *_PROBE_HOOKS)
                             if isinstance(getattr(m, attr, None), (dict, list))}
                      for name, m in self.modules.items()}
        tensors = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
        self.tensors = tensors
        self.versions = {name: (t._version, t.data_ptr()) for name, t in tensors.items()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        self.values = ({name: t.detach().clone() for name, t in tensors.items()} if size <= _COPY_LIMIT_BYTES
                       else None)

    def restore(self, model: torch.nn.Module) -> list[str]:
        """Put the model back as it was; what had changed, in words (empty when nothing had)."""
        changes = []
        modules = dict(model.named_modules())
        if modules.keys() != self.modules.keys() or any(modules[n] is not m for n, m in self.modules.items()):
            changes.append("replaced, added or removed submodules (the check cannot put those back)")
        flipped = [name or "the model" for name, m in self.modules.items() if m.training != self.training[name]]
        now = "training" if self.modules[""].training else "eval"
        for name, m in self.modules.items():
            m.training = self.training[name]
        if flipped:
            changes.append(f"switched {len(flipped)} modules into {now} mode (model.{now.replace('ing', '')}(): "
                           f"{', '.join(flipped[:3])}{', ...' if len(flipped) > 3 else ''})")
        hooked = []
        for name, m in self.modules.items():
            for attr, before in self.hooks[name].items():
                now = getattr(m, attr)
                if isinstance(before, dict):
                    added = [key for key in now if key not in before]
                    for key in added:
                        del now[key]
                else:
                    added = [fn for fn in now if all(fn is not old for old in before)]
                    now[:] = before
                if added:
                    hooked.append(f"{name}" if name else "the model")
        if hooked:
            changes.append(f"left hooks attached ({', '.join(sorted(set(hooked))[:3])}"
                           f"{', ...' if len(set(hooked)) > 3 else ''})")
        tensors = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
        edited = []
        for name, old in self.tensors.items():
            now = tensors.get(name)
            if now is None:
                edited.append(name)
                continue
            if self.values is not None:
                before = self.values[name]
                if now.shape != before.shape or not torch.equal(now.detach(), before):
                    edited.append(name)
                    with torch.no_grad():
                        if now.shape == before.shape:
                            now.copy_(before)
            elif (now._version, now.data_ptr()) != self.versions[name] or now is not old:
                edited.append(name)
        if edited:
            back = "put back" if self.values is not None else "NOT put back: reload the model"
            changes.append(f"changed {len(edited)} weights in place ({', '.join(edited[:3])}"
                           f"{', ...' if len(edited) > 3 else ''}; {back})")
        return changes


# --- greedy decoding ----------------------------------------------------------------------------------------------


def _ordinal(n: int) -> str:
    """1 -> "1st", 12 -> "12th", 33 -> "33rd"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _piece(model: torch.nn.Module, token: int) -> str:
    tok = getattr(model, "tokenizer", None)
    try:
        return f" {tok.id_to_piece(token)!r}" if tok is not None else ""
    except Exception:  # noqa: BLE001 - an id outside the vocabulary: the id alone says it
        return ""


@checker
def check_greedy(fn: Callable, model: torch.nn.Module, ids: torch.Tensor, new_tokens: int = 6) -> Verdict:
    """``fn(model, ids [1, T], n) -> [1, T + n]``: n greedy steps (argmax of the last position's logits, appended).
    ``fn`` gets the ids on the model's device, where the model's logits are, so that it can append to them.

    The model must come back unchanged: a function that switches it to training mode, leaves a hook attached or
    edits a weight fails, and the check puts the model back. A wrong answer is told the first step that differs,
    with both tokens."""
    if not isinstance(model, torch.nn.Module):
        return Verdict(False, f"check_greedy(fn, model, ids): model must be the model (k2lab.load(...) or the "
                              f"notebook's `model`), got a {type(model).__name__}")
    ids = torch.as_tensor(ids, device=model.device)
    if ids.ndim == 1:
        ids = ids[None]
    expected = generate(model, ids, max_new_tokens=new_tokens)
    state = ModelState(model)
    out, error = call(fn, model, ids.clone(), new_tokens, own={generate: "generate"})
    changes = state.restore(model)
    if changes:
        return named(f"your function changed the model it was given: it {'; it '.join(changes)}. A decoding "
                     f"function only reads the model (the check undid what it could)", "greedy decoding")
    if error is not None:
        return error
    T, n_out = ids.shape[1], expected.shape[1] - ids.shape[1]
    first = expected[:, T: T + 1]

    def mistakes() -> list[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            from_first, last_only = ids, ids
            for _ in range(n_out):  # each step's argmax over the FIRST position's logits; of the last token alone
                from_first = torch.cat([from_first, model(from_first)[:, 0].argmax(-1, keepdim=True)], dim=1)
                last_only = torch.cat([last_only, model(last_only[:, -1:])[:, -1].argmax(-1, keepdim=True)], dim=1)
        return [("you returned only the new tokens; return the prompt followed by them", expected[:, T:]),
                ("every new token is the same: feed each chosen token back in before the next step",
                 torch.cat([ids, first.expand(1, n_out)], dim=1)),
                ("you took the argmax of the FIRST position's logits; the next token comes from the last position's, "
                 "logits[:, -1]", from_first),
                ("you ran the model on the last token alone: without a cache, each step runs the model on the whole "
                 "sequence so far (the last token's logits then see every token before it)", last_only)]

    verdict = compare("greedy decoding", out, expected, mistakes, atol=0, rtol=0)
    answer = torch.as_tensor(out).detach().cpu() if isinstance(out, torch.Tensor) else None
    if verdict.ok or verdict.mistake is not None or answer is None or answer.shape != expected.shape:
        return verdict
    reference = expected.cpu()
    if not torch.equal(answer[:, :T], reference[:, :T]):
        return named("the prompt at the start of your answer differs from the ids given: return ids followed by "
                     "the new tokens", "greedy decoding")
    step = int((answer[0, T:] != reference[0, T:]).nonzero()[0]) if answer.shape[0] == 1 else 0
    yours, right = int(answer[0, T + step]), int(reference[0, T + step])
    with torch.no_grad():
        logits = model(reference[:, : T + step].to(model.device))[0, -1].float().cpu()  # [V] the right context's
    rank = int((logits > logits[yours]).sum()) + 1 if 0 <= yours < logits.numel() else None
    how = (f"yours is the {_ordinal(rank)} most likely token there, not the argmax: sampled, or taken from other "
           f"logits?" if rank else "yours is not a token id of this model")
    return named(f"the first {step} new tokens agree; step {step + 1} differs: yours is {yours}"
                 f"{_piece(model, yours)}, k2lab.generate's {right}{_piece(model, right)}, the argmax of the last "
                 f"position's logits after the {T + step} tokens before it; {how}", "greedy decoding")


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
    weights", "no scaling", "no renormalisation", "all experts" (renormalised over every expert), "choice without
    bias" or "no shared expert"."""
    seen: dict[str, torch.Tensor] = {}
    scaling = model.config.routed_scaling_factor

    def keep(t: torch.Tensor, hook: HookPoint) -> None:
        seen[hook.name.rsplit(".", 1)[-1]] = t

    def weights(t: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        source = seen["hook_choice_scores"] if edit == "bias in the weights" else seen["hook_scores"]
        if edit == "all experts":
            source = source / source.sum(-1, keepdim=True)
        w = source.gather(-1, seen["hook_topk_idx"])
        if edit == "no scaling":
            return w / w.sum(-1, keepdim=True)
        if edit in ("no renormalisation", "all experts"):
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


def _rotations(cfg: K2Config, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R] for positions 0 .. T-1 in the rotate-half layout, as the model makes them."""
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inverse_frequencies(cfg)  # [T, R/2]
    angles = torch.cat((angles, angles), dim=-1).to(device)
    return angles.cos() * cos_sin_scale(cfg), angles.sin() * cos_sin_scale(cfg)


def _layer_weights(model: K2Model, prefix: str) -> dict[str, torch.Tensor]:
    return {name.removeprefix(prefix): t for name, t in model.state_dict().items() if name.startswith(prefix)}


def _with_attention_slip(model: K2Model, ids: torch.Tensor, switches: dict) -> torch.Tensor:
    """The model's logits with one MLA slip made in every block's attention (its output replaced, through the
    probes, by ``_mla_variant`` of the block's normalised input)."""

    cfg = model.config
    cos, sin = _rotations(cfg, ids.shape[1], model.device)
    inputs: dict[str, torch.Tensor] = {}

    def keep(t: torch.Tensor, hook: HookPoint) -> None:
        inputs[hook.name.split(".input_layernorm")[0]] = t

    def slip(t: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        layer = hook.name.removesuffix(".hook_attn_out")
        w = _layer_weights(model, f"{layer}.self_attn.")
        return _mla_variant(w, cfg, inputs[layer], cos, sin, **switches).to(t.dtype)

    with model.hooks(fwd_hooks=[("input_layernorm.hook_out", keep), ("hook_attn_out", slip)]):
        return model(ids)


def _with_swapped_norms(model: K2Model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits with each block's two norms swapped: attention reads post_attention_layernorm(x), the
    feed-forward reads input_layernorm(.)."""
    streams: dict[str, torch.Tensor] = {}  # the norm's probe -> the stream that norm reads

    def keep(t: torch.Tensor, hook: HookPoint) -> None:
        layer, probe = hook.name.rsplit(".", 1)
        norm = "input_layernorm" if probe == "hook_resid_pre" else "post_attention_layernorm"
        streams[f"{layer}.{norm}.hook_out"] = t

    def swap(t: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        layer_name, norm_name = hook.name.split(".")[:2], hook.name.split(".")[2]
        layer = model.get_submodule(".".join(layer_name))
        other = layer.post_attention_layernorm if norm_name == "input_layernorm" else layer.input_layernorm
        return other(streams[hook.name]).to(t.dtype)

    hooks = [("hook_resid_pre", keep), ("input_layernorm.hook_out", swap), ("hook_resid_mid", keep),
             ("post_attention_layernorm.hook_out", swap)]
    with model.hooks(fwd_hooks=hooks):
        return model(ids)


def _with_silu_after_product(model: K2Model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits with every SwiGLU (dense blocks, routed and shared experts) computing
    down(silu(gate x * up x)) instead of down(silu(gate x) * up x)."""
    cfg = model.config

    def wrong(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return F.silu((x @ gate.T) * (x @ up.T)) @ down.T

    seen: dict[str, torch.Tensor] = {}

    def keep(t: torch.Tensor, hook: HookPoint) -> None:
        seen[hook.name] = t

    def ffn_in(layer: str) -> torch.Tensor:
        return seen[f"{layer}.post_attention_layernorm.hook_out"]

    def dense(t: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        layer = hook.name.removesuffix(".hook_mlp_out")
        if cfg.is_moe_layer(int(layer.split(".")[1])):
            return t
        mlp = model.get_submodule(f"{layer}.mlp")
        return wrong(ffn_in(layer), mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight).to(t.dtype)

    def shared(t: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        layer = hook.name.removesuffix(".mlp.hook_shared_out")
        s = model.get_submodule(f"{layer}.mlp.shared_experts")
        return wrong(ffn_in(layer), s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight).to(t.dtype)

    def experts(t: torch.Tensor, hook: HookPoint) -> torch.Tensor:  # [B, T, k, D]
        layer = hook.name.removesuffix(".mlp.hook_expert_out")
        stacked = _layer_weights(model, f"{layer}.mlp.experts.")
        idx, x = seen[f"{layer}.mlp.gate.hook_topk_idx"], ffn_in(layer)  # [B, T, k], [B, T, D]
        out = torch.stack([torch.stack([torch.stack([
            wrong(x[b, t_], stacked["gate_proj"][e], stacked["up_proj"][e], stacked["down_proj"][e])
            for e in idx[b, t_].tolist()]) for t_ in range(idx.shape[1])]) for b in range(idx.shape[0])])
        return out.to(t.dtype)

    hooks = [("post_attention_layernorm.hook_out", keep), ("mlp.gate.hook_topk_idx", keep),
             ("hook_mlp_out", dense), ("mlp.hook_shared_out", shared), ("mlp.hook_expert_out", experts)]
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


def _model_mistakes(model: K2Model, ids: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The logits of the usual assembly mistakes, each with what went wrong, made one at a time (a match stops the
    search); a slip inside one of the pieces says which piece's checker to run."""
    inputs = prepare_inputs(model, ids)
    x = model.run_blocks(model.embed(inputs.ids), inputs)  # [B, T, D] the last residual
    final = model.norm(x)
    yield ("you tied the head to the embedding; K2's lm_head is a matrix of its own (lm_head.weight)",
           F.linear(final, model.embed_tokens.weight).float())
    yield "you forgot the final norm: the head reads norm(x) after the last block", model.lm_head(x).float()
    router = [
        ("bias in the weights", "the correction bias is in your expert weights: it decides WHICH experts are chosen, "
                                "the weights come from the sigmoid scores alone"),
        ("no scaling", "you forgot routed_scaling_factor: the routed experts' weights sum to it, not to 1"),
        ("no renormalisation", "you did not renormalise the chosen experts' weights (divide by their sum) before "
                               "scaling"),
        ("all experts", "your router renormalises over ALL experts; it renormalises over the k chosen ones"),
        ("choice without bias", "you chose the experts by the sigmoid scores alone: the choice is top-k of scores + "
                                "correction bias"),
    ]
    for edit, message in router:
        yield f"{message} (run check_router on your router)", _with_router_edit(model, ids, edit)
    yield ("you forgot the shared expert: every MoE block adds it for every token",
           _with_router_edit(model, ids, "no shared expert"))
    yield ("you swapped each block's norms: attention reads input_layernorm(x), the feed-forward "
           "post_attention_layernorm(.) (run check_block on your block)", _with_swapped_norms(model, ids))
    yield ("your SwiGLU applies SiLU after the product; it goes on the gate alone, down(silu(gate x) * up x) (run "
           "check_swiglu on your SwiGLU)", _with_silu_after_product(model, ids))
    if model.config.rope_type == "yarn":
        yield ("your rotations use plain RoPE frequencies: K2's are YaRN's (02), the slow pairs divided by the factor",
               _with_plain_rope(model, ids))
    for slip, switches in mla_slips(model.config):
        yield (f"your attention has a slip: {slip} (run check_mla_forward on your MLA)",
               _with_attention_slip(model, ids, switches))


@checker
def check_model_from_weights(fn: Callable, model: K2Model | None = None, ids: torch.Tensor | None = None) -> Verdict:
    """``fn(state_dict: dict[str, Tensor], cfg: K2Config, ids [B, T]) -> logits [B, T, V]``: the whole K2 computed
    from its weights with your own pieces, equal to ``k2lab.K2Model`` to float32 rounding (1e-5).

    ``state_dict`` is ``model.state_dict()``: the checkpoint's names without the leading ``model.``
    (``layers.0.self_attn.q_a_proj.weight``, ``layers.1.mlp.gate.e_score_correction_bias``, ``norm.weight``,
    ``lm_head.weight``), except that each MoE block's routed experts are stacked: ``layers.i.mlp.experts.gate_proj``
    [E, I, D], ``up_proj`` [E, I, D], ``down_proj`` [E, D, I]. The positions are 0 .. T-1, the attention causal.

    By default the check uses a small K2 with random weights and a non-zero router bias (``small_k2``); pass
    ``model`` (K2-nano from ``k2lab.load_nano()``, say) and ``ids`` to check against that one. An answer that runs
    k2lab's own ``K2Model`` fails; one that runs k2lab's modules for some of its pieces passes with a note naming
    them (they stand in for your own). A wrong answer is matched against the usual slips of every piece, each
    with the checker to run on it."""
    if model is not None and not isinstance(model, K2Model):
        return Verdict(False, f"check_model_from_weights(fn, model, ids): model must be a k2lab K2Model (or None for "
                              f"the check's own small K2), got a {type(model).__name__}")
    model = small_k2() if model is None else model
    ids = torch.tensor([[5, 17, 2, 88, 41, 9, 63], [1, 1, 30, 30, 72, 15, 0]]) if ids is None else torch.as_tensor(ids)
    ids = (ids[None] if ids.ndim == 1 else ids).to(model.device)
    state_dict = {name: t.detach().clone() for name, t in model.state_dict().items()}
    pieces = {model_class: model_class.__name__ for model_class in
              {type(m) for m in model.modules()} - {K2Model, HookPoint, torch.nn.ModuleList}}
    with torch.no_grad():
        expected = model(ids)
        out, error = call(fn, state_dict, model.config, ids.clone(), own={K2Model.forward: "K2Model",
                                                                            K2Model.run_blocks: "K2Model.run_blocks"},
                          uses=pieces | {inverse_frequencies: "inverse_frequencies (YaRN)",
                                         K2Config.softmax_scale: "K2Config.softmax_scale"})
        if error is not None:
            return error
        verdict = compare("K2 from its weights", out, expected, lambda: _model_mistakes(model, ids), atol=1e-5,
                          rtol=1e-5)
    answer = torch.as_tensor(out).detach().cpu() if verdict.ok or verdict.mistake is None else None
    if verdict.ok:
        agree = (answer.argmax(-1) == expected.cpu().argmax(-1)).float().mean().item()
        return Verdict(True, f"{verdict.message}; your model picks the same next token at {agree:.0%} of positions")
    if answer is not None and answer.shape == expected.shape and ids.shape[1] > 1 and torch.allclose(
            answer[:, 0].double(), expected[:, 0].cpu().double(), atol=1e-5, rtol=1e-5):
        message = ("position 0 is right and the later positions are not: what mixes positions is attention (its "
                   "causal mask, its rotations, its scale), since at position 0 a query sees only its own key and "
                   "the rotation turns by 0; run check_mla_forward on your MLA")
        return named(f"{message} ({verdict.message.split(': ', 1)[1]})", "K2 from its weights")
    if answer is not None and answer.shape == expected.shape and verdict.mistake is None:
        return named("position 0 is wrong too (where attention only passes each token's own value through), so the "
                     "slip is not only in how attention mixes positions: it is in a piece that works token by token "
                     "(a norm, a SwiGLU, the router, the head) or in attention's projections; run check_rms_norm, "
                     "check_swiglu, check_router, check_block and check_mla_forward on yours", "K2 from its weights")
    return verdict
