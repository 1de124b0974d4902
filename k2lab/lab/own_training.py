"""10's "train it yourself": K2's recipe as a step over the learner's own model, written with the learner's pieces
(the reference for ``my_train_step``), and the live run that trains it beside k2lab's ``recipe_step``.

The learner's model is a function of its weights, ``my_k2(state_dict, cfg, ids)``, so training it is training a
dict of tensors: each step computes the loss through ``my_k2``, takes the gradients of every weight, steps each with
its optimizer (Muon for the hidden matrices, AdamW for the embedding, the head and the norms, as
``MuonClip.for_model`` splits them), then applies QK-Clip and the bias step from what the forward saw
(``observe``, which the notebook reaches as ``lab.mine.observe``). It is k2lab's ``recipe_step`` written out in the
learner's own functions.
"""

from __future__ import annotations

import contextlib
import functools
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from ..config import K2Config

EMBED_LR_SCALE = 10.0  # the embedding steps at 10 x lr, as in K2-nano's run (k2lab.training.TrainConfig)
WEIGHT_DECAY = 0.1  # K2's decoupled weight decay, for every weight but the norms


@functools.cache
def meta_mla(cfg: K2Config) -> torch.nn.Module:
    """k2lab's MLA for ``cfg`` on the meta device: a function of the weights it is called with."""
    from ..model import MultiHeadLatentAttention

    with torch.device("meta"):
        return MultiHeadLatentAttention(cfg)


def head_max_logits(w: dict[str, torch.Tensor], cfg: K2Config, hidden: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
    """[H] each head's largest scaled, causal pre-softmax logit over the batch, for MLA weights ``w`` and input
    ``hidden`` [B, T, D]: the ``hook_max_logit`` probe of k2lab's MLA, which is what QK-Clip watches."""
    attn = meta_mla(cfg)
    seen = []
    handle = attn.hook_max_logit.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        with torch.no_grad():
            functional_call(attn, {n: t.detach() for n, t in w.items()}, (hidden.detach(), cos, sin),
                            {"attn_impl": "naive"})
    finally:
        handle.remove()
    return seen[0].amax(dim=0)  # [B, H] -> [H]


@dataclass
class Observed:
    """What ``observe`` saw during one forward of the learner's model: each attention layer's largest logit per head
    (what QK-Clip watches) and each MoE layer's expert counts (what the bias step balances), in call order."""

    max_logits: list[torch.Tensor] = field(default_factory=list)  # per MLA call [H]
    counts: list[torch.Tensor] = field(default_factory=list)  # per router call [E]


@contextlib.contextmanager
def observe(module: types.ModuleType) -> Iterator[Observed]:
    """While it is open, every call of the learner's module's ``my_mla`` records each head's largest causal logit and
    every call of ``my_router`` its expert counts (``Observed``): what QK-Clip and the bias step need from a forward of
    the learner's model, whichever of its functions calls them. ``module`` is one ``lab.mine.load()`` made."""
    seen = Observed()
    mla, router = module.my_mla, module.my_router

    def watched_mla(w, cfg, hidden, cos, sin):
        seen.max_logits.append(head_max_logits(w, cfg, hidden, cos, sin))
        return mla(w, cfg, hidden, cos, sin)

    def watched_router(x, weight, bias, top_k, scaling):
        idx, weights = router(x, weight, bias, top_k, scaling)
        seen.counts.append(torch.bincount(idx.detach().flatten().cpu(), minlength=weight.shape[0]))
        return idx, weights

    module.__rebind__({"my_mla": watched_mla, "my_router": watched_router})
    try:
        yield seen
    finally:
        module.__rebind__({"my_mla": mla, "my_router": router})


def optimizer_of(name: str, tensor: torch.Tensor) -> str:
    """Which rule steps the weight ``name`` of K2Model's state dict: "muon" (a hidden matrix, or a stack of the
    experts' matrices), "adamw" (the embedding and the head), "adamw, no decay" (a norm's weight) or "bias step"
    (a router's correction bias, which no gradient moves)."""
    if name.endswith("e_score_correction_bias"):
        return "bias step"
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return "adamw"
    return "muon" if tensor.dim() >= 2 else "adamw, no decay"


def head_rows(params: dict[str, torch.Tensor], cfg: K2Config, layer: int, head: int) -> dict[str, torch.Tensor]:
    """One head's weight rows, as ``my_qk_clip`` takes them: q_nope and q_pe of ``q_b_proj``, k_nope and v of
    ``kv_b_proj``, and the rotary key rows of ``kv_a_proj_with_mqa`` that every head shares."""
    H, N, R, V, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    p = f"layers.{layer}.self_attn."
    q = params[p + "q_b_proj.weight"].view(H, N + R, -1)[head]  # [N + R, q_lora_rank]
    kv = params[p + "kv_b_proj.weight"].view(H, N + V, C)[head]  # [N + V, C]
    return {"q_nope": q[:N], "q_pe": q[N:], "k_nope": kv[:N], "v": kv[N:],
            "k_pe": params[p + "kv_a_proj_with_mqa.weight"][C:]}


def set_head_rows(params: dict[str, torch.Tensor], cfg: K2Config, layer: int, head: int,
                  rows: dict[str, torch.Tensor]) -> None:
    """Write one head's clipped rows back, as new tensors (the old ones are left as they were). ``k_pe`` is shared by
    every head and QK-Clip never changes it: a changed one is refused."""
    H, N, R, V, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    p = f"layers.{layer}.self_attn."
    if not torch.equal(rows["k_pe"], params[p + "kv_a_proj_with_mqa.weight"][C:]):
        raise ValueError("my_qk_clip changed k_pe, the rotary key every head shares: QK-Clip leaves it as it is")
    q = params[p + "q_b_proj.weight"].clone().view(H, N + R, -1)
    q[head] = torch.cat([rows["q_nope"], rows["q_pe"]])
    kv = params[p + "kv_b_proj.weight"].clone().view(H, N + V, C)
    kv[head] = torch.cat([rows["k_nope"], rows["v"]])
    params[p + "q_b_proj.weight"], params[p + "kv_b_proj.weight"] = q.flatten(0, 1), kv.flatten(0, 1)


def training_step(module: types.ModuleType, params: dict[str, torch.Tensor], opt_state: dict[str, dict],
                  batch: torch.Tensor, cfg: K2Config, lr: float, tau: float, bias_step: float,
                  pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of K2's recipe on the learner's model, with the pieces of ``module`` (the learner's module): the
    forward through ``my_k2`` on ``batch`` [B, T] (watched, for each head's largest logit and each MoE layer's
    counts), ``my_next_token_loss``, the gradients, ``my_muon_step`` or ``my_adamw_step`` for each weight, then
    ``my_qk_clip`` for every head and ``my_bias_update`` for every MoE layer. ``params`` and ``opt_state`` are
    updated (their entries replaced by new tensors); returns the loss and the max logits [L, H]."""
    trainable = [n for n, t in params.items() if optimizer_of(n, t) != "bias step"]
    with torch.enable_grad():  # the lab's notebooks run without gradients unless asked
        leaves = {n: params[n].detach().requires_grad_() for n in trainable}
        with observe(module) as seen:
            logits = module.my_k2({**params, **leaves}, cfg, batch)  # [B, T, V]
        loss = module.my_next_token_loss(logits, batch, pad_id)
        grads = torch.autograd.grad(loss, list(leaves.values()))
    with torch.no_grad():
        for (name, p), grad in zip(leaves.items(), grads, strict=True):
            rule, state = optimizer_of(name, p), opt_state.setdefault(name, {})
            if rule == "muon":
                params[name] = module.my_muon_step(p.detach(), grad, state, lr, WEIGHT_DECAY)
            else:
                scale = EMBED_LR_SCALE if name == "embed_tokens.weight" else 1.0
                decay = 0.0 if rule == "adamw, no decay" else WEIGHT_DECAY
                params[name] = module.my_adamw_step(p.detach(), grad, state, lr * scale, decay)
        max_logits = torch.stack(seen.max_logits)  # [L, H] from the forward, before this step's update
        for layer in range(cfg.num_hidden_layers):
            for head in range(cfg.num_attention_heads):
                if max_logits[layer, head] > tau:
                    clipped = module.my_qk_clip(head_rows(params, cfg, layer, head), max_logits[layer, head].item(),
                                                tau)
                    set_head_rows(params, cfg, layer, head, clipped)
        moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        names = [f"layers.{i}.mlp.gate.e_score_correction_bias" for i in moe]
        new_bias = module.my_bias_update(torch.stack([params[n] for n in names]),
                                         torch.stack(seen.counts).float(), bias_step)  # [L_moe, E]
        for name, b in zip(names, new_bias, strict=True):
            params[name] = b.to(params[name].dtype)
    return loss.detach(), max_logits


class Progress:
    """One line that a long loop rewrites as it goes (in place in a notebook, a new line per update elsewhere)."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.start = what, total, time.perf_counter()
        self._handle = None
        try:
            from IPython import get_ipython
            from IPython.display import display

            if get_ipython() is not None:
                self._handle = display(self._text(0, ""), display_id=True)
        except ImportError:
            pass

    def _text(self, done: int, note: str) -> str:
        seconds = time.perf_counter() - self.start
        return f"{self.what}: step {done}/{self.total}, {seconds:.0f} s{', ' + note if note else ''}"

    def update(self, done: int, note: str = "") -> None:
        """Show that ``done`` steps are done, with the seconds so far and ``note``."""
        text = self._text(done, note)
        if self._handle is not None:
            self._handle.update(text)
        else:
            print(text, flush=True)


@dataclass
class RunRecord:
    """What a live run logged per step."""

    loss: list[float] = field(default_factory=list)
    max_logit: list[float] = field(default_factory=list)  # the largest of any head
    clipped: list[int] = field(default_factory=list)  # heads above tau
    seconds: float = 0.0


def run(what: str, step: Callable[[int], tuple[torch.Tensor, torch.Tensor]], steps: int, tau: float,
        every: int = 10) -> RunRecord:
    """``steps`` calls of ``step(i) -> (loss, max_logits [L, H])``, logged, with a progress line every ``every``."""
    record, progress = RunRecord(), Progress(what, steps)
    for i in range(steps):
        loss, max_logits = step(i)
        record.loss.append(loss.item())
        record.max_logit.append(max_logits.max().item())
        record.clipped.append(int((max_logits > tau).sum()))
        if (i + 1) % every == 0 or i + 1 == steps:
            progress.update(i + 1, f"loss {record.loss[-1]:.2f}")
    record.seconds = time.perf_counter() - progress.start
    return record
