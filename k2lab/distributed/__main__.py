"""The pipeline demo: ``torchrun --nproc-per-node N -m k2lab.distributed --model PATH --prompt "..."``.

Every rank loads its stage; rank 0 prints the placement, the logit lens of the prompt's last token (each block's
best guess for the next token) and a greedy completion. docs/multinode.md gives the commands for K2 on one and
two nodes."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ..tokenizer import load_tokenizer
from .pipeline import PipelinedK2

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m k2lab.distributed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint folder or Hub repo id (release layout)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--tokenizer", help="tokenizer folder or repo id (default: --model)")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="default: bfloat16 on GPUs, float32 on CPUs (whose bfloat16 matmuls are slow)")
    parser.add_argument("--num-layers", type=int, help="only the first N blocks (a logit-lens view of a prefix)")
    parser.add_argument("--expert-budget-gb", type=float, help="stream routed experts through an LRU of this size")
    args = parser.parse_args(argv)

    dtype = DTYPES[args.dtype] if args.dtype else (None if torch.cuda.is_available() else torch.float32)
    budget = int(args.expert_budget_gb * 1e9) if args.expert_budget_gb is not None else None
    pm = PipelinedK2(args.model, dtype=dtype, num_layers=args.num_layers, expert_budget_bytes=budget)
    tok = load_tokenizer(args.tokenizer or args.model)
    ids = torch.tensor([tok.encode(args.prompt)])
    say = print if pm.rank == 0 else (lambda *_: None)
    say(pm.describe())

    _, cache = pm.run_with_cache(ids, names="hook_resid_post")
    lens = cache.logit_lens(pos=-1)[:, 0].softmax(-1)  # [L, V] each block's next-token distribution
    say(f"\nlogit lens of the last prompt token {tok.decode(ids[0, -1:].tolist())!r}:")
    for layer, probs in enumerate(lens):
        p, token = probs.max(-1)
        say(f"  layers.{layer:<3} {tok.decode([int(token)])!r:<20} p={p:.3f}")

    out = pm.generate(ids, args.max_new_tokens)
    say(f"\n{args.prompt}{tok.decode(out[0, ids.shape[1]:].tolist())}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
