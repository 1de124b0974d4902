"""The MoE dispatch's data movement at prefill, each choice against the one it replaced, at one thread and all cores.

    python -m benchmarks.moe_dispatch [--tokens 512] [--rounds 15]

On the benchmark config of ``benchmarks.vs_hf`` (64 experts of 256, top-8, width 768, float32) with routing drawn
from a real router over random hidden states, so expert loads are uneven as in a model:
- gather: each slot's token row, grouped by expert: ``x[order // k]`` against ``x.index_select(0, order // k)``;
- un-permute: expert outputs back to slot order: ``index_copy_`` against ``index_select`` with the inverse
  permutation (its argsort included);
- combine: the weighted sum over the k slots: multiply and sum against one batched [1, k] @ [k, D] matmul;
- a whole routed-experts call with its experts one at a time (one gather, one cat, one un-permute) against
  gathering and scattering group by group (the inference path it replaced);
- a whole routed-experts call, k2lab's (experts in pairs of similar load, one batched product per pair over a
  strided view of the stacks) against the same dispatch with its experts one at a time;
- the same call's forward and backward, as training runs it: the stacks read through ``StackSlices`` (one gradient
  node per stack) against plain slices (one stack-sized gradient per pair and stack).
Each pair's results are checked equal before timing.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable

import torch

from k2lab.model.moe import MoE, RoutedExperts, group_span

from .timing import alternate_threads
from .vs_hf import BENCH


def one_by_one(experts: RoutedExperts) -> RoutedExperts:
    """The same experts (shared weights) dispatched one at a time."""
    single = copy.copy(experts)
    single.pairs_in_place = False
    return single


def sliced_per_group(experts: RoutedExperts) -> RoutedExperts:
    """The same experts (shared weights) whose groups read the stacks through plain slices: in backward, one
    stack-sized gradient per group and stack, which ``StackSlices`` replaced with one per stack."""
    plain = copy.copy(experts)
    stacks = (experts.gate_proj, experts.up_proj, experts.down_proj)
    plain.group_weights = lambda groups: [tuple(w[group_span(group)] for w in stacks) for group in groups]
    return plain


def forward_backward(experts: RoutedExperts, x: torch.Tensor, idx: torch.Tensor,
                     upstream: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A run of the experts' forward and backward, as a training step makes them: the gradients of the input and
    of the three stacks, flattened into one tensor (for the check that both ways agree)."""
    def run() -> torch.Tensor:
        with torch.enable_grad():
            h = x.detach().requires_grad_()
            (experts(h, idx) * upstream).sum().backward()
        grads = torch.cat([g.flatten() for g in (h.grad, experts.gate_proj.grad, experts.up_proj.grad,
                                                 experts.down_proj.grad)])
        experts.zero_grad(set_to_none=True)
        return grads
    return run


def per_group(experts, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The replaced inference path: each group's tokens gathered just before its expert runs, its output written
    straight into its slots."""
    N, k = idx.shape
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    chosen = [e for e, count in enumerate(counts) if count]
    out = x.new_empty(N * k, x.shape[-1])
    for e, slots in zip(chosen, order.split([counts[e] for e in chosen]), strict=True):
        out[slots] = experts.expert(e, x[slots // k])
    return out.view(N, k, -1)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    cfg = BENCH
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        p.normal_(0, 0.02)
    moe.gate.weight.normal_(0, 3 / cfg.hidden_size**0.5)  # as vs_hf: routing that is not uniform noise
    x = torch.randn(args.tokens, cfg.hidden_size)
    idx, weights = moe.gate(x)  # [N, k]
    k = idx.shape[1]
    counts = torch.bincount(idx.flatten(), minlength=cfg.n_routed_experts)
    order = idx.flatten().argsort(stable=True)
    rows = torch.randn(args.tokens * k, cfg.hidden_size)
    slots = torch.randn(args.tokens, k, cfg.hidden_size)
    single = one_by_one(moe.experts)

    pairs = {
        "gather": (lambda: x[order // k], lambda: x.index_select(0, order // k)),
        "un-permute": (lambda: rows.new_empty(rows.shape).index_copy_(0, order, rows),
                       lambda: rows.index_select(0, order.argsort())),
        "combine": (lambda: (slots * weights[..., None]).sum(dim=1),
                    lambda: torch.matmul(weights.unsqueeze(-2), slots).squeeze(-2)),
        "routed experts": (lambda: per_group(moe.experts, x, idx), lambda: single(x, idx)),
        "expert pairs": (lambda: single(x, idx), lambda: moe.experts(x, idx)),
        "pairs, training": (forward_backward(sliced_per_group(moe.experts), x, idx, slots),
                            forward_backward(moe.experts, x, idx, slots)),
    }
    for name, (old, new) in pairs.items():
        torch.testing.assert_close(old(), new(), rtol=1e-5, atol=1e-6, msg=f"{name}: the two ways differ")

    threads = sorted({1, os.cpu_count() or 1})
    runs = {f"{name} {which}": fn for name, pair in pairs.items() for which, fn in zip(("old", "new"), pair,
                                                                                         strict=True)}
    times = alternate_threads(runs, threads, args.rounds)
    print(f"{args.tokens} tokens, {cfg.n_routed_experts} experts top-{k}, width {cfg.hidden_size}; tokens per "
          f"expert max / mean {counts.max().item() / counts.float().mean().item():.2f}; {args.rounds} rounds, medians")
    print(f"{'':16s}" + "".join(f"{f'{n} thread(s): old / new ms, new/old':>44s}" for n in threads))
    for name in pairs:
        cells = [f"{times[f'{name} old', n] * 1e3:9.2f} / {times[f'{name} new', n] * 1e3:7.2f}  "
                 f"{times[f'{name} new', n] / times[f'{name} old', n]:12.2f}" for n in threads]
        print(f"{name:16s}" + "".join(f"{c:>44s}" for c in cells))
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
