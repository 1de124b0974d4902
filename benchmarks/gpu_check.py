"""GPU check: K2 blocks at true size with random FP8 weights made on the GPU (no checkpoint, no download).

    python -m benchmarks.gpu_check [--tokens 1 16 128 1024 4096] [--context 4096]
    python -m benchmarks.gpu_check --smoke      # the same code on the CPU at mini size: checks the script itself

Without a GPU (and without --smoke) it says so and exits with status 0. On one GPU it reports:
- the machine: device-to-device copy bandwidth and the bfloat16 matmul rate, measured here;
- memory: K2's dense block 0 and one MoE block (384 experts of 2048) held FP8-resident, against the bytes
  accounting.py predicts;
- time per block with the default attention path ("auto": naive for a prefill without a cache, absorbed for a
  decode step) at several token counts (prefill, no cache) and for one decode step over a latent cache of
  --context tokens; prefill and decode tokens/s of the 61-block model extrapolated from them (1 dense + 60 MoE
  blocks; embedding, head and transfers between GPUs left out);
- the cost of dequantizing per use: the same MoE block with every weight in bfloat16 (34 GB) against FP8;
- fractions of the machine: a decode step's FP8 bytes over the copy bandwidth, prefill FLOPs over the matmul rate;
- device_map: a small FP8 checkpoint split between CPU and GPU (FP8-resident there, also with streamed
  experts) gives the CPU's logits and greedy tokens.
Expected to take a minute or two on an H200 (not yet run on one; --smoke runs every code path on the CPU).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time

import torch
from torch import nn

import k2lab
from k2lab import K2Config, K2Model
from k2lab.model.layers import RMSNorm
from k2lab.model.moe import RoutedExperts, Router
from k2lab.model.transformer import DecoderLayer
from k2lab.weights.quant.fp8 import FP8Format, FP8Linear, FP8RoutedExperts
from k2lab.weights.schema import EXPERT_PROJS, layer_tensors
from k2lab.weights.writer import write_checkpoint

GB = 1e9


def seconds(fn, device: torch.device, rounds: int = 5) -> float:
    """Median wall time of ``fn`` after one warm-up call, synchronising the GPU around each call."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_limits(device: torch.device, size: int) -> tuple[float, float]:
    """(copy bandwidth in bytes/s, counting read + write; bfloat16 matmul FLOP/s) measured on ``device``."""
    src = torch.ones(size // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * size / seconds(lambda: dst.copy_(src), device)
    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    return bandwidth, 2 * n**3 / seconds(lambda: a @ b, device)


def one_block(cfg: K2Config, moe: bool) -> K2Config:
    """``cfg`` with a single block, MoE or dense: block 0, the one a one-block model and its cache hold."""
    return cfg.replace(num_hidden_layers=1, first_k_dense_replace=0 if moe else 1)


def holding(block: DecoderLayer, cfg: K2Config) -> K2Model:
    """A K2Model of ``cfg`` (one block) whose block is ``block``; its embedding and head stay on the meta device, never
    run: ``run_blocks`` runs the block as a whole forward runs each of its blocks."""
    model = K2Model(cfg, dtype=torch.bfloat16, device="meta")
    model.layers[0] = block
    return model


@torch.no_grad()
def random_fp8_block(cfg: K2Config, fmt: FP8Format, layer: int, device: torch.device, seed: int = 0) -> DecoderLayer:
    """Block ``layer`` of ``cfg`` with its matrices FP8-resident, filled with random N(0, 1/fan_in) weights
    quantized on ``device``; norms one, router random with a non-zero correction bias."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        return fmt.quantize("weight", torch.randn(rows, cols, device=device, generator=gen) / math.sqrt(cols))

    with torch.device("meta"):
        block = DecoderLayer(cfg, layer)
    for name, module in list(block.named_modules()):
        parent, _, leaf = name.rpartition(".")
        if isinstance(module, nn.Linear):
            linear = FP8Linear(module.in_features, module.out_features, fmt.block, device=device)
            linear.weight_fp8, linear.weight_scale_inv = fp8(module.out_features, module.in_features)
            setattr(block.get_submodule(parent), leaf, linear)
        elif isinstance(module, RoutedExperts):
            experts = FP8RoutedExperts(cfg, fmt.block, device=device)
            for e in range(cfg.n_routed_experts):
                for proj in EXPERT_PROJS:
                    values, scale = fp8(*getattr(experts, f"{proj}_fp8").shape[1:])
                    getattr(experts, f"{proj}_fp8")[e] = values
                    getattr(experts, f"{proj}_scale_inv")[e] = scale
            setattr(block.get_submodule(parent), leaf, experts)
        elif isinstance(module, RMSNorm):
            module.weight = nn.Parameter(torch.ones(module.weight.shape, dtype=torch.bfloat16, device=device))
        elif isinstance(module, Router):
            E, D = module.weight.shape
            module.weight = nn.Parameter(
                (torch.randn(E, D, device=device, generator=gen) * 3 / math.sqrt(D)).bfloat16())
            module.e_score_correction_bias = 0.01 * torch.randn(E, device=device, generator=gen)
    return block


@torch.no_grad()
def dequantized_copy(block: DecoderLayer, cfg: K2Config) -> DecoderLayer:
    """The same block with every FP8 matrix dequantized once into plain bfloat16 modules."""
    with torch.device("meta"):
        dense = DecoderLayer(cfg, block.layer)
    state = {}
    for name, module in block.named_modules():
        if isinstance(module, FP8Linear):
            state[f"{name}.weight"] = module.weight
        elif isinstance(module, FP8RoutedExperts):
            for p in EXPERT_PROJS:
                shape = getattr(module, f"{p}_fp8").shape
                state[f"{name}.{p}"] = torch.empty(shape, dtype=torch.bfloat16, device=module.gate_proj_fp8.device)
            for e in range(module.num_experts):  # one expert at a time: no float32 copy of all 384
                for p, weight in zip(EXPERT_PROJS, module.expert_weights(e), strict=True):
                    state[f"{name}.{p}"][e] = weight
    state.update({k: v for k, v in block.state_dict().items() if not k.endswith(("_fp8", "_scale_inv"))})
    dense.load_state_dict(state, strict=True, assign=True)
    return dense


def block_bytes(cfg: K2Config, fmt: FP8Format, layer: int) -> int:
    """What the FP8 format says the block holds FP8-resident: e4m3 matrices with scales, bfloat16 rest."""
    return sum(fmt.tensor_bytes(s, scales=True) for s in layer_tensors(cfg, layer))


@torch.no_grad()
def time_block(model: K2Model, device: torch.device, tokens: list[int], context: int) -> dict:
    """Seconds per forward of a one-block model's block at each token count (no cache), and per decode step over
    ``context`` cached tokens, through ``run_blocks`` (which also makes the rotary table and mask that a whole forward
    makes once for all its blocks)."""
    width = model.config.hidden_size
    out = {}
    for T in tokens:
        x = torch.randn(1, T, width, dtype=torch.bfloat16, device=device)
        out[T] = seconds(lambda x=x: model.run_blocks(x), device)
    cache = model.new_cache(1, capacity=context + 1)
    model.run_blocks(torch.randn(1, context, width, dtype=torch.bfloat16, device=device), cache=cache)
    step = torch.randn(1, 1, width, dtype=torch.bfloat16, device=device)

    def decode():  # cropped back after each step, so that every timed step attends over the same context
        model.run_blocks(step, cache=cache)
        cache.crop(context)

    out["decode"] = seconds(decode, device)
    return out


def decode_bytes(cfg: K2Config, fmt: FP8Format, layer: int, context: int) -> int:
    """FP8 bytes one decode step must read in a block: all but the unchosen experts, and the latent cache."""
    specs = layer_tensors(cfg, layer)
    chosen = cfg.num_experts_per_tok / cfg.n_routed_experts
    weights = sum(fmt.tensor_bytes(s, scales=True) * (chosen if s.component == "routed_experts" else 1) for s in specs)
    return int(weights) + context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2


def active_flops(cfg: K2Config, layer: int, tokens: int) -> float:
    """2 * active parameters * tokens (matmuls only; attention's score FLOPs left out)."""
    chosen = cfg.num_experts_per_tok / cfg.n_routed_experts
    active = sum(s.numel * (chosen if s.component == "routed_experts" else 1) for s in layer_tensors(cfg, layer))
    return 2 * active * tokens


@torch.no_grad()
def device_map_check(device: torch.device) -> str:
    """A mini FP8 checkpoint, loaded split across the CPU and ``device``, against the CPU alone."""
    cfg = K2Config.mini().replace(vocab_size=1024)
    source = random_state(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    lines = []
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(folder, cfg, lambda spec: source[spec.name], num_shards=2)
        reference = k2lab.load(folder, dtype=torch.float32)
        expected, tokens = reference(ids), k2lab.generate(reference, ids[:1], 8)
        split = {"": "cpu", "layers.1": device, "layers.3": device, "norm": device, "lm_head": device}
        for label, kwargs in [("split CPU/GPU", {"device_map": split}),
                              ("split, streamed experts", {"device_map": split, "expert_budget_bytes": 2**20}),
                              ("auto", {"device_map": "auto"})]:
            model = k2lab.load(folder, dtype=torch.float32, **kwargs)
            got = model(ids)
            error = ((got.cpu() - expected).abs().max() / expected.abs().max()).item()
            same = torch.equal(k2lab.generate(model, ids[:1], 8).cpu(), tokens)
            fp8 = sum(isinstance(m, FP8Linear | FP8RoutedExperts) for m in model.modules())
            lines.append(f"  {label:<24} rel. error {error:.1e}, greedy tokens equal: {same}, "
                         f"{fp8} FP8-resident modules")
    return "\n".join(lines)


def random_state(cfg: K2Config) -> dict[str, torch.Tensor]:
    """Random float32 weights of a K2Model in checkpoint names (per-expert), for the device_map check."""
    model = k2lab.K2Model(cfg)
    model.init_weights(std=0.1, seed=0)
    out = {}
    for name, tensor in model.state_dict().items():
        full = name if name.startswith("lm_head") else f"model.{name}"
        if ".mlp.experts." in name:
            layer, proj = name.split(".")[1], name.rsplit(".", 1)[1]
            for e, expert in enumerate(tensor):
                out[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = expert
        else:
            out[full] = tensor
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024, 4096])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--smoke", action="store_true", help="run at mini size on the CPU (checks the script)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing to measure here. Run it on a GPU machine: "
              "python -m benchmarks.gpu_check (or --smoke to exercise the script on the CPU at mini size).")
        return
    device = torch.device("cpu" if args.smoke else "cuda:0")
    cfg = K2Config.mini() if args.smoke else K2Config.kimi_k2()
    fmt = FP8Format(block=(32, 32) if args.smoke else (128, 128))
    tokens = [1, 16, 64] if args.smoke else args.tokens
    context = 64 if args.smoke else args.context
    torch.manual_seed(0)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run)"
    bandwidth, matmul = machine_limits(device, 2**30 if device.type == "cuda" else 2**26)
    print(f"{name}: copy bandwidth {bandwidth / GB:,.0f} GB/s, bf16 matmul {matmul / 1e12:,.1f} TFLOP/s")

    results = {}
    for label, moe in (("dense block 0", False), ("MoE block", True)):
        single = one_block(cfg, moe)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        block = random_fp8_block(single, fmt, 0, device)
        if device.type == "cuda":
            held = torch.cuda.memory_allocated(device) - before
            print(f"{label}: FP8-resident {held / GB:.3f} GB on the GPU; accounting.py predicts "
                  f"{block_bytes(single, fmt, 0) / GB:.3f} GB")
        results[label] = time_block(holding(block, single), device, tokens, context)
        if moe:
            del block  # make room for the bfloat16 copy
            block = dequantized_copy(random_fp8_block(single, fmt, 0, device), single)
            results["MoE block, bf16"] = time_block(holding(block, single), device, tokens, context)
        del block

    print(f"\nseconds per block (prefill of T tokens, no cache; decode: 1 token over {context:,} cached)")
    print(f"{'':<18}" + "".join(f"{'T=' + str(T):>11}" for T in tokens) + f"{'decode':>11}")
    for label, times in results.items():
        print(f"{label:<18}" + "".join(f"{times[T]:>11.5f}" for T in [*tokens, "decode"]))
    moe, dense, bf16 = results["MoE block"], results["dense block 0"], results["MoE block, bf16"]
    print("\ndequantizing per use costs (FP8 / bf16 time of the MoE block): "
          + ", ".join(f"T={T}: {moe[T] / bf16[T]:.2f}x" for T in [*tokens, "decode"]))
    blocks = cfg.num_hidden_layers - cfg.first_k_dense_replace
    for T in tokens:
        total = dense[T] * cfg.first_k_dense_replace + moe[T] * blocks
        rate = active_flops(cfg, cfg.first_k_dense_replace, T) / moe[T]
        print(f"prefill T={T:>5}: {T / total:>10,.1f} tokens/s for {cfg.num_hidden_layers} blocks; MoE block at "
              f"{rate / matmul:.1%} of the bf16 matmul rate")
    step = dense["decode"] * cfg.first_k_dense_replace + moe["decode"] * blocks
    moved = decode_bytes(cfg, fmt, cfg.first_k_dense_replace, context) / moe["decode"]
    print(f"decode: {1 / step:,.1f} tokens/s for {cfg.num_hidden_layers} blocks; the MoE block reads its FP8 "
          f"bytes at {moved / GB:,.0f} GB/s = {moved / bandwidth:.1%} of the copy bandwidth")
    print("\ndevice_map (a mini FP8 checkpoint against the CPU alone):")
    print(device_map_check(device))


if __name__ == "__main__":
    main()
