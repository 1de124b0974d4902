"""10: training K2. The router's balancing step (``check_bias_update``), Muon's Newton-Schulz iteration
(``check_newton_schulz``) and QK-Clip for one MLA head (``check_qk_clip``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...config import K2Config
from ...model.transformer import K2Model
from ...training.optim import NEWTON_SCHULZ_COEFFS, balance_router_bias, newton_schulz, qk_clip
from .checking import Verdict, Watch, as_tensor, call, checker, compare, generator, named

# --- the bias update ----------------------------------------------------------------------------------------------


@checker
def check_bias_update(fn: Callable) -> Verdict:
    """``fn(bias [L, E], counts [L, E], u) -> [L, E]``: DeepSeek-V3's balancing step b + u * sign(mean c - c_e), per
    layer over its experts: the rule of ``k2lab.training.optim.balance_router_bias``, returned as a new tensor (the
    bias given stays as it was: 10 keeps every step's bias for its figure). The counts are chosen so that the usual
    slips show: experts exactly at the mean (sign 0: they stay), rows whose mean and median differ, and a row whose
    mean is fractional (2.5, where rounding it down or a smooth step gives another answer)."""
    g = generator(12)
    counts = torch.tensor([[10.0, 30, 20, 20, 0, 40],  # mean 20: two experts exactly at the mean
                           [5, 19, 19, 40, 40, 17],  # mean 23.3, median 19
                           [0, 0, 30, 31, 32, 33],  # mean 21, median 30 (lower) or 30.5
                           [2, 3, 3, 2, 3, 2]])  # mean 2.5: each expert half a token from it
    bias = torch.randn(counts.shape, generator=g) * 0.01
    u = 0.005
    mean = counts.mean(-1, keepdim=True)
    expected = bias + u * torch.sign(mean - counts)
    out, error = call(fn, bias.clone(), counts.clone(), u, own={balance_router_bias: "balance_router_bias"},
                      in_place={0: "10 keeps every step's bias for its bias-history figure, and the router still holds "
                                   "the old one; return a new tensor, bias + step (not bias += step)"})
    if error is not None:
        return error
    diff = mean - counts
    median = "you compared with the median load; the rule compares each expert with the MEAN load"
    at_mean = "an expert exactly at the mean load keeps its bias: the step is u * sign(0) = 0"
    smooth = ("the step is u * sign(mean - c), the same size for every expert off the mean; a smooth function of "
              "the imbalance moves experts near the mean by less (here each is half a token from it)")
    floored = torch.div(counts.sum(-1, keepdim=True), counts.shape[-1], rounding_mode="floor")
    mistakes = [
        ("wrong sign: an overloaded expert's bias must go DOWN, so fewer tokens choose it", bias - u * diff.sign()),
        ("the step is u times the SIGN of the imbalance, not the imbalance itself", bias + u * diff),
        ("you forgot u: each step moves the bias by u, not by 1", bias + diff.sign()),
        ("you returned the step; return the new bias (old bias + step)", u * diff.sign()),
        (median, bias + u * torch.sign(counts.median(-1, keepdim=True).values - counts)),  # torch: the lower median
        (median, bias + u * torch.sign(counts.quantile(0.5, dim=-1, keepdim=True) - counts)),  # numpy's: the middle
        (at_mean, bias + torch.where(counts > mean, -u, u)),
        (at_mean, bias + torch.where(counts < mean, u, -u)),
        ("you averaged over the layers; the mean is over each layer's experts",
         bias + u * torch.sign(counts.mean(0, keepdim=True) - counts)),
        ("your mean is rounded down (integer division, //): a mean load of 2.5 became 2, so the experts with 2 "
         "tokens kept their bias; divide with /", bias + u * torch.sign(floored - counts)),
        ("your mean is rounded to an integer: a mean load of 2.5 is not 2 or 3; keep it fractional",
         bias + u * torch.sign(mean.round() - counts)),
        (smooth, bias + u * torch.tanh(diff)),
        (smooth, bias + u * diff.clamp(-1, 1)),
        ("you divided by the mean load: the step is u * sign(mean - c), in units of u", bias + u * diff / mean),
    ]
    verdict = compare("bias update", out, expected, mistakes, atol=1e-3 * u, rtol=0)
    answer = as_tensor(out)
    if verdict.ok or verdict.mistake is not None or answer is None or answer.shape != expected.shape:
        return verdict
    steps = (answer.double() - bias.double()) / u  # in units of u: -1, 0 or +1 each
    if not torch.isclose(steps, steps.round(), atol=1e-3).all() or steps.abs().max() > 1 + 1e-3:
        sizes = sorted({round(v, 3) for v in steps.flatten().tolist()})
        shown = ", ".join(f"{v:g}" for v in sizes[:6]) + (", ..." if len(sizes) > 6 else "")
        return named(f"each step moves a bias by exactly u, up or down (or not at all at the mean); yours moves them "
                     f"by {shown} times u", "bias update")
    wrong = (steps.round() != torch.sign(mean - counts).double()).nonzero()
    layer, expert = wrong[0].tolist()
    c, m = counts[layer, expert].item(), mean[layer, 0].item()
    should = {1: "up by u (it is under the mean)", -1: "down by u (it is over the mean)",
              0: "nowhere (it is at the mean)"}
    return named(f"{len(wrong)} of your steps point the wrong way; e.g. layer {layer}, expert {expert}: {c:g} tokens "
                 f"against a mean of {m:.4g}, so its bias moves {should[int(torch.sign(torch.tensor(m - c)))]}, and "
                 f"yours moves {should[int(steps[layer, expert].round())].split(' (')[0]}", "bias update")


# --- Newton-Schulz ------------------------------------------------------------------------------------------------


def _newton_schulz_variant(g: torch.Tensor, steps: int, coeffs: tuple[float, float, float] = NEWTON_SCHULZ_COEFFS,
                           norm: str | None = "fro", cubic: bool = False) -> torch.Tensor:
    """Muon's iteration with a switch for each usual mistake (the defaults are the right one; ``norm`` "fro",
    2 for the spectral norm, None for none), in float64 so that each mistake's answer is exact."""
    x = g.double()
    if norm is not None:
        x = x / (torch.linalg.matrix_norm(x, ord=norm) + 1e-7)
    a, b, c = coeffs
    for _ in range(steps):
        gram = x @ x.mT
        x = 1.5 * x - 0.5 * gram @ x if cubic else a * x + (b * gram + c * gram @ gram) @ x
    return x


def _with_singular_values(rows: int, cols: int, values: torch.Tensor, seed: int) -> torch.Tensor:
    """A random [rows, cols] matrix with the given singular values."""
    g = generator(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(values), generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, len(values), generator=g))
    return u @ torch.diag(values) @ v.T


@checker
def check_newton_schulz(fn: Callable) -> Verdict:
    """``fn(G [A, B], steps: int) -> [A, B]``: Muon's quintic Newton-Schulz iteration, equal to
    ``k2lab.training.optim.newton_schulz`` in float32. Divide G by its Frobenius norm (so that every singular value
    is at most 1), transpose a tall G (A > B) so that the Gram matrix X X^T is the small B x B one, then ``steps``
    times X <- a X + (b A + c A^2) X with A = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315), and transpose back.

    A tall matrix (5 steps) and a wide one (3 steps) are checked, whose singular values spread from 0.02 to 0.9, and
    the check watches the shapes your code makes: a Gram matrix of the large side means the tall matrix was not
    transposed."""
    cases = [(_with_singular_values(24, 6, torch.linspace(0.02, 0.9, 6), seed=21), 5),
             (_with_singular_values(5, 20, torch.linspace(0.05, 0.8, 5), seed=22), 3)]  # another count of steps
    low_precision: list[str] = []  # how close each low-precision answer came
    low_names: set[str] = set()  # the dtypes it was computed in
    for g, steps in cases:
        shape = "tall" if g.shape[0] > g.shape[1] else "wide"
        what = f"Newton-Schulz ({shape} {g.shape[0]}x{g.shape[1]})"
        watch = Watch().forbid("G / |G|", g / g.norm(), any_scale=False)  # seen, not forbidden: was G normalised?
        with watch, torch.no_grad():
            out, error = call(fn, g.clone(), steps, own={newton_schulz: "newton_schulz"})
        if error is not None:
            return error
        big = max(g.shape)
        if (big, big) in watch.shapes:
            return named(f"you did not transpose: your code made a {big}x{big} Gram matrix; iterate on the side with "
                         f"fewer rows (X^T when A > B), so that X X^T is {min(g.shape)}x{min(g.shape)}, and transpose "
                         f"back at the end", what)
        expected = newton_schulz(g, steps, dtype=torch.float32)
        mistakes = [
            ("you ran the cubic iteration X <- 1.5 X - 0.5 X X^T X; Muon's is quintic: a X + (b A + c A^2) X",
             _newton_schulz_variant(g, steps, cubic=True)),
            ("you did not normalise G first: divide it by its Frobenius norm so that every singular value is at most "
             "1, where the iteration converges", _newton_schulz_variant(g, steps, norm=None)),
            ("you divided by the spectral norm; Muon divides by the Frobenius norm (cheap, and never smaller)",
             _newton_schulz_variant(g, steps, norm=2)),
            ("the coefficients are in the wrong order: a X + (b A + c A^2) X with (a, b, c) = (3.4445, -4.7750, "
             "2.0315)", _newton_schulz_variant(g, steps, coeffs=NEWTON_SCHULZ_COEFFS[::-1])),
            ("that is the exact U V^T of an SVD; Newton-Schulz only lands the singular values in a band around 1",
             (lambda u, _, vh: u @ vh)(*torch.linalg.svd(g.double(), full_matrices=False))),
            ("you transposed the tall matrix but not the result back", expected.mT),
            ("you ignored `steps`: run the iteration as many times as it says (5 is only Muon's default)",
             _newton_schulz_variant(g, 5 if steps != 5 else 3)),
        ]
        if isinstance(out, torch.Tensor) and not torch.isfinite(out.detach()).all():
            how = ("you did divide G by its Frobenius norm, so the update is what diverges: a X + (b A + c A^2) X "
                   "with A = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315)" if "G / |G|" in watch.found else
                   "divide G by its Frobenius norm first, so that every singular value is at most 1, where the "
                   "iteration converges")
            return named(f"your iteration blew up (NaN or infinity): {how}", what)
        low = next((d for d in (torch.bfloat16, torch.float16) if d in watch.dtypes
                    or isinstance(out, torch.Tensor) and out.dtype == d), None)
        if low is None:
            verdict = compare(what, out, expected, mistakes, atol=1e-4)
        else:  # Muon runs the iteration in bfloat16: accepted within that rounding, measured on k2lab's own
            rounding = (newton_schulz(g, steps, dtype=low).float() - expected).abs().max().item()
            tolerance = 2.5 * rounding
            verdict = compare(what, out, expected, mistakes, atol=tolerance, rtol=0)
            name = str(low).removeprefix("torch.")
            if verdict.ok:
                gap = (torch.as_tensor(out).detach().float().cpu() - expected).abs().max().item()
                low_precision.append(f"{shape}: max |difference| {gap:.1e}, allowed {tolerance:.1e}")
                low_names.add(name)
            else:
                verdict = Verdict(False, f"{verdict.message} (computed in {name}; this check compares in float32, "
                                         f"allowing {name} rounding: {tolerance:.1e})", mistake=verdict.mistake)
        if not verdict.ok and verdict.mistake is None and isinstance(out, torch.Tensor) and out.shape == g.shape:
            return _singular_diagnosis(g, out, expected, what)
        if not verdict.ok:
            return verdict
    sv = torch.linalg.svdvals(newton_schulz(cases[0][0], cases[0][1], dtype=torch.float32))
    rounding = (f"computed in {' and '.join(sorted(low_names))}; this check compares in float32: it matches k2lab "
                f"within that rounding ({'; '.join(low_precision)}), on" if low_precision else "matches k2lab on")
    return Verdict(True, f"Newton-Schulz: {rounding} a tall and a wide matrix; the singular values land in "
                         f"[{sv.min():.2f}, {sv.max():.2f}], a band around 1, not at 1")


def _singular_diagnosis(g: torch.Tensor, out: torch.Tensor, expected: torch.Tensor, what: str) -> Verdict:
    """Why a Newton-Schulz answer is wrong, from its singular vectors and values against G's and the right ones."""
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    inner = u.T @ out.detach().double().cpu() @ vh.T  # diagonal when out has G's singular vectors
    diagonal = inner.diagonal()
    if (inner - torch.diag(diagonal)).abs().max() > 1e-3 * diagonal.abs().max():
        return named("your output does not have G's singular vectors: the iteration keeps them and moves only the "
                     "singular values (X <- a X + (b A + c A^2) X, every term a product with X on the right, "
                     "A = X X^T)", what)
    right = torch.linalg.svdvals(expected.double())
    yours = diagonal.abs().sort(descending=True).values
    return named(f"your output has G's singular vectors but other singular values ({yours.min():.3g} to "
                 f"{yours.max():.3g}; after these steps they are {right.min():.3g} to {right.max():.3g}): the "
                 f"coefficients, the normalisation or the number of steps differ", what)


# --- QK-Clip ------------------------------------------------------------------------------------------------------

HEAD_PARTS = ("q_nope", "q_pe", "k_nope", "v", "k_pe")


def _heads(model: K2Model) -> list[dict[str, torch.Tensor]]:
    """Each head's weight rows in the one layer of ``model``: its query rows of q_b_proj (content, rotary), its key
    and value rows of kv_b_proj, and the rotary key rows of kv_a_proj_with_mqa, which every head shares."""
    cfg, attn = model.config, model.layers[0].self_attn
    H, N, R, V, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    q = attn.q_b_proj.weight.detach().view(H, N + R, -1)
    kv = attn.kv_b_proj.weight.detach().view(H, N + V, -1)
    k_pe = attn.kv_a_proj_with_mqa.weight.detach()[C:]
    return [{"q_nope": q[h, :N].clone(), "q_pe": q[h, N:].clone(), "k_nope": kv[h, :N].clone(),
             "v": kv[h, N:].clone(), "k_pe": k_pe.clone()} for h in range(H)]


def _flat(head: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([torch.as_tensor(head[part]).detach().cpu().double().flatten() for part in HEAD_PARTS])


def _scaled(head: dict[str, torch.Tensor], **factors: float) -> dict[str, torch.Tensor]:
    return {part: t * factors.get(part, 1.0) for part, t in head.items()}


def _factors_diagnosis(head: dict[str, torch.Tensor], out: dict, gamma: float, what: str) -> Verdict:
    """Each part's factor in the learner's answer against K2's, when each part is a multiple of the original."""
    right = {"q_nope": gamma**0.5, "k_nope": gamma**0.5, "q_pe": gamma, "v": 1.0, "k_pe": 1.0}
    factors = {}
    for part in HEAD_PARTS:
        before, after = head[part].double().flatten(), torch.as_tensor(out[part]).detach().double().cpu().flatten()
        factor = (before @ after / (before @ before)).item()
        if not torch.allclose(after, factor * before, atol=1e-6, rtol=1e-5):
            return named(f"your {part} is not a multiple of the original rows: QK-Clip only scales each part",
                         what)
        factors[part] = factor
    wrong = [part for part in HEAD_PARTS if abs(factors[part] - right[part]) > 1e-6]
    shown = "; ".join(f"{part} x{factors[part]:.4g} (K2: x{right[part]:.4g})" for part in wrong)
    return named(f"your factors: {shown}, with gamma = {gamma:.4g}: q_nope and k_nope take sqrt(gamma) each, q_pe "
                 f"the whole gamma, v and the shared k_pe none", what)


@checker
def check_qk_clip(fn: Callable) -> Verdict:
    """``fn(head: dict[str, Tensor], max_logit: float, tau: float) -> dict[str, Tensor]``: QK-Clip for one MLA head,
    as ``k2lab.training.optim.qk_clip`` clips it. ``head`` holds the head's weight rows: ``q_nope`` [N, q_lora_rank]
    and ``q_pe`` [R, q_lora_rank] (q_b_proj), ``k_nope`` [N, C] and ``v`` [V, C] (kv_b_proj), and ``k_pe``
    [R, D] (kv_a_proj_with_mqa's rotary rows, shared by every head). Return the clipped rows under the same names.

    gamma = min(1, tau / max_logit); q_nope and k_nope are each scaled by sqrt(gamma), q_pe by gamma, and v and the
    shared k_pe stay as they are, so that both parts of the head's logits shrink by gamma. Checked on four heads: far
    above tau, below it, a little above, exactly at it."""
    cfg = K2Config.nano().replace(num_hidden_layers=1, vocab_size=32, bos_token_id=None, eos_token_id=None)
    model = K2Model(cfg)
    model.init_weights(std=0.5, seed=23)
    tau = 100.0
    max_logits = torch.tensor([[250.0, 60.0, 120.0, 100.0]])  # [L, H]
    before = _heads(model)
    gamma = qk_clip(model, max_logits, tau)[0]  # [H], k2lab's clip applied to the model
    after = _heads(model)
    for h, (head, expected) in enumerate(zip(before, after, strict=True)):
        max_logit = max_logits[0, h].item()
        out, error = call(fn, {part: t.clone() for part, t in head.items()}, max_logit, tau, keep=False,
                          own={qk_clip: "qk_clip"})
        if error is not None:
            return error
        what = f"QK-Clip, head with max logit {max_logit:g} (tau {tau:g})"
        if not isinstance(out, dict) or set(out) != set(HEAD_PARTS):
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            return named(f"return a dict with the keys {list(HEAD_PARTS)}, got {got}", what)
        if any(tuple(torch.as_tensor(out[part]).shape) != tuple(head[part].shape) for part in HEAD_PARTS):
            return named(f"each returned part keeps its shape ({ {part: list(t.shape) for part, t in head.items()} })",
                         what)
        g = gamma[h].item()
        raw = tau / max_logit  # gamma without the min(1, .)
        k_pe_message = ("you scaled the shared rotary key k_pe: every head reads it, so clipping one head would "
                        "change all; leave it and give q_pe the whole gamma")
        mistakes = [
            ("you clipped a head whose max logit is not above tau: gamma = min(1, tau / max_logit), so it stays",
             _scaled(head, q_nope=raw**0.5, k_nope=raw**0.5, q_pe=raw)),
            (k_pe_message, _scaled(head, q_nope=g**0.5, k_nope=g**0.5, q_pe=g**0.5, k_pe=g**0.5)),
            (k_pe_message, _scaled(head, q_nope=g**0.5, k_nope=g**0.5, q_pe=g, k_pe=g)),
            ("q_pe takes the whole gamma, not sqrt(gamma): k_pe is never scaled, so q_pe · k_pe shrinks only by "
             "q_pe's own factor", _scaled(head, q_nope=g**0.5, k_nope=g**0.5, q_pe=g**0.5)),
            (f"you scaled the shared k_pe instead of q_pe: {k_pe_message.split(': ', 1)[1]}",
             _scaled(head, q_nope=g**0.5, k_nope=g**0.5, k_pe=g)),
            ("you put gamma on both q_nope and k_nope, so their product shrinks by gamma^2: each takes sqrt(gamma)",
             _scaled(head, q_nope=g, k_nope=g, q_pe=g)),
            ("you put the whole gamma on q_nope; K2 splits it evenly, sqrt(gamma) on q_nope and on k_nope",
             _scaled(head, q_nope=g, q_pe=g)),
            ("you put the whole gamma on k_nope; K2 splits it evenly, sqrt(gamma) on q_nope and on k_nope",
             _scaled(head, k_nope=g, q_pe=g)),
            ("you forgot the rotary part: q_pe is scaled by gamma too, or q_pe · k_pe keeps growing",
             _scaled(head, q_nope=g**0.5, k_nope=g**0.5)),
            ("the values are not clipped: v does not enter the logits", _scaled(head, q_nope=g**0.5, k_nope=g**0.5,
                                                                                q_pe=g, v=g**0.5)),
            ("gamma is tau / max_logit (below 1 for a head above tau), not max_logit / tau",
             _scaled(head, q_nope=g**-0.5, k_nope=g**-0.5, q_pe=1 / g)),
            ("nothing was clipped although this head's max logit is above tau", head),
        ]
        verdict = compare(what, _flat(out), _flat(expected), [(m, _flat(c)) for m, c in mistakes], atol=1e-6)
        if not verdict.ok and verdict.mistake is None:
            return _factors_diagnosis(head, out, g, what)
        if not verdict.ok:
            return verdict
    gammas = [round(g, 3) for g in gamma.tolist()]
    return Verdict(True, f"QK-Clip: matches k2lab on {len(before)} heads (gamma {gammas}); the shared k_pe untouched")
