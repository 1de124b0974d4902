"""Speed room: next-token cross-entropy through the untied head, a few rows at a time.

Replaces ``F.cross_entropy(model.head(x), targets)`` in ``K2Model.forward``'s loss when no logits are returned or
probed (``return_type="loss"``, which training calls).

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

import torch
from torch.autograd.function import once_differentiable

# Rows per chunk: 256 rows of 8,192 float32 logits are 8 MB, well inside a CPU's last-level cache (the fastest of
# 128 / 256 / 512 / 1,024 rows on K2-nano's head on a 2-core AVX2 CPU).
CHUNK_ROWS = 256


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
