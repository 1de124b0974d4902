"""04 and 04b: the router's five stages (``check_router``) and the block's parts (``check_rms_norm``,
``check_swiglu``, ``check_moe_combine``, ``check_block``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...config import K2Config
from ...model.layers import RMSNorm, SwiGLU
from ...model.moe import Router
from .checking import Verdict, as_tensor, call, checker, compare, generator, gives, named, same, scales_with

# --- 04: the router's five stages ---------------------------------------------------------------------------------


def _by_expert(idx: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row's (expert, weight) pairs by expert, so that the order of the slots does not matter."""
    order = idx.argsort(-1)
    return idx.gather(-1, order), weights.gather(-1, order)


def _router_case(cfg: K2Config, seed: int, tokens: int = 16) -> tuple[Router, torch.Tensor]:
    """A router for ``cfg`` with random weights and a correction bias large enough to change choices, and its
    input x [tokens, D]."""
    g = generator(seed)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(cfg.n_routed_experts, cfg.hidden_size, generator=g) * 0.15)
        router.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.3)
    return router, torch.randn(tokens, cfg.hidden_size, generator=g)


# K2-nano's router (32 experts, top 4, scaling 2.827), then one with other numbers and a routed scaling of 1.0
# (DeepSeek-V2-Lite's, say), where numbers written into the answer instead of read from the arguments show.
ROUTER_CONFIGS = [("K2-nano", K2Config.nano()),
                  ("a second router (12 experts, top 3, scaling 1.0)",
                   K2Config.nano().replace(n_routed_experts=12, num_experts_per_tok=3, routed_scaling_factor=1.0))]


def _check_one_router(fn: Callable, name: str, cfg: K2Config, seed: int) -> Verdict | None:
    """None when ``fn`` routes like k2lab's Router on this case, else the verdict."""
    router, x = _router_case(cfg, seed)
    with torch.no_grad():
        idx, weights = router(x[None])
    idx_ranked, weights_ranked = idx[0], weights[0]  # k2lab's slot order: by choice score, highest first
    idx, weights = _by_expert(idx_ranked, weights_ranked)
    bias, k, scaling = router.e_score_correction_bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor
    out, error = call(fn, x.clone(), router.weight.detach().clone(), bias.clone(), k, scaling,
                      own={Router: "Router"})
    where = "router" if name == ROUTER_CONFIGS[0][0] else f"router, {name}"
    if error is not None:
        return error
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        return named("return two tensors: (idx [N, k], weights [N, k])", where)
    out_idx, out_w = (torch.as_tensor(t).detach().cpu() if t is not None else None for t in out)  # beside idx
    if out_idx is None or out_w is None:
        return named("one of your two outputs is None", where)
    if out_idx.shape[-1:] == out_w.shape[-1:] != idx.shape[-1:] and out_idx.shape[:-1] == idx.shape[:-1]:
        return named(f"you chose {out_idx.shape[-1]} experts per token; use the top_k argument ({k} here) instead of "
                     f"a number written in", where)
    if out_idx.shape != idx.shape or out_w.shape != weights.shape:
        return named(f"wrong shapes: got idx {list(out_idx.shape)} and weights {list(out_w.shape)}, expected [N, k] "
                     f"= {list(idx.shape)} for both", where)
    given_idx = out_idx.long()
    out_idx, out_w = _by_expert(given_idx, out_w.float())
    logits = x @ router.weight.detach().T  # [N, E]
    s = logits.sigmoid()
    top = lambda scores: scores.topk(k, dim=-1).indices.sort(-1).values  # noqa: E731
    if not torch.equal(out_idx, idx):
        choices = [("you chose by s alone: the choice is top-k of s + bias (the bias decides WHO is chosen)", top(s)),
                   ("you chose by softmax(logits) + bias; K2's affinities are sigmoid(logits)",
                    top(logits.softmax(-1) + bias)),
                   ("you added the bias to the logits; it is added to the sigmoid scores s", top(logits + bias)),
                   ("you chose by the logits alone; the choice is top-k of sigmoid(logits) + bias", top(logits)),
                   ("you took the k LOWEST choice scores", (s + bias).topk(k, largest=False).indices.sort(-1).values),
                   ("you subtracted the bias; the choice score is s + bias", top(s - bias))]
        for message, candidate in choices:
            if torch.equal(out_idx, candidate):
                return named(f"chosen experts: {message}", where)
        rows = int((out_idx != idx).any(-1).sum())
        differ = f"your chosen experts differ from k2lab's in {rows} of {len(idx)} tokens"
        unbiased, error = call(fn, x.clone(), router.weight.detach().clone(), torch.zeros_like(bias), k, scaling,
                               keep=False)
        if error is None and isinstance(unbiased, (tuple, list)) and len(unbiased) == 2:
            chosen = torch.as_tensor(unbiased[0]).detach().cpu().long().sort(-1).values
            if chosen.shape == idx.shape and torch.equal(chosen, top(s)):
                return named(f"{differ}; with a zero bias they are right, so the bias is used wrongly: the choice "
                             f"is top-k of s + bias (the bias added to the sigmoid scores)", where)
            return named(f"{differ}, even with a zero bias: the scores you rank are not the sigmoid scores "
                         f"s = sigmoid(x W^T) (plus the bias)", where)
        return Verdict(False, f"{where}: {differ}")
    picked = lambda scores: scores.gather(-1, idx)  # noqa: E731
    renorm = lambda w: w / w.sum(-1, keepdim=True)  # noqa: E731

    def mistakes() -> list[tuple[str, torch.Tensor]]:
        found = [
            ("the bias is in your weights: gather them from s, not from s + bias", renorm(picked(s + bias)) * scaling),
            ("you forgot to renormalise over the chosen experts (divide by their sum)", picked(s) * scaling),
            ("you forgot the routed_scaling_factor (the weights should sum to it)", renorm(picked(s))),
            ("you renormalised over ALL experts (s / s.sum() over E); renormalise over the k chosen ones, so that "
             "their weights sum to 1 before scaling", picked(s / s.sum(-1, keepdim=True)) * scaling),
            ("your weights come from softmax(logits); K2's from sigmoid(logits)",
             renorm(picked(logits.softmax(-1))) * scaling),
            ("your weights are the raw logits", picked(logits)),
            ("you reordered the indices (sorted them, say) but not the weights with them: each weight must stay "
             "beside its expert (reorder both with the same permutation, or neither)",
             weights_ranked.float().gather(-1, given_idx.argsort(-1))),
            ("you sorted the weights but not the indices with them: each weight must stay beside its expert",
             weights_ranked.float().sort(-1, descending=True).values.gather(-1, given_idx.argsort(-1))),
        ]
        if scaling != K2Config.nano().routed_scaling_factor:
            found.append((f"your weights sum to K2's 2.827 where this router's scaling is {scaling:g}: use the "
                          f"`scaling` argument instead of a number written in", renorm(picked(s)) * 2.827))
        return found

    verdict = compare(f"{where}, weights", out_w, weights, mistakes)
    if verdict.ok:
        return None
    if verdict.mistake is None:
        sums = out_w.double().sum(-1)
        if not torch.allclose(sums, torch.full_like(sums, scaling), atol=1e-4, rtol=1e-4):
            low, high = sums.aminmax()
            return named(f"your weights sum to {low.item():.4g} .. {high.item():.4g} per token; they sum to the "
                         f"routed scaling ({scaling:g}): renormalise over the chosen experts, then scale", where)
        return named("your weights sum to the routed scaling, but are not proportional to the chosen experts' "
                     "sigmoid scores s (the bias, a softmax or another score in them?)", where)
    return verdict


@checker
def check_router(fn: Callable) -> Verdict:
    """``fn(x [N, D], weight [E, D], bias [E], top_k, scaling) -> (idx [N, k], weights [N, k])``: K2's router
    (sigmoid, bias only in the choice, renormalised over the chosen experts, scaled), checked against k2lab's
    ``Router`` on K2-nano's router and on a second one (12 experts, top 3, a routed scaling of 1.0). The slots may
    come in any order, as long as each weight stays beside its expert."""
    for seed, (name, cfg) in enumerate(ROUTER_CONFIGS, start=4):
        verdict = _check_one_router(fn, name, cfg, seed)
        if verdict is not None:
            return verdict
    return Verdict(True, "router: same experts and weights as k2lab's Router, on K2-nano's router and on one with "
                         "scaling 1.0")


# --- 04b: the block -----------------------------------------------------------------------------------------------


@checker
def check_rms_norm(fn: Callable) -> Verdict:
    """``fn(x [..., D], weight [D], eps) -> [..., D]``: RMSNorm, checked against ``k2lab.model.layers.RMSNorm``."""
    g = generator(5)
    D, eps = 16, 0.05  # a large eps and one tiny row, so that forgetting eps shows
    x = torch.randn(2, 5, D, generator=g) * 3 + 1.5  # not centred, so that subtracting the mean shows
    x[0, 0] *= 0.01
    norm = RMSNorm(D, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
        expected = norm(x)
    w = norm.weight.detach()
    out, error = call(fn, x.clone(), w.clone(), eps, own={RMSNorm: "RMSNorm"})
    if error is not None:
        return error
    ms = x.pow(2).mean(-1, keepdim=True)
    centred = x - x.mean(-1, keepdim=True)
    mistakes = [
        ("you forgot the eps inside the square root", x / ms.sqrt() * w),
        ("the eps goes inside the square root: x / sqrt(mean(x²) + eps)", x / (ms.sqrt() + eps) * w),
        ("you forgot the weight g (the learned per-feature scale)", x / (ms + eps).sqrt()),
        ("you subtracted the mean: that is LayerNorm; RMSNorm does not centre",
         centred / (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w),
        ("you divided by the mean square; divide by its square root", x / (ms + eps) * w),
        ("you used the sum of squares; RMSNorm uses their mean", x / (x.pow(2).sum(-1, keepdim=True) + eps).sqrt() * w),
        ("you multiplied by the rms; divide by it", x * (ms + eps).sqrt() * w),
        ("you averaged over the wrong dimension: normalise over the last one, the features",
         x / (x.pow(2).mean(0, keepdim=True) + eps).sqrt() * w),
    ]
    verdict = compare("RMSNorm", out, expected, mistakes, terms={"x, your input": x}, axes={1: "position"})
    if verdict.ok or verdict.mistake is not None:
        return verdict
    if scales_with(fn, (x, w, eps), 1, out) is False:
        return named("the weight multiplies the normalised x, so doubling `weight` must double your output, and "
                     "yours does not: x / rms(x) * weight", "RMSNorm")
    return verdict


@checker
def check_swiglu(fn: Callable) -> Verdict:
    """``fn(x [N, D], gate [I, D], up [I, D], down [D, I]) -> [N, D]``: SwiGLU, against
    ``k2lab.model.layers.SwiGLU``."""
    g = generator(6)
    D, hidden = 12, 20
    mlp = SwiGLU(D, hidden)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    x = torch.randn(7, D, generator=g)
    with torch.no_grad():
        expected = mlp(x)
    gate, up, down = (p.detach() for p in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))
    out, error = call(fn, x.clone(), gate.clone(), up.clone(), down.clone(), own={SwiGLU: "SwiGLU"})
    if error is not None:
        return error
    a, b = x @ gate.T, x @ up.T  # [N, I]
    mistakes = [
        ("you applied SiLU after the product, silu(gate x * up x); it goes on the gate alone: "
         "down(silu(gate x) * up x)", F.silu(a * b) @ down.T),
        ("you forgot the down projection: the product silu(gate x) * up x is I wide; down_proj brings it back to D",
         F.silu(a) * b),
        ("you applied SiLU to the up projection; it goes on the gate: down(silu(gate x) * up x)",
         (a * F.silu(b)) @ down.T),
        ("ReLU instead of SiLU (silu(z) = z * sigmoid(z))", (F.relu(a) * b) @ down.T),
        ("sigmoid instead of SiLU (silu(z) = z * sigmoid(z))", (a.sigmoid() * b) @ down.T),
        ("GELU instead of SiLU (silu(z) = z * sigmoid(z))", (F.gelu(a) * b) @ down.T),
        ("you left out the up projection: the gate multiplies up(x)", F.silu(a) @ down.T),
    ]
    verdict = compare("SwiGLU", out, expected, mistakes)
    if verdict.ok or verdict.mistake is not None:
        return verdict
    for index, name, role in ((3, "down", "the down projection comes last, with nothing after it"),
                              (2, "up", "up x multiplies silu(gate x): it is neither added nor put through a "
                                        "nonlinearity")):
        linear = scales_with(fn, (x, gate, up, down), index, out)
        if linear is False:
            return named(f"SwiGLU is linear in its {name} projection, so doubling `{name}` must double your output, "
                         f"and yours does not: {role}; down(silu(gate x) * up x)", "SwiGLU")
        if linear is None:
            return verdict
    return named("your output is linear in up and in down, as it should be, so what differs is the gate's side: "
                 "silu(gate x), with silu(z) = z * sigmoid(z)", "SwiGLU")


@checker
def check_moe_combine(fn: Callable) -> Verdict:
    """``fn(shared [N, D], expert_out [N, k, D], weights [N, k]) -> [N, D]``: the MoE's output, shared expert plus
    the weighted sum of the chosen experts' outputs (``k2lab.model.moe.MoE.forward``)."""
    g = generator(7)
    N, k, D = 5, 4, 6
    shared, expert_out = torch.randn(N, D, generator=g), torch.randn(N, k, D, generator=g)
    weights = torch.rand(N, k, generator=g) * 1.2
    routed = (expert_out * weights[..., None]).sum(1)  # [N, D]
    expected = shared + routed
    out, error = call(fn, shared.clone(), expert_out.clone(), weights.clone())
    if error is not None:
        return error
    mistakes = [
        ("you forgot the shared expert: it is added to every token", routed),
        ("you forgot the weights: each expert's output is multiplied by its weight", shared + expert_out.sum(1)),
        ("you averaged the slots; the MoE sums them", shared + routed / k),
        ("you renormalised the weights to sum to 1; they already carry routed_scaling_factor",
         shared + (expert_out * (weights / weights.sum(-1, keepdim=True))[..., None]).sum(1)),
    ]
    verdict = compare("MoE combine", out, expected, mistakes, axes={0: "tokens"})
    if verdict.ok or verdict.mistake is not None:
        return verdict
    probes = [((torch.zeros_like(shared), expert_out, weights), routed, "with the shared expert zero your output is "
               "the weighted sum, which is right, so what you do with the shared expert is wrong: it is added once, "
               "unweighted"),
              ((shared, torch.zeros_like(expert_out), weights), shared, "with every expert's output zero your output "
               "is the shared expert, which is right, so the routed part is wrong: the sum over the k slots of "
               "weight * expert output")]
    for args, right, message in probes:
        if gives(fn, args, right):
            return named(message, "MoE combine")
    return verdict


@checker
def check_block(fn: Callable) -> Verdict:
    """``fn(x [N, D], input_norm, attn, post_norm, ffn) -> [N, D]``: one pre-norm block, x + attn(norm(x)), then
    + ffn(norm(.)), as ``k2lab.model.transformer.DecoderLayer`` runs it (here ``attn`` and ``ffn`` are plain
    functions [N, D] -> [N, D], so the check needs no positions)."""
    g = generator(8)
    D = 12
    norms = [RMSNorm(D), RMSNorm(D)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    w_attn, ffn_module = torch.randn(D, D, generator=g) * 0.5, SwiGLU(D, 16)
    with torch.no_grad():
        for p in ffn_module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    attn = lambda h: torch.tanh(h @ w_attn)  # noqa: E731
    ffn = lambda h: ffn_module(h)  # noqa: E731
    x = torch.randn(4, D, generator=g) * 2 + 0.5
    n1, n2 = norms
    with torch.no_grad():
        mid = x + attn(n1(x))
        expected = mid + ffn(n2(mid))
        out, error = call(fn, x.clone(), n1, attn, n2, ffn)
        if error is not None:
            return error
        post = n1(x + attn(x))
        mistakes = [
            ("post-norm: you normalised after adding; K2 normalises each sublayer's INPUT (pre-norm)",
             n2(post + ffn(post))),
            ("you forgot the first residual: keep x and add attention's output to it",
             attn(n1(x)) + ffn(n2(attn(n1(x))))),
            ("you forgot the second residual: add the FFN's output to the stream after attention", ffn(n2(mid))),
            ("the FFN must read the stream AFTER attention, not the block's input x (that is a parallel block)",
             mid + ffn(n2(x))),
            ("you wrote the normalised stream back into the residual: the residual itself is never normalised",
             n1(x) + attn(n1(x)) + ffn(n2(n1(x) + attn(n1(x))))),
            ("you used input_norm twice; the FFN has its own post_attention_layernorm", mid + ffn(n1(mid))),
            ("you forgot the norms: each sublayer reads a normalised copy, attn(input_norm(x)) and "
             "ffn(post_norm(.)), while the residual stream itself stays unnormalised",
             x + attn(x) + ffn(x + attn(x))),
            ("attention reads x itself: it must read input_norm(x)", (x + attn(x)) + ffn(n2(x + attn(x)))),
            ("the FFN reads the stream itself: it must read post_norm(.) of it", mid + ffn(mid)),
            ("you swapped the norms: attention reads input_norm(x), the FFN reads post_norm(.) (its "
             "post_attention_layernorm)", (x + attn(n2(x))) + ffn(n1(x + attn(n2(x))))),
        ]
        verdict = compare("pre-norm block", out, expected, mistakes)
        if verdict.ok or verdict.mistake is not None:
            return verdict
        zero = lambda h: torch.zeros_like(h)  # noqa: E731
        still, error = call(fn, x.clone(), n1, zero, n2, zero, keep=False)
        if error is None and as_tensor(still) is not None and not same(as_tensor(still), x, 1e-5, 1e-4):
            return named("with attention and the FFN both returning zeros your block must give x back (the residual "
                         "stream passes through untouched: the norms only shape what each sublayer reads), and yours "
                         "does not", "pre-norm block")
        halves = [((x, n1, attn, n2, zero), mid, "with the FFN returning zeros your block gives x + "
                   "attn(input_norm(x)), which is right, so the FFN half is wrong: it adds ffn(post_norm(h)), h the "
                   "stream after attention"),
                  ((x, n1, zero, n2, ffn), x + ffn(n2(x)), "with attention returning zeros your block is right, so "
                   "the attention half is wrong: h = x + attn(input_norm(x)), the residual kept")]
        for args, right, message in halves:
            if gives(fn, args, right):
                return named(message, "pre-norm block")
        return verdict
