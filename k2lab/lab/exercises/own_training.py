"""10: training the learner's own K2. The next-token loss with pads ignored (``check_next_token_loss``), AdamW's step
(``check_adamw_step``), Muon's step (``check_muon_step``), the whole training step against ``recipe_step``
(``check_train_step``), and a run of it set beside k2lab's (``compare_runs``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ...config import K2Config
from ...model import K2Model
from ...training.optim import MuonClip, newton_schulz
from .checking import Verdict, call, checker, compare, generator

# --- the next-token loss --------------------------------------------------------------------------------------------


def _loss_of(logits: torch.Tensor, ids: torch.Tensor, scored: torch.Tensor, shift: int = 1) -> torch.Tensor:
    """Mean cross-entropy of logits[:, t] against ids[:, t + shift] over ``scored`` [B, T - shift] positions."""
    T = ids.shape[1]
    if shift == 1:
        pred, target = logits[:, :-1], ids[:, 1:]
    elif shift == 0:
        pred, target = logits, ids
    else:  # logits[:, t + 1] against ids[:, t]: the shift the wrong way
        pred, target = logits[:, 1:], ids[:, :-1]
    per = F.cross_entropy(pred.reshape(-1, pred.shape[-1]).double(), target.reshape(-1), reduction="none")
    per = per.view(ids.shape[0], -1)
    return (per * scored[:, : per.shape[1]]).sum() / scored[:, : per.shape[1]].sum() if T else per.sum()


@checker
def check_next_token_loss(fn: Callable) -> Verdict:
    """``fn(logits [B, T, V], ids [B, T], pad_id) -> loss``: the mean cross-entropy in nats of each next token:
    position t's logits score token t + 1, over the positions whose token and next token are both real (not
    ``pad_id``), as ``K2Model(ids, attention_mask=..., return_type="loss")`` counts them. The batch has a row without
    pads, a right-padded row and a left-padded one; the loss must keep its gradient (training backpropagates it)."""
    g = generator(71)
    B, T, V, pad = 3, 8, 13, 12
    ids = torch.randint(0, V - 1, (B, T), generator=g)
    ids[1, -3:] = pad  # right-padded
    ids[2, :2] = pad  # left-padded
    logits = (torch.randn(B, T, V, generator=g) * 2).requires_grad_()
    real = ids != pad
    both = real[:, :-1] & real[:, 1:]
    with torch.no_grad():
        expected = _loss_of(logits, ids, both)
    with torch.enable_grad():
        out, error = call(fn, logits, ids.clone(), pad)
    if error is not None:
        return error
    if isinstance(out, torch.Tensor) and out.numel() == 1 and not out.requires_grad:
        message = ("your loss carries no gradient (a float, .item(), .detach() or torch.no_grad()): training "
                   "backpropagates through it, so keep it a tensor of the logits")
        return Verdict(False, f"next-token loss: {message}", mistake=message)
    every = torch.ones_like(both)
    with torch.no_grad():
        per_row = torch.stack([_loss_of(logits[b:b + 1], ids[b:b + 1], both[b:b + 1]) for b in range(B)]).mean()
        mistakes = [
            ("no shift: position t's logits score token t itself; they predict token t + 1 (logits[:, :-1] against "
             "ids[:, 1:])", _loss_of(logits, ids, real, shift=0)),
            ("the shift goes the other way: logits[:, :-1] score ids[:, 1:]", _loss_of(logits, ids, both, shift=-1)),
            ("you counted the pads: a position is scored only when its token and the next are both real",
             _loss_of(logits, ids, every)),
            ("you ignored pad targets only (ignore_index): at a left pad the input is a pad too, and its prediction "
             "of the row's first token must not count; score the positions whose token and next token are real",
             _loss_of(logits, ids, real[:, 1:])),
            ("you kept the prediction of the first pad from the row's last real token: a position counts only if "
             "its next token is real too", _loss_of(logits, ids, real[:, :-1])),
            ("you divided by every position, pads included: divide by the positions you scored",
             _loss_of(logits, ids, both) * both.sum() / both.numel()),
            ("you summed the losses; take their mean over the scored positions", _loss_of(logits, ids, both) *
             both.sum()),
            ("you averaged each row, then the rows: every scored position counts once, so rows with pads weigh "
             "less", per_row),
            ("that is in bits (log base 2); the loss is in nats (natural log), as cross_entropy gives it",
             _loss_of(logits, ids, both) / math.log(2)),
            ("you applied a softmax before cross_entropy, which applies log_softmax itself: pass the logits",
             _loss_of(logits.softmax(-1), ids, both)),
        ]
    return compare("next-token loss", out, expected, mistakes, atol=1e-5)


# --- AdamW ----------------------------------------------------------------------------------------------------------


def _adamw_variant(p: torch.Tensor, grads: Sequence[torch.Tensor], lr: float, wd: float, *,
                   betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, correct: bool = True,
                   eps_inside: bool = False, coupled: bool = False, decay: str = "decoupled", square: bool = True,
                   count: bool = True, ema: bool = True) -> list[torch.Tensor]:
    """The weights after each AdamW step, with a switch for each usual mistake (the defaults are right)."""
    m, v, out = torch.zeros_like(p), torch.zeros_like(p), []
    b1, b2 = betas
    for step, g in enumerate(grads, start=1):
        g = g + wd * p if coupled else g
        m = b1 * m + (1 - b1) * g if ema else b1 * m + g
        v = b2 * v + (1 - b2) * (g * g if square else g.abs())
        t = step if count else 1
        m_hat, v_hat = (m / (1 - b1**t), v / (1 - b2**t)) if correct else (m, v)
        update = m_hat / ((v_hat + eps).sqrt() if eps_inside else v_hat.sqrt() + eps)
        if decay == "decoupled" and not coupled:
            p = p * (1 - lr * wd) - lr * update
        elif decay == "no lr":
            p = p * (1 - wd) - lr * update
        else:
            p = p - lr * update
        out.append(p)
    return out


@checker
def check_adamw_step(fn: Callable) -> Verdict:
    """``fn(p, grad, state: dict, lr, weight_decay, betas=(0.9, 0.95), eps=1e-8) -> new p``: one AdamW step, as
    ``torch.optim.AdamW`` takes it (and k2lab's MuonClip for the embedding, the head and the norms): moments
    m ← β1 m + (1 − β1) g and v ← β2 v + (1 − β2) g², bias-corrected by 1 − β^t at step t, the update
    m̂ / (√v̂ + eps), and the decay decoupled: p ← p (1 − lr·wd) − lr·update. ``state`` is the same dict at every
    call (keep the moments and the step count in it); return the new weight. Three steps are checked, each against
    torch's AdamW, with K2's betas (0.9, 0.95) taken from your function's defaults."""
    g = generator(72)
    p0 = torch.randn(6, 5, generator=g)
    # Gradients small beside the decay (the first step's update is sign(g): a coupled decay flips some signs), and a
    # row of tiny ones, whose √v̂ is far below eps, so that eps's place shows.
    grads = [torch.randn(6, 5, generator=g) * s for s in (0.05, 0.02, 0.5)]
    for grad in grads:
        grad[0] *= 1e-5
    lr, wd = 0.01, 0.1
    ref = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=lr, weight_decay=wd, betas=(0.9, 0.95), eps=1e-8)
    expected = []
    for grad in grads:
        ref.grad = grad.clone()
        opt.step()
        expected.append(ref.detach().clone())
    variants = {name: _adamw_variant(p0, grads, lr, wd, **switch) for name, switch in {
        "no correction": {"correct": False}, "eps inside": {"eps_inside": True}, "coupled": {"coupled": True},
        "no decay": {"decay": "none"}, "no lr": {"decay": "no lr"}, "abs": {"square": False},
        "no count": {"count": False}, "sum": {"ema": False}, "torch betas": {"betas": (0.9, 0.999)}}.items()}
    state: dict = {}
    p = p0.clone()
    for step, grad in enumerate(grads):
        given = p.clone()
        out, error = call(fn, given, grad.clone(), state, lr, wd, keep=(0, 1))  # the state is theirs to update
        if error is not None:
            return error
        mistakes = [
            ("you forgot the bias correction: divide m by 1 - β1^t and v by 1 - β2^t (t = the step, from 1)",
             variants["no correction"][step]),
            ("eps goes outside the square root: m̂ / (√v̂ + eps)", variants["eps inside"][step]),
            ("you added the decay to the gradient (Adam with L2, coupled); AdamW decouples it: p (1 - lr·wd) after "
             "the moments", variants["coupled"][step]),
            ("you forgot the weight decay: p ← p (1 − lr·wd) − lr·update", variants["no decay"][step]),
            ("the decay is scaled by the learning rate: p (1 − lr·wd), not p (1 − wd)", variants["no lr"][step]),
            ("v averages the SQUARED gradient, g², not |g|", variants["abs"][step]),
            ("your step count does not advance: t must grow by one at every call (keep it in `state`)",
             variants["no count"][step]),
            ("m is an average: β1 m + (1 − β1) g, not β1 m + g", variants["sum"][step]),
            ("K2 (and K2-nano's run) use betas (0.9, 0.95); your defaults are torch's (0.9, 0.999)",
             variants["torch betas"][step]),
            ("you returned the update; return the new weight, p (1 − lr·wd) − lr·update",
             (expected[step] - (expected[step - 1] if step else p0) * (1 - lr * wd)) / -lr),
        ]
        verdict = compare(f"AdamW, step {step + 1}", out, expected[step], mistakes, atol=1e-6)
        if not verdict.ok:
            return verdict
        p = torch.as_tensor(out).detach()
    return Verdict(True, "AdamW: three steps equal to torch.optim.AdamW's (betas 0.9, 0.95; decoupled decay)")


# --- Muon -----------------------------------------------------------------------------------------------------------


def _muon_variant(p: torch.Tensor, grads: Sequence[torch.Tensor], lr: float, wd: float, mu: float = 0.95, *,
                  nesterov: bool = True, ema: bool = False, factor: str = "max", decay: str = "decoupled",
                  keep: bool = True, flatten: bool = False,
                  ns_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The weights after each Muon step, with a switch for each usual mistake (the defaults are right)."""
    buf, out = torch.zeros_like(p), []
    A, B = p.shape[-2:]
    scale = {"max": 0.2 * math.sqrt(max(A, B)), "min": 0.2 * math.sqrt(min(A, B)), "none": 1.0,
             "no 0.2": math.sqrt(max(A, B)), "product": 0.2 * math.sqrt(A * B)}[factor]
    for g in grads:
        g = g + wd * p if decay == "coupled" else g
        new_buf = mu * buf + (1 - mu) * g if ema else mu * buf + g
        buf = new_buf if keep else mu * torch.zeros_like(p) + g
        direction = g + mu * buf if nesterov else buf
        if flatten and p.dim() == 3:
            ortho = newton_schulz(direction.reshape(-1, B), dtype=ns_dtype).view_as(p)
        else:
            ortho = newton_schulz(direction, dtype=ns_dtype)
        update = ortho * scale
        if decay == "decoupled":
            p = p * (1 - lr * wd) - lr * update
        elif decay == "no lr":
            p = p * (1 - wd) - lr * update
        else:
            p = p - lr * update
        out.append(p)
    return out


@checker
def check_muon_step(fn: Callable) -> Verdict:
    """``fn(p, grad, state: dict, lr, weight_decay, momentum=0.95) -> new p``: one Muon step as k2lab's MuonClip
    takes it (Moonlight's rules): the momentum buffer b ← μ b + g (kept in ``state``), the Nesterov direction
    g + μ b, orthogonalised by Newton-Schulz (5 steps) matrix by matrix (a stack of experts [E, A, B] is E matrices),
    scaled by 0.2·√max(A, B) so that its RMS matches AdamW's, and the decay decoupled: p ← p (1 − lr·wd) −
    lr·update. Checked over three steps on a wide matrix and a stack of tall ones, against MuonClip with its
    Newton-Schulz in float32; yours may run Newton-Schulz in bfloat16, which is then accepted within bfloat16's
    rounding."""
    g = generator(73)
    lr, wd = 0.02, 0.1
    for what, shape in (("a 6 x 10 matrix", (6, 10)), ("a stack of 3 experts, 8 x 5 each", (3, 8, 5))):
        p0 = torch.randn(shape, generator=g) * 0.3
        grads = [torch.randn(shape, generator=g) * s for s in (1.0, 0.5, 2.0)]
        ref = torch.nn.Parameter(p0.clone())
        opt = MuonClip([{"params": [ref], "use_muon": True}], lr=lr, weight_decay=wd, ns_dtype=torch.float32)
        expected = []
        for grad in grads:
            ref.grad = grad.clone()
            opt.step()
            expected.append(ref.detach().clone())
        variants = {name: _muon_variant(p0, grads, lr, wd, **switch) for name, switch in {
            "plain momentum": {"nesterov": False}, "ema": {"ema": True}, "no rms": {"factor": "none"},
            "min": {"factor": "min"}, "no 0.2": {"factor": "no 0.2"}, "product": {"factor": "product"},
            "coupled": {"decay": "coupled"}, "no decay": {"decay": "none"}, "no lr": {"decay": "no lr"},
            "no buffer": {"keep": False}, "flatten": {"flatten": True},
            "bf16": {"ns_dtype": torch.bfloat16}}.items()}
        state: dict = {}
        p = p0.clone()
        for step, grad in enumerate(grads):
            out, error = call(fn, p.clone(), grad.clone(), state, lr, wd, keep=(0, 1))  # state: theirs to update
            if error is not None:
                return error
            label = f"Muon, {what}, step {step + 1}"
            mistakes = [
                ("Nesterov: orthogonalise g + μ b (the gradient plus the momentum once more), not the buffer b itself",
                 variants["plain momentum"][step]),
                ("Muon's buffer sums: b ← μ b + g, not the average μ b + (1 − μ) g", variants["ema"][step]),
                ("you forgot the RMS matching: scale the orthogonalised update by 0.2·√max(A, B)",
                 variants["no rms"][step]),
                ("the RMS factor is 0.2·√max(A, B), the LARGER side, not the smaller", variants["min"][step]),
                ("the RMS factor is 0.2·√max(A, B): you left out the 0.2", variants["no 0.2"][step]),
                ("the RMS factor is 0.2·√max(A, B), not 0.2·√(A·B)", variants["product"][step]),
                ("you added the decay to the gradient; Muon's decay is decoupled: p (1 − lr·wd), apart from the update",
                 variants["coupled"][step]),
                ("you forgot the weight decay: p ← p (1 − lr·wd) − lr·update", variants["no decay"][step]),
                ("the decay is scaled by the learning rate: p (1 − lr·wd), not p (1 − wd)", variants["no lr"][step]),
                ("the momentum buffer does not last: you orthogonalised the raw gradient (or a buffer that starts "
                 "afresh at every call, the same once orthogonalised); keep b in `state`, so that it sums the past, "
                 "and orthogonalise g + μ b", variants["no buffer"][step]),
                ("a stack of experts is E matrices: orthogonalise each [A, B] on its own, not the stack flattened to "
                 "one matrix", variants["flatten"][step]),
            ]
            verdict = compare(label, out, expected[step], mistakes, atol=1e-5)
            if not verdict.ok:
                bf16 = variants["bf16"][step]
                tol = 2e-2 * bf16.abs().max().item()
                if isinstance(out, torch.Tensor) and out.shape == bf16.shape and torch.allclose(
                        out.double(), bf16.double(), atol=tol, rtol=0) and not verdict.mistake:
                    p = out.detach().float()
                    continue  # Newton-Schulz in bfloat16: accepted within its rounding
                return verdict
            p = torch.as_tensor(out).detach()
    return Verdict(True, "Muon: three steps equal to k2lab's MuonClip on a matrix and on a stack of experts "
                         "(momentum, Nesterov, RMS matching 0.2·√max(A, B), decoupled decay)")


# --- the training step ----------------------------------------------------------------------------------------------


def _tiny() -> K2Config:
    """A two-block K2 (dense, then MoE) small enough for a step in a fraction of a second."""
    return K2Config.nano().replace(num_hidden_layers=2, vocab_size=96, n_routed_experts=8, num_experts_per_tok=2,
                                   bos_token_id=None, eos_token_id=None)


def _recipe(cfg: K2Config, init: dict[str, torch.Tensor], batches: Sequence[torch.Tensor], lr: float, tau: float,
            bias_step: float, **switches) -> tuple[list[float], dict[str, torch.Tensor]]:
    """k2lab's ``recipe_step`` over ``batches`` from the weights ``init``, MuonClip with Newton-Schulz in float32,
    the loss over every position of each batch (``return_type="loss"``). ``switches`` make the usual mistakes:
    ``all_adamw``, ``muon_ends`` (Muon for the embedding and head), ``decay_norms``, ``embed_scale``."""
    from ...training.train import recipe_step

    model = K2Model(cfg)
    model.load_state_dict(init)
    model.train()
    norms = [p for n, p in model.named_parameters() if p.dim() < 2]
    ends = [model.embed_tokens.weight, model.lm_head.weight]
    hidden = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith(("embed_tokens", "lm_head"))]
    if switches.get("all_adamw"):
        groups = [{"params": hidden + [model.lm_head.weight]}, {"params": [model.embed_tokens.weight],
                                                                "lr_scale": switches.get("embed_scale", 10.0)},
                  {"params": norms, "weight_decay": 0.0}]
    elif switches.get("muon_ends"):
        groups = [{"params": hidden + ends, "use_muon": True}, {"params": norms, "weight_decay": 0.0}]
    else:
        groups = [{"params": hidden, "use_muon": True},
                  {"params": [model.embed_tokens.weight], "lr_scale": switches.get("embed_scale", 10.0)},
                  {"params": [model.lm_head.weight]},
                  {"params": norms, "weight_decay": 0.1 if switches.get("decay_norms") else 0.0}]
    opt = MuonClip(groups, lr=lr, weight_decay=0.1, ns_dtype=torch.float32)
    losses = []
    for batch in batches:
        with torch.enable_grad():
            loss, _, _, _ = recipe_step(model, opt, batch, tau, bias_step,
                                        loss_fn=lambda m, b: m(b, return_type="loss"))
        losses.append(loss.item())
    return losses, {n: t.detach().clone() for n, t in model.state_dict().items()}


@checker
def check_train_step(fn: Callable) -> Verdict:
    """``fn(params, opt_state, batch [B, T], cfg, lr, tau, bias_step, pad_id) -> (loss, max_logits [L, H])``: one
    step of K2's recipe on the model ``params`` (K2Model's state dict, updated in place: its entries replaced by the
    new weights; ``opt_state`` likewise holds each weight's optimizer state): the forward through ``my_k2`` (watched
    with ``lab.mine.observe`` for each head's largest logit and each MoE layer's expert counts), the next-token loss,
    the gradients, Muon for the hidden matrices and AdamW for the embedding (at 10 x lr), the head and the norms (no
    decay), then QK-Clip for every head above tau and the bias step. Two steps on a two-block K2 must leave the
    weights k2lab's ``recipe_step`` leaves (MuonClip, Newton-Schulz in float32), to float32 rounding."""
    cfg = _tiny()
    model = K2Model(cfg)
    model.init_weights(std=0.05, seed=74)
    init = {n: t.detach().clone() for n, t in model.state_dict().items()}
    g = generator(75)
    batches = [torch.randint(0, cfg.vocab_size - 1, (4, 10), generator=g) for _ in range(2)]
    _, seen = model.run_with_cache(batches[0], names="hook_max_logit")
    tau = 0.7 * seen.stack("hook_max_logit").max().item()  # some heads clip at the first step
    lr, bias_step, pad_id = 0.01, 0.01, cfg.vocab_size - 1
    expected_losses, expected = _recipe(cfg, init, batches, lr, tau, bias_step)
    params, opt_state = {n: t.clone() for n, t in init.items()}, {}
    losses = []
    for batch in batches:
        # The weights and the optimizer's state are theirs to update in place; the batch must come back unchanged.
        out, error = call(fn, params, opt_state, batch.clone(), cfg, lr, tau, bias_step, pad_id, keep=(2,))
        if error is not None:
            return error
        if not (isinstance(out, tuple) and len(out) == 2):
            return Verdict(False, f"training step: return (loss, max_logits [L, H]), got {type(out).__name__}")
        losses.append(float(torch.as_tensor(out[0]).detach()))
    if abs(losses[0] - expected_losses[0]) > 1e-4 * max(1.0, abs(expected_losses[0])):
        return Verdict(False, f"training step: your first loss is {losses[0]:.5f}, k2lab's {expected_losses[0]:.5f}: "
                              f"before any update, so the forward or the loss differs (my_k2, my_next_token_loss)")
    if set(params) != set(expected):
        missing, extra = sorted(set(expected) - set(params))[:3], sorted(set(params) - set(expected))[:3]
        return Verdict(False, f"training step: params must keep K2Model's names; missing {missing}, unexpected {extra}")
    differ = _differing(params, expected)
    if not differ:
        return Verdict(True, f"training step: after two steps every weight equals k2lab's recipe_step's to float32 "
                             f"rounding (losses {losses[0]:.3f}, {losses[1]:.3f})")
    variants = {
        "you stepped every weight with AdamW: Muon takes the hidden matrices (2-D and the stacked experts)":
            {"all_adamw": True},
        "the embedding and the head step with AdamW, not Muon (Muon is for the hidden matrices)": {"muon_ends": True},
        "the norms' weights take no weight decay": {"decay_norms": True},
        "the embedding steps at 10 x lr (K2-nano's embed_lr_scale)": {"embed_scale": 1.0},
    }
    for message, switches in variants.items():
        if not _differing(params, _recipe(cfg, init, batches, lr, tau, bias_step, **switches)[1]):
            return Verdict(False, f"training step: {message}", mistake=message)
    for message, (t, u) in {"QK-Clip did not act: every head whose largest logit is above tau is clipped after the "
                            "step (my_qk_clip with the max logits the forward saw)": (math.inf, bias_step),
                            "the correction biases did not move: after every step, my_bias_update with the expert "
                            "counts the forward saw": (tau, 0.0)}.items():
        if not _differing(params, _recipe(cfg, init, batches, lr, t, u)[1]):
            return Verdict(False, f"training step: {message}", mistake=message)
    from ..own_training import optimizer_of

    listed = ", ".join(f"{n} ({optimizer_of(n, expected[n])})" for n in differ[:3])
    return Verdict(False, f"training step: after two steps your weights differ from k2lab's recipe_step in "
                          f"{len(differ)} tensors, such as {listed}, and match no common mistake we know")


def _differing(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ beyond float32 rounding of a few steps."""
    out = []
    for name, want in expected.items():
        got = torch.as_tensor(params.get(name)).detach().cpu().double()
        want = want.double()
        if got.shape != want.shape or not torch.allclose(got, want, atol=1e-4 * max(1.0, want.abs().max().item()),
                                                           rtol=1e-3):
            out.append(name)
    return out


def compare_runs(yours: Sequence[float], k2lab: Sequence[float], window: int = 20, name: str = "your run") -> Verdict:
    """How close a training run of the learner's model (its losses, ``yours``) is to k2lab's ``recipe_step`` on the
    same data and seed, step by step, and why they may differ; ``name`` says whose run it is. Passes when the last
    ``window`` steps' losses agree to 0.1 nats."""
    a, b = torch.tensor(list(yours), dtype=torch.float64), torch.tensor(list(k2lab), dtype=torch.float64)
    if a.shape != b.shape or not len(a):
        return Verdict(False, f"the two runs must log the same steps: {len(a)} against {len(b)}")
    if not torch.isfinite(a).all():
        step = int((~torch.isfinite(a)).nonzero()[0])
        return Verdict(False, f"{name}: the loss became NaN or infinite at step {step}")
    gap = (a - b).abs()
    parted = (gap > 1e-3).nonzero()
    first = int(parted[0]) if len(parted) else len(a)
    late = gap[-window:].mean().item()
    why = ("The two compute the same sums in other orders (attention, the experts, Newton-Schulz), so they differ in "
           "float32's last bits from the first step; when a router's choice sits near a tie it can flip, a token "
           "goes to another expert, and from there the runs drift apart slowly, each a valid run of the recipe.")
    agree = (f"the losses agree to {gap[:first].max().item() if first else 0.0:.0e} nats for the first {first} "
             f"steps" + (f", then part: over the last {window} steps by {late:.3f} nats on average" if first < len(a)
                         else ", to the end"))
    ends = (f"{name} ends at {a[-window:].mean():.3f} nats, k2lab's at {b[-window:].mean():.3f} (mean of the last "
            f"{window})")
    if late > 0.1:
        return Verdict(False, f"{name} and k2lab's recipe_step: {agree}; {ends}. Runs that part this much from the "
                              f"first steps differ in a piece: check_train_step names which.")
    return Verdict(True, f"{name} and k2lab's recipe_step: {agree}; {ends}. {why}")
