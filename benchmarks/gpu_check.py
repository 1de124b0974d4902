"""GPU check: K2 blocks at true size with random FP8 weights made on the GPU (no checkpoint, no download).

    python -m benchmarks.gpu_check [--tokens 1 16 128 1024 4096] [--context 4096]
    python -m benchmarks.gpu_check --smoke      # every code path on the CPU at mini size: checks the script itself

Without a GPU (and without --smoke) it says so and exits with status 0. On one GPU it reports:
- the machine: device-to-device copy bandwidth and the bfloat16 matmul rate, measured here;
- memory: K2's dense block 0 and one MoE block (384 experts of 2048) held FP8-resident, against the bytes
  accounting.py predicts;
- FP8 products against dequantise-then-matmul on one expert matrix [2048, 7168]: the one-pass dequantization
  (fused_dequant.py) and the block-scaled ``torch._scaled_mm`` (fp8_matmul.py; Hopper only) against the exact path
  and the recipe's float32 emulation, and the time of each product at T=1 and T=4,096;
- time per block with the default attention path ("auto": naive for a prefill without a cache, absorbed for a
  decode step) at several token counts (prefill, no cache) and for one decode step over a latent cache of
  --context tokens, eager and compiled (``fullgraph=True``; a CUDA graph, ``mode="reduce-overhead"``); the same MoE
  block with every weight in bfloat16 (34 GB) against FP8; prefill and decode tokens/s of the 61-block model
  extrapolated from them (1 dense + 60 MoE blocks; embedding, head and transfers between GPUs left out);
- fractions of the machine: a decode step's FP8 bytes over the copy bandwidth, prefill FLOPs over the matmul rate;
- host syncs: a decode step of each block under ``torch.cuda.set_sync_debug_mode("error")``;
- K2-nano's ``generate`` of 64 tokens, eager and compiled, in tokens/s;
- the targets of issue 42 beside the figures, in one table;
- device_map: a small FP8 checkpoint split between CPU and GPU (FP8-resident there, also with streamed
  experts) gives the CPU's logits and greedy tokens.
Expected to take a few minutes on an H200, most of it compiling.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import k2lab
from k2lab import K2Config, K2Model
from k2lab.model.inputs import prepare_inputs
from k2lab.model.layers import RMSNorm
from k2lab.model.moe import RoutedExperts, Router
from k2lab.model.transformer import DecoderLayer
from k2lab.weights.quant import fp8, fused_dequant
from k2lab.weights.quant.fp8 import FP8Format, FP8Linear, FP8RoutedExperts
from k2lab.weights.quant.fp8_matmul import blockwise_applies, blockwise_linear, blockwise_unsupported, emulate_blockwise
from k2lab.weights.schema import EXPERT_PROJS, layer_tensors
from k2lab.weights.writer import write_checkpoint

GB = 1e9
NANO_TOKENS = 64  # K2-nano's generate: new tokens per timed call


def seconds(fn, device: torch.device, rounds: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn`` after ``warmup`` calls (a CUDA graph records on its second), synchronising the GPU
    around each call."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
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
    ``context`` cached tokens, eager ("decode") and compiled ("compiled"), through ``blocks`` (which also makes the
    rotary rows and mask that a whole forward makes once for all its blocks). Also whether the eager decode step ran
    without a host sync ("sync": "" or the error)."""
    width = model.config.hidden_size
    out = {}
    for T in tokens:
        x = torch.randn(1, T, width, dtype=torch.bfloat16, device=device)
        out[T] = seconds(lambda x=x: blocks(model, x), device)
    cache, step = prefilled(model, device, context)

    def decode(run=blocks):  # cropped back after each step: every timed step sees the same context
        run(model, step, cache)
        cache.crop(context)

    out["decode"] = seconds(decode, device)
    out["sync"] = without_host_sync(decode, device)
    out["compiled"] = seconds(compiled_decode(model, cache, device, decode), device, warmup=3)
    torch._dynamo.reset()  # the next block compiles afresh, and the CUDA graph's memory pool goes
    return out


def prefilled(model: K2Model, device: torch.device, context: int) -> tuple:
    """A cache holding ``context`` random positions (storage for one more) and a decode step's input [1, 1, D]."""
    width = model.config.hidden_size
    cache = model.new_cache(1, capacity=context + 1)
    blocks(model, torch.randn(1, context, width, dtype=torch.bfloat16, device=device), cache)
    return cache, torch.randn(1, 1, width, dtype=torch.bfloat16, device=device)


def blocks(model: K2Model, x: torch.Tensor, cache=None) -> torch.Tensor:
    """The residual x [B, T, D] through the model's blocks as a forward of T tokens runs them: its inputs (positions,
    rotary rows, mask; ``prepare_inputs``) made for T tokens after the cache, then ``run_blocks``."""
    inputs = prepare_inputs(model, torch.zeros(x.shape[:2], dtype=torch.long), cache=cache, device=x.device)
    return model.run_blocks(x, inputs, cache)


def compiled_decode(model: K2Model, cache, device: torch.device, decode) -> Callable[[], None]:
    """``decode`` with the blocks compiled whole (``fullgraph=True``); on CUDA captured as a CUDA graph over the
    cache's storage, which the step writes in place (every step sees the same context, so one graph replays)."""
    for buffer in cache.storage:
        torch._dynamo.mark_static_address(buffer)
    mode = "reduce-overhead" if device.type == "cuda" else None
    compiled = torch.compile(blocks, fullgraph=True, mode=mode)

    def step():
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        decode(compiled)

    return step


def without_host_sync(fn, device: torch.device) -> str:
    """"" if ``fn`` ran with no host sync (CUDA's sync debug mode set to raise), else the error; on the CPU, where
    there is no device to wait for, the call just runs."""
    if device.type != "cuda":
        fn()
        return ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return ""
    except RuntimeError as err:
        return (str(err).strip().splitlines() or ["RuntimeError"])[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")


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


@torch.no_grad()
def fp8_products_check(device: torch.device, rows: int, cols: int, tokens: list[int]) -> list[str]:
    """One expert matrix [rows, cols] in e4m3 (128x128 blocks): the one-pass dequantization (fused_dequant.py) against
    the exact one, the block-scaled product (fp8_matmul.py) against its float32 emulation and against
    dequantise-then-matmul, and the time of each way of multiplying T tokens by it."""
    gen = torch.Generator(device=device).manual_seed(1)
    fmt = FP8Format((128, 128))
    values, scale = fmt.quantize("weight", torch.randn(rows, cols, device=device, generator=gen) / math.sqrt(cols))
    exact = fp8.dequantize(values, scale, fmt.block, torch.bfloat16)  # eager: float32 copy, scale, round
    fused = fused_dequant.run_compiled(fp8.dequantize, values, scale, fmt.block, torch.bfloat16)
    lines = [f"  one-pass dequantization equals the exact one bit for bit: {torch.equal(fused, exact)}"]
    x = torch.randn(max(tokens), cols, device=device, generator=gen).bfloat16()
    reference = F.linear(x.float(), exact.float())  # dequantise-then-matmul, in float32
    emulated = emulate_blockwise(x, fp8.dequantize(values, scale, fmt.block, torch.float32))

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.float() - want).norm() / want.norm()).item()

    ways = {"bf16 matmul": lambda h: F.linear(h, exact),
            "dequantise, then matmul": lambda h: F.linear(h, fp8.dequantize(values, scale, fmt.block, h.dtype)),
            "one-pass dequantise, then matmul":
                lambda h: F.linear(h, fused_dequant.run_compiled(fp8.dequantize, values, scale, fmt.block, h.dtype))}
    lines.append(f"  bf16 operands against float32: relative error {error(F.linear(x, exact), reference):.1e}")
    if blockwise_applies(x, values, fmt.block):
        got = blockwise_linear(x, values, scale)
        lines.append(f"  block-scaled torch._scaled_mm: relative error {error(got, emulated):.1e} against the recipe "
                     f"emulated in float32 (bf16 rounding: <= 4e-3), {error(got, reference):.1e} against "
                     "dequantise-then-matmul (e4m3 activations)")
        ways["block-scaled FP8 (torch._scaled_mm)"] = lambda h: blockwise_linear(h, values, scale)
    else:
        why = blockwise_unsupported(device.index or 0) if device.type == "cuda" else "CUDA only"
        lines.append(f"  block-scaled product not run here ({why}); its recipe, emulated in float32, is "
                     f"{error(emulated, reference):.1e} from dequantise-then-matmul (e4m3 activations)")
    lines.append(f"  microseconds per product [{rows}, {cols}]: " + "; ".join(
        f"{name}: " + ", ".join(f"T={T} {seconds(lambda w=way, T=T: w(x[:T]), device) * 1e6:,.0f}" for T in tokens)
        for name, way in ways.items()))
    return lines


@torch.no_grad()
def nano_generate(device: torch.device, new_tokens: int) -> dict[str, float]:
    """K2-nano's ``generate`` of ``new_tokens`` (no early stop) in tokens/s, eager and compiled (compiled once, untimed,
    then timed on the same shapes)."""
    model, tok = k2lab.load_nano()
    model.to(device)
    ids = torch.tensor([tok.encode("def area(r):\n    return 3.14 * r * r\n")], device=device)
    rates = {}
    for label, compile in (("eager", False), ("compiled", True)):
        def run(compile=compile):
            return k2lab.generate(model, ids, new_tokens, stop_at_eos=False, compile=compile)
        rates[label] = new_tokens / seconds(run, device, rounds=3)
    torch._dynamo.reset()
    return rates


def target_table(rows: list[tuple[str, str, str, bool | None]]) -> str:
    """Rows (figure, measured, target, met: True / False / None for no target) as one aligned table."""
    width = max(len(r[0]) for r in rows)
    mark = {True: "met", False: "NOT met", None: ""}
    return "\n".join(f"  {name:<{width}}  {got:>22}  {target:>12}  {mark[met]}" for name, got, target, met in rows)


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
    # The speed targets are measured with FP8 products on (DeepSeek-V3's serving arithmetic; off by default).
    FP8Linear.fp8_products = FP8RoutedExperts.fp8_products = True
    print("FP8 products on: FP8Linear.fp8_products = FP8RoutedExperts.fp8_products = True (off by default)")

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run)"
    bandwidth, matmul = machine_limits(device, 2**30 if device.type == "cuda" else 2**26)
    print(f"{name}: copy bandwidth {bandwidth / GB:,.0f} GB/s, bf16 matmul {matmul / 1e12:,.1f} TFLOP/s")

    expert = (256, 512) if args.smoke else (cfg.moe_intermediate_size, cfg.hidden_size)
    print(f"\nFP8 products of one expert matrix {list(expert)} against dequantise-then-matmul:")
    print("\n".join(fp8_products_check(device, *expert, [1, 64] if args.smoke else [1, 4096])))

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

    print(f"\nseconds per block (prefill of T tokens, no cache; decode: 1 token over {context:,} cached, eager and "
          "compiled)")
    columns = [*tokens, "decode", "compiled"]
    print(f"{'':<18}" + "".join(f"{'T=' + str(T) if isinstance(T, int) else T:>11}" for T in columns))
    for label, times in results.items():
        print(f"{label:<18}" + "".join(f"{times[T]:>11.5f}" for T in columns))
    for label, times in results.items():
        print(f"host syncs in {label}'s eager decode step: " + (f"one at least ({times['sync']})" if times["sync"]
                                                               else "none" if device.type == "cuda" else "(CUDA only)"))
    moe, dense, bf16 = results["MoE block"], results["dense block 0"], results["MoE block, bf16"]
    print("\nFP8 / bf16 time of the MoE block: "
          + ", ".join(f"{T if isinstance(T, str) else 'T=' + str(T)}: {moe[T] / bf16[T]:.2f}x" for T in columns))
    blocks = cfg.num_hidden_layers - cfg.first_k_dense_replace
    for T in tokens:
        total = dense[T] * cfg.first_k_dense_replace + moe[T] * blocks
        rate = active_flops(cfg, cfg.first_k_dense_replace, T) / moe[T]
        print(f"prefill T={T:>5}: {T / total:>10,.1f} tokens/s for {cfg.num_hidden_layers} blocks; MoE block at "
              f"{rate / matmul:.1%} of the bf16 matmul rate")
    step_bytes = decode_bytes(cfg, fmt, cfg.first_k_dense_replace, context)
    decode_rate, read_rate = {}, {}
    for way in ("decode", "compiled"):
        decode_rate[way] = 1 / (dense[way] * cfg.first_k_dense_replace + moe[way] * blocks)
        read_rate[way] = step_bytes / moe[way]
        print(f"{way} step: {decode_rate[way]:,.1f} tokens/s for {cfg.num_hidden_layers} blocks; the MoE block reads "
              f"its FP8 bytes at {read_rate[way] / GB:,.0f} GB/s = {read_rate[way] / bandwidth:.1%} of the copy "
              "bandwidth")

    nano = nano_generate(device, 8 if args.smoke else NANO_TOKENS)
    print(f"\nK2-nano generate, {8 if args.smoke else NANO_TOKENS} tokens: {nano['eager']:,.0f} tokens/s eager, "
          f"{nano['compiled']:,.0f} compiled")

    large = [T for T in tokens if T >= 1024]
    print("\nissue 42's targets (true size on one H200; a smoke run's figures mean nothing):")
    print(target_table([
        ("61-block decode, compiled (tokens/s)", f"{decode_rate['compiled']:,.1f}", ">= 20",
         decode_rate["compiled"] >= 20),
        ("61-block decode, eager (tokens/s)", f"{decode_rate['decode']:,.1f}", ">= 8", decode_rate["decode"] >= 8),
        ("MoE decode FP8 bytes / copy bandwidth, compiled", f"{read_rate['compiled'] / bandwidth:.1%}", ">= 15%",
         read_rate["compiled"] >= 0.15 * bandwidth),
        ("MoE block FP8 / bf16, decode (eager)", f"{moe['decode'] / bf16['decode']:.2f}x", "<= 1.3x",
         moe["decode"] <= 1.3 * bf16["decode"]),
        ("MoE block FP8 / bf16, decode (compiled)", f"{moe['compiled'] / bf16['compiled']:.2f}x", "<= 1.3x",
         moe["compiled"] <= 1.3 * bf16["compiled"]),
        *((f"MoE block FP8 / bf16, prefill T={T}", f"{moe[T] / bf16[T]:.2f}x", "<= 1.0x", moe[T] <= bf16[T])
          for T in large),
        ("dense block 0, T=1 decode, compiled (ms)", f"{dense['compiled'] * 1e3:.2f}", "<= 1.0",
         dense["compiled"] <= 1e-3),
        (f"K2-nano generate {NANO_TOKENS} tokens, compiled (tok/s)", f"{nano['compiled']:,.0f}", ">= 1,500",
         nano["compiled"] >= 1500),
        (f"K2-nano generate {NANO_TOKENS} tokens, eager (tok/s)", f"{nano['eager']:,.0f}", ">= 300",
         nano["eager"] >= 300),
        ("host syncs in a decode step (FP8 / bf16 MoE block)",
         "none" if not (moe["sync"] or bf16["sync"]) else "some", "none",
         None if device.type != "cuda" else not (moe["sync"] or bf16["sync"])),
    ]))
    print("\ndevice_map (a mini FP8 checkpoint against the CPU alone):")
    print(device_map_check(device))


if __name__ == "__main__":
    main()
