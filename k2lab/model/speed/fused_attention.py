"""Speed room: attention through PyTorch's fused kernel (``F.scaled_dot_product_attention``).

Replaces the reference's ``softmax(q k^T * scale + mask) v`` in ``attention.py``'s naive path whenever no probe reads
the scores or the pattern: the fused kernel never writes the [B, H, T, S] scores to memory (flash-style on GPUs,
a tiled kernel on the CPU), which is what makes a long prefill affordable.

On the CPU the fused kernels need equal q/k and v widths; MLA's are 192 and 128 (K2), and with unequal widths
torch falls back to its unfused math path. Zero-padding v to the q/k width and slicing the output back costs less
than that fall-back and changes nothing: the padded columns of the output are zeros. What a prefill gains over the
written-out softmax: ``python -m benchmarks.vs_hf`` (docs/speed.md). ``max_logit`` gives QK-Clip its per-head
maximum without leaving the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, T, E], k [B, H, S, E], v [B, H, S, V] -> per-head outputs [B, T, H, V]. ``mask`` [B, 1, T, S] bool
    (True: may attend); None: plain causal with T == S, or a single query."""
    T, width = q.shape[-2], v.shape[-1]
    pad = q.shape[-1] - width if q.device.type == "cpu" else 0
    out = F.scaled_dot_product_attention(
        q, k, F.pad(v, (0, pad)) if pad > 0 else v, attn_mask=mask, scale=scale,
        # A branch, not the comparison's value: where T and S are symbols (a compiled graph) the comparison is a
        # symbolic bool, which SDPA refuses, and a branch makes the trace decide it.
        is_causal=True if mask is None and T > 1 else False,
    )
    return out[..., :width].transpose(1, 2)  # [B, T, H, V]


@torch.no_grad()
def max_logit(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """Each head's largest scaled logit over the keys its queries may see (``mask`` [B | 1, 1 | H, T, S]), [B, H],
    detached: the scores once more, without autograd, for their maximum only (the scale, > 0, goes on it)."""
    scores = q @ k.transpose(-1, -2)  # [B, H, T, S] unscaled
    return scores.masked_fill_(~mask, float("-inf")).amax(dim=(-2, -1)) * scale
