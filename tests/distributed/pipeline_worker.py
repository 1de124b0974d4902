"""One rank of tests/distributed/test_pipeline.py, launched by torchrun: builds the pipeline, runs what the tests
compare, and saves it to ``OUT/rank{r}.pt``. The comparisons with one process happen in the test.

Also the checkpoint the tests share: a random mini K2 written in the release layout (FP8 e4m3 blocks with partial
edges, per-expert names), one shard per placement unit, so a rank reading another rank's shard would show."""

from __future__ import annotations

import argparse
import json
import math
import re
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from k2lab import K2Config, K2Model, routing
from k2lab.analysis.interventions import ablate_experts
from k2lab.distributed import PipelinedK2, init
from k2lab.weights.placement import placement_units
from k2lab.weights.quant.fp8 import FP8Format
from k2lab.weights.reader import Checkpoint
from k2lab.weights.writer import write_checkpoint

# No matrix a whole number of (non-square) blocks; layer 0 dense, layers 1-3 MoE with 16 experts top-4.
CONFIG = K2Config.mini().replace(
    vocab_size=384, hidden_size=200, intermediate_size=300, moe_intermediate_size=80, num_hidden_layers=4,
    q_lora_rank=72, kv_lora_rank=40, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=16,
    num_experts_per_tok=4,
)
FORMAT = FP8Format((32, 48))  # no matrix a whole number of blocks
ABLATED = {1: [0, 1, 2, 3], 3: [4, 5, 6]}  # experts removed (mode "reroute") in the ablation check
NEW_TOKENS = 6
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")


def token_ids() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))


def left_padding() -> torch.Tensor:
    """The attention mask [2, 9] of a left-padded batch over ``token_ids()``: row 0 has 3 pads, row 1 none."""
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    return mask


@torch.no_grad()
def write_mini_checkpoint(folder: Path, seed: int = 0) -> Path:
    """Random weights that expose bugs (norms far from one, a wide router, a non-zero correction bias), written as
    the release would, one shard per unit: embed_tokens, each block, then the final norm with the head."""
    model = K2Model(CONFIG)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            wide = 3.0 if name.endswith("mlp.gate.weight") else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * wide / math.sqrt(p.shape[-1]))
    for layer in model.layers[CONFIG.first_k_dense_replace:]:
        layer.mlp.gate.e_score_correction_bias.copy_(0.2 * torch.randn(CONFIG.n_routed_experts, generator=gen))
    state = model.state_dict()

    def tensor(spec):
        expert = _EXPERT.fullmatch(spec.name)
        if expert:
            return state[f"layers.{expert[1]}.mlp.experts.{expert[3]}"][int(expert[2])]
        return state[spec.name.removeprefix("model.")]

    return write_checkpoint(folder, CONFIG, tensor, num_shards=len(placement_units(CONFIG)) - 1, format=FORMAT)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", help="JSON {unit prefix: rank}; default: the plan over --devices")
    parser.add_argument("--devices", help="JSON list of capacities in bytes, one per rank")
    parser.add_argument("--broken", help="a copy of the checkpoint missing a shard, loaded first by rank 1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    init(timeout=timedelta(seconds=60))  # a rank stuck for a minute fails the run instead of hanging it
    rank = dist.get_rank()
    stages = json.loads(args.stages) if args.stages else None
    devices = json.loads(args.devices) if args.devices else None
    results: dict[str, object] = {}

    if args.broken:
        try:
            PipelinedK2(args.broken if rank == 1 else args.model, dtype=torch.float32, stages=stages, devices=devices)
        except RuntimeError as err:
            results["load_error"] = str(err)

    reads: list[tuple[str, str]] = []  # (tensor, file) of every read that materialised data
    original = Checkpoint.read

    def counting(self, info, device="cpu"):
        if torch.device(device).type != "meta":
            reads.append((info.name, info.file.name))
        return original(self, info, device)

    Checkpoint.read = counting
    pm = PipelinedK2(args.model, dtype=torch.float32, stages=stages, devices=devices)
    Checkpoint.read = original
    results.update(stages=pm.stages, reads=reads, meta=sorted(
        name for name, p in pm.model.named_parameters() if p.is_meta))

    ids = token_ids()
    results["logits"] = pm(ids)
    _, cache = pm.run_with_cache(ids)
    results["cache"] = dict(cache)
    results["logit_lens"] = cache.logit_lens(pos=-1)
    results["attribution"] = cache.logit_attribution(int(ids[0, -1]), pos=-1).total()
    results["trace"] = routing.trace(pm, ids).indices
    with ablate_experts(pm, ABLATED, mode="reroute"):
        results["ablated"] = pm(ids)
    results["masked_logits"] = pm(ids, attention_mask=left_padding())
    results["greedy"] = pm.generate(ids, NEW_TOKENS)
    results["masked_greedy"] = pm.generate(ids, NEW_TOKENS, attention_mask=left_padding())
    results["sampled"] = pm.generate(ids, NEW_TOKENS, temperature=1.0, top_k=50, seed=1)
    try:
        pm.generate(ids, NEW_TOKENS, top_p=2.0)
    except (ValueError, RuntimeError) as err:
        results["generate_error"] = f"{type(err).__name__}: {err}"
    results["bytes_sent"] = pm.bytes_sent
    torch.save(results, Path(args.out) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
