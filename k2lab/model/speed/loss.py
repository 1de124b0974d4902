"""Speed room: next-token cross-entropy through the untied head, a few rows at a time; and the loss ``K2Model.forward``
returns, which chooses between that and the plain cross-entropy of the whole logits.

``next_token_loss`` is ``forward``'s loss (``return_type="loss" | "both"``). When no logits are returned or probed
(``return_type="loss"``, which training calls) it runs ``head_loss``, which replaces
``F.cross_entropy(model.head(x), targets)`` by ``head_cross_entropy``:

A training batch's logits are big and short-lived: 16 x 256 tokens over K2-nano's 8,192 ids is a
[4096, 8192] float32 tensor, 134 MB, that the head writes, log-softmax reads and writes again, and the
backward reads and writes once more. On a CPU those passes over memory cost more than the head's matmul.
``head_cross_entropy`` takes the final hidden states instead and, for each chunk of rows, computes the
chunk's logits, its loss and its gradient while the chunk is in cache:

    loss_n  = logsumexp(z_n) - z_n[y_n]             z_n = W h_n, the logits of row n   [V]
    dL/dz_n = softmax(z_n) - onehot(y_n)            (divided by N for the mean)
    dL/dh_n = dL/dz_n @ W          dL/dW = sum_n dL/dz_n^T h_n

The gradients are made in the forward (as Liger's fused linear cross-entropy does) and only scaled by the
incoming gradient in the backward; without autograd (evaluation) only the loss is computed. The result equals
``F.cross_entropy(h @ W.T, y)`` to float32 rounding (tests/model/test_loss.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

if TYPE_CHECKING:
    from ..inputs import Inputs
    from ..transformer import K2Model

ReturnType = Literal["logits", "loss", "both"]

# Rows per chunk: 256 rows of 8,192 float32 logits are 8 MB, well inside a CPU's last-level cache (the fastest of
# 128 / 256 / 512 / 1,024 rows on K2-nano's head on a 2-core AVX2 CPU).
CHUNK_ROWS = 256


def next_token_loss(model: K2Model, x: torch.Tensor, inputs: Inputs, return_type: ReturnType, per_token: bool
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``K2Model.forward``'s loss from the last residual x [B, T, D]: the cross-entropy in nats of each next token, over
    the positions whose token and next token are both real (``inputs.mask``); the mean, or [B, T - 1] when
    ``per_token`` (0 where excluded); ``return_type="both"``: (logits, loss)."""
    ids, mask = inputs.ids, inputs.mask
    if ids.shape[1] < 2:
        raise ValueError(f"a next-token loss needs at least 2 tokens per row; got {ids.shape[1]}")
    targets = ids[:, 1:]  # [B, T-1]
    scored = torch.ones_like(targets, dtype=torch.bool)  # [B, T-1] token and target both real
    if mask is not None:
        scored = mask[:, 1:] & mask[:, :-1]
        if not torch.compiler.is_compiling() and scored.device.type != "meta" and not scored.any():
            raise ValueError("no position has both a real token and a real next token (attention_mask)")
    if return_type == "loss" and not per_token and model.speed and not model.hook_logits.active:  # never hold logits
        last = torch.zeros_like(scored[:, :1])  # the last position predicts nothing
        return head_loss(model, x, torch.cat((targets, last.long()), 1), torch.cat((scored, last), 1)).to(ids.device)
    logits = model.head(x).to(ids.device)  # [B, T, V]
    per_position = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="none")
    loss = per_position.view_as(targets) * scored  # [B, T-1]
    loss = loss if per_token else loss.sum() / scored.sum().clamp(min=1)
    return loss if return_type == "loss" else (logits, loss)


def head_loss(model: K2Model, x: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor | None = None,
              reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy in nats of ``targets`` [B, T] (the token each position predicts) under the logits of the last
    residual x [B, T, D], over the positions ``scored`` [B, T] bool (all when None), "mean" or "sum". The final norm
    runs as ``K2Model.head`` runs it; a plain head then runs chunk by chunk (``head_cross_entropy``: the [B, T, V]
    logits are never held); a quantized head, or any head with the speed rooms off, through its whole logits."""
    hidden = model.norm.hook_out(model.norm(x.to(model.norm.weight.device)))  # [B, T, D]
    if scored is not None and hidden.device.type != "meta":  # (on meta, which positions count is unknown: all do)
        hidden, targets = hidden[scored.to(hidden.device)], targets[scored]  # [N, D], [N]
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if not isinstance(model.lm_head, nn.Linear) or not model.speed:
        logits = model.lm_head(hidden.to(model.lm_head.weight.device)).float()  # [N, V]
        return F.cross_entropy(logits, targets.to(logits.device), reduction=reduction)
    weight = model.lm_head.weight
    return head_cross_entropy(hidden.to(weight.device), weight, targets.to(weight.device), reduction)


def head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       reduction: str = "mean", chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """Cross-entropy in nats of ``targets`` [N] (int) under the logits ``hidden @ weight.T``, computed in float32:
    hidden [N, D], weight [V, D] (the head's), ``reduction`` "mean" or "sum" over the N rows."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, D] and weight [V, D] must share D; got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    want_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _HeadCrossEntropy.apply(hidden, weight, targets, reduction == "mean", chunk_rows, want_grad)


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, mean, chunk_rows, want_grad):
        scale = 1.0 / hidden.shape[0] if mean else 1.0
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grad else None  # [N, D]
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_grad else None
        for start in range(0, hidden.shape[0], chunk_rows):
            h, y = hidden[start : start + chunk_rows], targets[start : start + chunk_rows]  # [n, D], [n]
            logits = (h @ weight.T).float()  # [n, V]
            target_logit = logits.gather(1, y[:, None])[:, 0]  # [n]
            peak = logits.amax(dim=1, keepdim=True)  # [n, 1]: exp never overflows
            probs = logits.sub_(peak).exp_()  # [n, V] unnormalised, in place: the chunk's one pass of exp
            norm = probs.sum(dim=1)  # [n]
            total += (norm.log() + peak[:, 0] - target_logit).sum()
            if want_grad:
                grad_logits = probs.div_(norm[:, None])  # softmax
                grad_logits[torch.arange(len(y), device=y.device), y] -= 1.0
                grad_logits *= scale  # [n, V] dL/dz
                grad_hidden[start : start + chunk_rows] = grad_logits.to(weight.dtype) @ weight
                grad_weight.addmm_(grad_logits.T, h.float())
        if want_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return (total * scale).float()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_loss = grad_loss.to(grad_hidden.dtype)
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None
