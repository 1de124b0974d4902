"""Check functions for the notebooks' "write it yourself" exercises.

Each ``check_*`` runs the learner's function on fixed inputs, compares the result with k2lab's own module (or the
formula k2lab implements), and returns a ``Verdict``: ``✓ ...`` when it agrees, otherwise ``✗`` and WHAT is wrong
(wrong shape, wrong scale, the eps forgotten, the bias in the weights, ...). The common mistakes are recognised by
computing them too: if the learner's output equals a known mistake's, the verdict names it.

    from k2lab.lab import exercises
    exercises.check_rms_norm(my_rms_norm)      # ✓ or ✗ with the reason

A stub that still raises ``NotImplementedError`` gets "not written yet", so a notebook with unsolved exercises
still runs from top to bottom.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..analysis.accounting import kv_cache_bytes
from ..analysis.routing import max_violation
from ..config import K2Config
from ..model.attention import apply_rotary
from ..model.layers import RMSNorm, SwiGLU
from ..model.moe import Router
from ..model.rope import inverse_frequencies
from ..tokenizer.ranks import rank_bpe

Mistake = tuple[str, Any]  # (what the learner did wrong, the output that mistake gives)


@dataclass(frozen=True)
class Verdict:
    """The outcome of a check: ``ok`` and a sentence. Shown as ``✓ sentence`` or ``✗ sentence``; true when ok."""

    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"{'✓' if self.ok else '✗'} {self.message}"


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _call(fn: Callable, *args: Any) -> tuple[Any, Verdict | None]:
    """Run the learner's function; an exception becomes a verdict instead of a traceback."""
    try:
        return fn(*args), None
    except NotImplementedError:
        return None, Verdict(False, "not written yet: replace `raise NotImplementedError` with your code")
    except Exception as err:  # the learner's code may raise anything; say what and keep the notebook running
        return None, Verdict(False, f"your function raised {type(err).__name__}: {err}")


def _same(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol)


def _compare(what: str, out: Any, expected: torch.Tensor, mistakes: Sequence[Mistake] = (), *,
             atol: float = 1e-5, rtol: float = 1e-4) -> Verdict:
    """Compare the learner's tensor with the expected one; name the mistake it matches, else say how it differs.
    All of them are compared on the CPU, wherever each was computed: in float64, which not every device has."""
    if out is None:
        return Verdict(False, f"{what}: your function returned None; did you forget `return`?")
    if not isinstance(out, torch.Tensor):
        try:
            out = torch.as_tensor(out)
        except (TypeError, ValueError, RuntimeError):
            return Verdict(False, f"{what}: expected a tensor of shape {list(expected.shape)}, got a "
                                  f"{type(out).__name__}")
    out, expected = out.detach().cpu(), expected.detach().cpu()
    for message, candidate in mistakes:
        candidate = torch.as_tensor(candidate).detach().cpu()
        if not _same(out, expected, atol, rtol) and _same(out, candidate, atol, rtol):
            return Verdict(False, f"{what}: {message}")
    if out.shape != expected.shape:
        return Verdict(False, f"{what}: wrong shape: got {list(out.shape)}, expected {list(expected.shape)}")
    if _same(out, expected, atol, rtol):
        gap = (out.double() - expected.double()).abs().max().item()
        return Verdict(True, f"{what}: matches k2lab (max |difference| {gap:.1e})")
    if not torch.isfinite(out).all():
        return Verdict(False, f"{what}: your output has NaN or infinite values")
    big = expected.double().abs() > 1e-3 * expected.double().abs().max()
    if big.any():
        ratio = out.double()[big] / expected.double()[big]
        if ratio.std() < 1e-4 * ratio.abs().mean():
            return Verdict(False, f"{what}: wrong scale: yours is {ratio.mean().item():.4g} times the right answer")
    gap = (out.double() - expected.double()).abs().max().item()
    return Verdict(False, f"{what}: differs from k2lab by up to {gap:.3g} (and matches no common mistake we know)")


# --- 00: greedy decoding ------------------------------------------------------------------------------------------


def check_greedy(fn: Callable, model: torch.nn.Module, ids: torch.Tensor, new_tokens: int = 6) -> Verdict:
    """``fn(model, ids [1, T], n) -> [1, T + n]``: n greedy steps (argmax of the last position's logits, appended).
    ``fn`` gets the ids on the model's device, where the model's logits are, so that it can append to them."""
    from ..model.generate import generate

    ids = torch.as_tensor(ids, device=model.device)
    expected = generate(model, ids, max_new_tokens=new_tokens)
    out, error = _call(fn, model, ids.clone(), new_tokens)
    if error is not None:
        return error
    n_out = expected.shape[1] - ids.shape[1]
    first = expected[:, ids.shape[1]: ids.shape[1] + 1]
    mistakes = [("you returned only the new tokens; return the prompt followed by them", expected[:, ids.shape[1]:]),
                ("every new token is the same: feed each chosen token back in before the next step",
                 torch.cat([ids, first.expand(1, n_out)], dim=1))]
    return _compare("greedy decoding", out, expected, mistakes, atol=0, rtol=0)


# --- 01: byte-pair encoding ---------------------------------------------------------------------------------------

# A toy rank file where "merge the lowest-ranked pair" and "merge the first mergeable pair" disagree.
_TOY_RANKS = {bytes([b]): b for b in range(256)} | {b"bc": 256, b"ab": 257, b"cd": 258, b"aa": 259, b"aaaa": 260,
                                                    b"bcd": 261}
_TOY_PIECES = [b"abcd", b"aaaa", b"abab", b"xbcd"]


def _first_pair_bpe(ranks: dict[bytes, int], piece: bytes) -> list[bytes]:
    parts = [piece[i: i + 1] for i in range(len(piece))]
    merged = True
    while merged:
        merged = False
        for i in range(len(parts) - 1):
            if parts[i] + parts[i + 1] in ranks:
                parts[i: i + 2] = [parts[i] + parts[i + 1]]
                merged = True
                break
    return parts


def _one_merge_bpe(ranks: dict[bytes, int], piece: bytes) -> list[bytes]:
    parts = [piece[i: i + 1] for i in range(len(piece))]
    pairs = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]
    if pairs:
        _, i = min(pairs)
        parts[i: i + 2] = [parts[i] + parts[i + 1]]
    return parts


def check_bpe(fn: Callable) -> Verdict:
    """``fn(ranks: dict[bytes, int], piece: bytes) -> list[bytes]``: rank-BPE, as tiktoken and K2 encode."""
    for piece in _TOY_PIECES:
        expected = rank_bpe(_TOY_RANKS, piece)
        out, error = _call(fn, dict(_TOY_RANKS), piece)
        if error is not None:
            return error
        if out == expected:
            continue
        if out is None:
            return Verdict(False, "your function returned None; did you forget `return`?")
        if isinstance(out, (list, tuple)) and out and all(isinstance(p, int) for p in out):
            return Verdict(False, f"{piece!r}: return the parts as bytes, not their ranks (got {out})")
        if isinstance(out, (list, tuple)) and out and all(isinstance(p, str) for p in out):
            return Verdict(False, f"{piece!r}: return bytes (b'ab'), not str ('ab')")
        if list(out) == _first_pair_bpe(_TOY_RANKS, piece):
            return Verdict(False, f"{piece!r}: you merged the first mergeable pair from the left; merge the pair "
                                  f"with the LOWEST rank first (expected {expected}, got {out})")
        if list(out) == _one_merge_bpe(_TOY_RANKS, piece):
            return Verdict(False, f"{piece!r}: you stopped after one merge; keep merging while any adjacent pair "
                                  f"is in the ranks (expected {expected})")
        if isinstance(out, (list, tuple)) and b"".join(out) != piece:
            return Verdict(False, f"{piece!r}: your parts do not join back to the piece: {out}")
        return Verdict(False, f"{piece!r}: expected {expected}, got {out}")
    return Verdict(True, f"rank-BPE: matches k2lab.tokenizer.rank_bpe on {len(_TOY_PIECES)} pieces")


# --- 02: the rotation ---------------------------------------------------------------------------------------------


def _rotate_halves(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+R/2}) by angles [T, R/2]."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], dim=-1)


def _rotate_neighbours(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_2i, x_2i+1) by angles [T, R/2], keeping the interleaved layout."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], -1).flatten(-2)


def check_rotation(fn: Callable) -> Verdict:
    """``fn(x [T, R], positions [T], inv_freq [R/2]) -> [T, R]``: rotate each pair (x_i, x_{i+R/2}) by the angle
    position * inv_freq[i] (the rotate-half layout, which k2lab uses after de-interleaving the checkpoint's pairs).
    Checked against ``k2lab.model.attention.apply_rotary`` with K2-nano's frequencies."""
    inv_freq = inverse_frequencies(K2Config.nano())  # [R/2]
    positions = torch.tensor([0, 1, 2, 7, 100, 3000])
    x = torch.randn(len(positions), 16, generator=_generator(2))
    angles = positions[:, None].float() * inv_freq  # [T, R/2]
    both = torch.cat((angles, angles), dim=-1)  # [T, R]: each pair's angle on x_i and on x_{i+R/2}
    expected = apply_rotary(x, both.cos(), both.sin(), interleaved=False)
    out, error = _call(fn, x.clone(), positions.clone(), inv_freq.clone())
    if error is not None:
        return error
    mistakes = [
        ("you rotated the wrong way: the sine's sign is flipped (x_i' = x_i cos - x_{i+R/2} sin)",
         _rotate_halves(x, -angles)),
        ("you paired neighbours (x_0, x_1), (x_2, x_3), ...; here the pairs are (x_i, x_{i+R/2})",
         _rotate_neighbours(x, angles)),
        ("every row turned by the same angles: multiply each pair's frequency by the row's position",
         _rotate_halves(x, inv_freq.expand_as(angles))),
        ("nothing was rotated", x),
        ("the angle is position * inv_freq, not position / inv_freq",
         _rotate_halves(x, positions[:, None].float() / inv_freq)),
    ]
    verdict = _compare("rotation", out, expected, mistakes, atol=1e-4)
    if not verdict.ok and isinstance(out, torch.Tensor) and out.shape == x.shape:
        a, b = out.double().chunk(2, -1)
        c, d = x.double().chunk(2, -1)
        if not torch.allclose(a**2 + b**2, c**2 + d**2, rtol=1e-3, atol=1e-4):
            return Verdict(False, f"{verdict.message}; also, a rotation keeps each pair's length and yours does not")
    return verdict


# --- 03: the absorbed score ---------------------------------------------------------------------------------------


def check_absorbed_score(fn: Callable) -> Verdict:
    """``fn(q_nope [T, H, N], q_pe [T, H, R], c_kv [S, C], k_pe [S, R], w_uk [H, N, C], scale) -> [H, T, S]``:
    the pre-softmax scores through the latent, without building each head's keys (no mask)."""
    g = _generator(3)
    T, S, H, N, R, C = 3, 5, 4, 8, 6, 10
    q_nope, q_pe = torch.randn(T, H, N, generator=g), torch.randn(T, H, R, generator=g)
    c_kv, k_pe = torch.randn(S, C, generator=g), torch.randn(S, R, generator=g)
    w_uk, scale = torch.randn(H, N, C, generator=g), 0.37
    k_nope = torch.einsum("sc,hnc->hsn", c_kv, w_uk)  # [H, S, N]: the naive path's expanded keys
    content = torch.einsum("thn,hsn->hts", q_nope, k_nope)
    rotary = torch.einsum("thr,sr->hts", q_pe, k_pe)
    expected = scale * (content + rotary)
    out, error = _call(fn, q_nope.clone(), q_pe.clone(), c_kv.clone(), k_pe.clone(), w_uk.clone(), scale)
    if error is not None:
        return error
    mistakes = [
        ("the scores are [H, S, T]; rows must be queries t and columns keys s: [H, T, S]", expected.transpose(1, 2)),
        ("you left out the rotary part q_pe · k_pe", scale * content),
        ("you left out the content part (W_UK^T q_nope) · c_KV", scale * rotary),
        ("you forgot the softmax scale", content + rotary),
        ("the scale applies to the sum: you scaled only the content part", scale * content + rotary),
        ("the scale applies to the sum: you scaled only the rotary part", content + scale * rotary),
    ]
    return _compare("absorbed score", out, expected, mistakes, atol=1e-4)


# --- 04: the router's five stages ---------------------------------------------------------------------------------


def _by_expert(idx: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row's (expert, weight) pairs by expert, so that the order of the slots does not matter."""
    order = idx.argsort(-1)
    return idx.gather(-1, order), weights.gather(-1, order)


def check_router(fn: Callable) -> Verdict:
    """``fn(x [N, D], weight [E, D], bias [E], top_k, scaling) -> (idx [N, k], weights [N, k])``: K2's router
    (sigmoid, bias only in the choice, renormalised, scaled), checked against ``k2lab.model.moe.Router``."""
    cfg = K2Config.nano()
    g = _generator(4)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(cfg.n_routed_experts, cfg.hidden_size, generator=g) * 0.15)
        router.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.3)
    x = torch.randn(16, cfg.hidden_size, generator=g)
    with torch.no_grad():
        idx, weights = router(x[None])
    idx, weights = _by_expert(idx[0], weights[0])
    bias, k, scaling = router.e_score_correction_bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor
    out, error = _call(fn, x.clone(), router.weight.detach().clone(), bias.clone(), k, scaling)
    if error is not None:
        return error
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        return Verdict(False, "return two tensors: (idx [N, k], weights [N, k])")
    out_idx, out_w = (torch.as_tensor(t).detach().cpu() if t is not None else None for t in out)  # beside idx
    if out_idx is None or out_w is None:
        return Verdict(False, "one of your two outputs is None")
    if out_idx.shape != idx.shape or out_w.shape != weights.shape:
        return Verdict(False, f"wrong shapes: got idx {list(out_idx.shape)} and weights {list(out_w.shape)}, "
                              f"expected [N, k] = {list(idx.shape)} for both")
    out_idx, out_w = _by_expert(out_idx.long(), out_w.float())
    logits = x @ router.weight.detach().T  # [N, E]
    s = logits.sigmoid()
    top = lambda scores: scores.topk(k, dim=-1).indices.sort(-1).values  # noqa: E731
    if not torch.equal(out_idx, idx):
        choices = [("you chose by s alone: the choice is top-k of s + bias (the bias decides WHO is chosen)", top(s)),
                   ("you chose by softmax(logits) + bias; K2's affinities are sigmoid(logits)",
                    top(logits.softmax(-1) + bias)),
                   ("you added the bias to the logits; it is added to the sigmoid scores s", top(logits + bias)),
                   ("you took the k LOWEST choice scores", (s + bias).topk(k, largest=False).indices.sort(-1).values)]
        for message, candidate in choices:
            if torch.equal(out_idx, candidate):
                return Verdict(False, f"chosen experts: {message}")
        rows = int((out_idx != idx).any(-1).sum())
        return Verdict(False, f"chosen experts differ from k2lab's in {rows} of {len(idx)} tokens")
    picked = lambda scores: scores.gather(-1, idx)  # noqa: E731
    renorm = lambda w: w / w.sum(-1, keepdim=True)  # noqa: E731
    mistakes = [
        ("the bias is in your weights: gather them from s, not from s + bias", renorm(picked(s + bias)) * scaling),
        ("you forgot to renormalise over the chosen experts (divide by their sum)", picked(s) * scaling),
        ("you forgot the routed_scaling_factor (the weights should sum to it)", renorm(picked(s))),
        ("your weights come from softmax(logits); K2's from sigmoid(logits)",
         renorm(picked(logits.softmax(-1))) * scaling),
        ("your weights are the raw logits", picked(logits)),
    ]
    verdict = _compare("weights", out_w, weights, mistakes)
    return Verdict(True, "router: same experts and weights as k2lab's Router") if verdict.ok else verdict


# --- 04b: the block -----------------------------------------------------------------------------------------------


def check_rms_norm(fn: Callable) -> Verdict:
    """``fn(x [..., D], weight [D], eps) -> [..., D]``: RMSNorm, checked against ``k2lab.model.layers.RMSNorm``."""
    g = _generator(5)
    D, eps = 16, 0.05  # a large eps and one tiny row, so that forgetting eps shows
    x = torch.randn(2, 5, D, generator=g) * 3 + 1.5  # not centred, so that subtracting the mean shows
    x[0, 0] *= 0.01
    norm = RMSNorm(D, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
        expected = norm(x)
    w = norm.weight.detach()
    out, error = _call(fn, x.clone(), w.clone(), eps)
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
    return _compare("RMSNorm", out, expected, mistakes)


def check_swiglu(fn: Callable) -> Verdict:
    """``fn(x [N, D], gate [I, D], up [I, D], down [D, I]) -> [N, D]``: SwiGLU, against
    ``k2lab.model.layers.SwiGLU``."""
    g = _generator(6)
    D, hidden = 12, 20
    mlp = SwiGLU(D, hidden)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    x = torch.randn(7, D, generator=g)
    with torch.no_grad():
        expected = mlp(x)
    gate, up, down = (p.detach() for p in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))
    out, error = _call(fn, x.clone(), gate.clone(), up.clone(), down.clone())
    if error is not None:
        return error
    a, b = x @ gate.T, x @ up.T  # [N, I]
    mistakes = [
        ("you applied SiLU to the up projection; it goes on the gate: down(silu(gate x) * up x)",
         (a * F.silu(b)) @ down.T),
        ("ReLU instead of SiLU (silu(z) = z * sigmoid(z))", (F.relu(a) * b) @ down.T),
        ("sigmoid instead of SiLU (silu(z) = z * sigmoid(z))", (a.sigmoid() * b) @ down.T),
        ("GELU instead of SiLU (silu(z) = z * sigmoid(z))", (F.gelu(a) * b) @ down.T),
        ("you left out the up projection: the gate multiplies up(x)", F.silu(a) @ down.T),
    ]
    return _compare("SwiGLU", out, expected, mistakes)


def check_moe_combine(fn: Callable) -> Verdict:
    """``fn(shared [N, D], expert_out [N, k, D], weights [N, k]) -> [N, D]``: the MoE's output, shared expert plus
    the weighted sum of the chosen experts' outputs (``k2lab.model.moe.MoE.forward``)."""
    g = _generator(7)
    N, k, D = 5, 4, 6
    shared, expert_out = torch.randn(N, D, generator=g), torch.randn(N, k, D, generator=g)
    weights = torch.rand(N, k, generator=g) * 1.2
    routed = (expert_out * weights[..., None]).sum(1)  # [N, D]
    expected = shared + routed
    out, error = _call(fn, shared.clone(), expert_out.clone(), weights.clone())
    if error is not None:
        return error
    mistakes = [
        ("you forgot the shared expert: it is added to every token", routed),
        ("you forgot the weights: each expert's output is multiplied by its weight", shared + expert_out.sum(1)),
        ("you averaged the slots; the MoE sums them", shared + routed / k),
        ("you renormalised the weights to sum to 1; they already carry routed_scaling_factor",
         shared + (expert_out * (weights / weights.sum(-1, keepdim=True))[..., None]).sum(1)),
    ]
    return _compare("MoE combine", out, expected, mistakes)


def check_block(fn: Callable) -> Verdict:
    """``fn(x [N, D], input_norm, attn, post_norm, ffn) -> [N, D]``: one pre-norm block, x + attn(norm(x)), then
    + ffn(norm(.)), as ``k2lab.model.transformer.DecoderLayer`` runs it (here ``attn`` and ``ffn`` are plain
    functions [N, D] -> [N, D], so the check needs no positions)."""
    g = _generator(8)
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
        out, error = _call(fn, x.clone(), n1, attn, n2, ffn)
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
        ]
        return _compare("pre-norm block", out, expected, mistakes)


# --- 05: MaxVio ---------------------------------------------------------------------------------------------------


def check_max_violation(fn: Callable) -> Verdict:
    """``fn(counts [L, E]) -> [L]``: MaxVio = max_e c_e / mean_e c_e - 1, against ``k2lab.routing.max_violation``."""
    counts = torch.tensor([[10, 30, 20, 20, 0, 40], [25, 25, 25, 25, 25, 25], [0, 0, 90, 30, 0, 30]])
    expected = max_violation(counts).double()
    out, error = _call(fn, counts.clone())
    if error is not None:
        return error
    c = counts.double()
    mean, top = c.mean(-1), c.amax(-1)
    mistakes = [
        ("you forgot the - 1: MaxVio is 0 when balanced", top / mean),
        ("you gave a percentage; MaxVio is a fraction (0.5, not 50)", 100 * (top / mean - 1)),
        ("you divided by the total; MaxVio divides by the mean load", top / c.sum(-1) - 1),
        ("(max - min) / mean is a spread, not MaxVio: compare the busiest expert with the mean",
         (top - c.amin(-1)) / mean),
        ("that is the coefficient of variation (std / mean), not MaxVio", c.std(-1) / mean),
        ("you reduced over the wrong dimension: one value per layer, over its experts",
         c.amax(0) / c.mean(0) - 1),
    ]
    return _compare("MaxVio", out, expected, mistakes)


# --- 06: direct logit attribution ---------------------------------------------------------------------------------


def check_logit_attribution(fn: Callable) -> Verdict:
    """``fn(component [D], x_final [D], norm_weight [D], unembed_row [D], eps) -> float``: one term's direct
    contribution to a logit, u · (g ⊙ c) / rms(x_L), with the final norm's scale frozen at x_L."""
    g = _generator(9)
    D, eps = 16, 1e-6
    parts = torch.randn(3, D, generator=g) * torch.tensor([[1.0], [2.0], [0.5]])
    x_final = parts.sum(0)
    norm = RMSNorm(D, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    u, w = torch.randn(D, generator=g), norm.weight.detach()
    rms = (x_final.pow(2).mean() + eps).sqrt()
    logit = (u * norm(x_final).detach()).sum()
    for c in parts:
        expected = (u * w * c).sum() / rms
        out, error = _call(fn, c.clone(), x_final.clone(), w.clone(), u.clone(), eps)
        if error is not None:
            return error
        mistakes = [
            ("you forgot to divide by rms(x_L): the final norm scales every term by the same 1 / rms(x_L)",
             (u * w * c).sum()),
            ("you divided by the term's own rms; the norm's scale is frozen at the whole stream's, rms(x_L)",
             (u * w * c).sum() / (c.pow(2).mean() + eps).sqrt()),
            ("you forgot the norm's weight g", (u * c).sum() / rms),
        ]
        verdict = _compare("attribution", torch.as_tensor(out) if out is not None else None, expected, mistakes)
        if not verdict.ok:
            return verdict
    total = sum(float(fn(c, x_final, w, u, eps)) for c in parts)
    return Verdict(True, f"direct logit attribution: right, and the terms sum to the logit ({total:.4f} = "
                         f"{logit.item():.4f})")


# --- 07: a patching hook ------------------------------------------------------------------------------------------


def check_patch_hook(fn: Callable) -> Verdict:
    """``fn(activation [B, T, D], source [B, T, D], positions: list[int]) -> [B, T, D]``: the activation with the
    source's values at the given positions, as ``k2lab.interventions.patch`` writes them; the input unchanged."""
    g = _generator(10)
    act, source, positions = torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 3, generator=g), [1, 3]
    expected = act.clone()
    expected[:, positions] = source[:, positions]
    given = act.clone()
    out, error = _call(fn, given, source.clone(), list(positions))
    if error is not None:
        return error
    if not torch.equal(given, act):
        return Verdict(False, "you changed the activation in place: another probe or cache may hold that very tensor; "
                              "clone it, then write into the copy")
    others = source.clone()
    others[:, positions] = act[:, positions]
    batch = act.clone()
    batch[positions[0]] = source[positions[0]]
    mistakes = [("you patched every position; only the given ones change", source),
                ("you patched every position but the given ones", others),
                ("you indexed the batch axis; positions are axis 1 of [B, T, D]", batch)]
    return _compare("patch hook", out, expected, mistakes, atol=0, rtol=0)


# --- 08: KV-cache bytes -------------------------------------------------------------------------------------------


def check_kv_cache_bytes(fn: Callable) -> Verdict:
    """``fn(cfg: K2Config, tokens: int) -> int``: bytes of the latent KV cache in bfloat16 over all layers,
    against ``k2lab.kv_cache_bytes``."""
    for cfg, name in ((K2Config.kimi_k2(), "Kimi K2"), (K2Config.nano(), "K2-nano")):
        for tokens in (1, 1000):
            expected = kv_cache_bytes(cfg, tokens)
            out, error = _call(fn, cfg, tokens)
            if error is not None:
                return error
            if out == expected:
                continue
            L, C, R = cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim
            mistakes = {
                tokens * (C + R) * 2: "you counted one layer; every layer has its own cache",
                tokens * (C + R) * 4 * L: "4 bytes per value: the cache is bfloat16, 2 bytes",
                tokens * C * 2 * L: "you forgot the shared rotary key k_pe (qk_rope_head_dim values)",
                tokens * R * 2 * L: "you forgot the latent c_KV (kv_lora_rank values)",
                kv_cache_bytes(cfg, tokens, layout="expanded"): "that is the expanded cache (every head's keys and "
                                                                "values); MLA caches the latent",
            }
            message = mistakes.get(out, f"expected {expected:,}, got {out!r}")
            return Verdict(False, f"{name}, {tokens} tokens: {message}")
    return Verdict(True, f"KV-cache bytes: right for K2 ({kv_cache_bytes(K2Config.kimi_k2(), 1):,} per token) and nano")


# --- 09: the logit lens -------------------------------------------------------------------------------------------


def check_logit_lens(fn: Callable) -> Verdict:
    """``fn(resid [T, D], norm, head) -> [T, V]``: the logits the model would give if it stopped at this residual
    (the final norm, then the head, in float32), as ``ActivationCache.logit_lens`` reads them."""
    g = _generator(11)
    D, V = 12, 30
    norm, head = RMSNorm(D), torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
        head.weight.copy_(torch.randn(V, D, generator=g))
        resid = torch.randn(4, D, generator=g) * 5
        expected = head(norm(resid)).float()
        out, error = _call(fn, resid.clone(), norm, head)
        if error is not None:
            return error
        mistakes = [("you forgot the final norm: the head reads RMSNorm(x), as after the last layer", head(resid)),
                    ("you returned probabilities (softmax); return the logits", expected.softmax(-1)),
                    ("you returned log-probabilities; return the logits", expected.log_softmax(-1))]
        return _compare("logit lens", out, expected, mistakes, atol=1e-4)


# --- 10: the bias update ------------------------------------------------------------------------------------------


def check_bias_update(fn: Callable) -> Verdict:
    """``fn(bias [L, E], counts [L, E], u) -> [L, E]``: DeepSeek-V3's balancing step b + u * sign(mean c - c_e),
    against ``k2lab.training.optim.balance_router_bias``."""
    g = _generator(12)
    bias = torch.randn(2, 6, generator=g) * 0.01
    counts = torch.tensor([[10.0, 30, 20, 20, 0, 40], [5, 5, 5, 5, 5, 5]])
    u = 0.005
    expected = bias + u * torch.sign(counts.mean(-1, keepdim=True) - counts)
    out, error = _call(fn, bias.clone(), counts.clone(), u)
    if error is not None:
        return error
    diff = counts.mean(-1, keepdim=True) - counts
    mistakes = [
        ("wrong sign: an overloaded expert's bias must go DOWN, so fewer tokens choose it", bias - u * diff.sign()),
        ("the step is u times the SIGN of the imbalance, not the imbalance itself", bias + u * diff),
        ("you forgot u: each step moves the bias by u, not by 1", bias + diff.sign()),
        ("you returned the step; return the new bias (old bias + step)", u * diff.sign()),
    ]
    return _compare("bias update", out, expected, mistakes)
