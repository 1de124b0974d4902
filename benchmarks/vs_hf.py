"""Prefill and decode: k2lab against HF transformers' DeepseekV3 on the same random weights, float32, CPU,
and against the machine's own limits measured in the same run, at one thread and at all cores.

    python -m benchmarks.vs_hf [--prefill 512] [--contexts 512 4096] [--rounds 7] [--decode-rounds N] [--threads 1 2]

Every figure is timed at each thread count within one process (torch.set_num_threads), the thread counts and
the contenders alternating round by round so that a busy, shared machine slows each alike; medians are
reported, and the load average is printed with them.

- prefill: one forward over the prompt with the default call ``model(ids)`` (attn_impl "auto"), and with each
  path forced; fraction of the measured matmul rate from the active FLOPs; and the default call's matrix
  products and fused attention calls replayed alone (``benchmarks.replay``): HF's time over theirs bounds the
  prefill ratio that trimming everything else could give.
- decode: one new token through each side's cache at a given context (k2lab's latent cache vs HF's
  ``past_key_values``), cropped back after every step so each timed step sees the same context. HF expands
  the cached latents for the whole context every step; k2lab's absorbed path attends over them directly. Every
  plain call here runs under no_grad, as HF's generate runs its steps; k2lab's then runs its blocks in inference
  mode once it has found that nothing observes the model (``K2Model.last_hidden_state``). Also k2lab's step as
  ``k2lab.generate`` runs it, inside inference mode (which skips that check), and as ``generate(compile=True)`` runs
  it: the model under ``torch.compile`` (compiled in the untimed first round at each thread count, its logits
  checked against the eager step's first).
- roofline: a decode step must read the active weights (attention, dense/shared/router, k experts per MoE
  layer, the head) and the cache; divided by the measured copy bandwidth that is the fastest possible step.
- GEMV ceiling: the same matrices read by bare matrix-vector products, one call each and no model logic around
  them, timed in the same run: what the step's weight reads alone cost. Timed both ways, F.linear and k2lab's
  ``linear`` (one block of weight rows per thread); the ceiling is the faster of the two.
- eager floor: the same step written out by hand with the fewest eager ops (``benchmarks.eager_floor``): the
  norms, rotations, softmax, routing and activations a step needs besides its GEMVs, at one dispatch each, with
  no probes or modules. No eager implementation of the step can be faster, so its share of the GEMV ceiling
  bounds what the model's can reach, and HF / floor bounds the decode ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

import k2lab
from k2lab import K2Config
from k2lab.model.linear import linear
from k2lab.weights.schema import checkpoint_tensors

from .eager_floor import check_supported, minimal_decode_step
from .replay import heavy_kernels
from .timing import alternate_threads, matmul_rate, tensor_copy, weight_reads

COPY_BYTES = 1 << 28  # the copy timed beside the prefill, for the bandwidth each thread count gets
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")

BENCH = K2Config.mini().replace(
    vocab_size=8192,
    hidden_size=768,
    intermediate_size=2048,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=64,
    num_experts_per_tok=8,
    max_position_embeddings=8192,
)


def build_pair(cfg: K2Config):
    """An HF model with random weights and k2lab's model loaded from its save_pretrained folder."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()  # the deprecation notice for past_key_values, once per step
    torch.manual_seed(0)
    ref = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg.to_hf(), attn_implementation="eager")).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():  # spread router logits so routing is not uniform noise
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 3 / cfg.hidden_size**0.5)
    with tempfile.TemporaryDirectory() as folder:
        ref.save_pretrained(folder)
        ours = k2lab.load(folder).eval()
    return ref, ours


def decode_bytes(cfg: K2Config, context: int, dtype_bytes: int = 4) -> int:
    """Bytes one decode step must read: the active weights plus the latent cache (one embedding row)."""
    total = 0
    for spec in checkpoint_tensors(cfg):
        if spec.component == "routed_experts":
            total += spec.numel * cfg.num_experts_per_tok // cfg.n_routed_experts
        elif spec.component == "embedding":
            total += cfg.hidden_size
        else:
            total += spec.numel
    return total * dtype_bytes + k2lab.kv_cache_bytes(cfg, context, dtype=torch.float32)


def decode_matrices(cfg: K2Config, context: int) -> list[tuple[int, int]]:
    """(rows, cols) of every matrix a decode step reads: the active weight matrices (the first k experts of
    each MoE layer stand in for the chosen ones; the embedding is a row lookup) and each layer's cache
    [context, C + R]."""
    def read(spec) -> bool:
        expert = _EXPERT_INDEX.search(spec.name)  # None for every tensor but a routed expert's
        return expert is None or int(expert[1]) < cfg.num_experts_per_tok

    shapes = [spec.shape for spec in checkpoint_tensors(cfg)
              if len(spec.shape) == 2 and spec.component != "embedding" and read(spec)]
    return shapes + [(context, cfg.kv_lora_rank + cfg.qk_rope_head_dim)] * cfg.num_hidden_layers


def prefill_flops(cfg: K2Config, tokens: int) -> float:
    """Matmul FLOPs of a prefill: 2 * active matrix parameters per token, plus causal attention (naive path)."""
    count = k2lab.count_parameters(cfg)
    matrices = count.active - count.components["embedding"] - count.components["norms"]
    heads = cfg.num_attention_heads * cfg.num_hidden_layers
    attention = 2 * heads * tokens * tokens / 2 * (cfg.qk_head_dim + cfg.v_head_dim)
    return 2 * matrices * tokens + attention


def decode_steps(ref, ours, context: int, generator: torch.Generator) -> dict[str, Callable[[], object]]:
    """One decode step at ``context`` cached tokens through each side's cache, cropped back after every step so
    each timed step sees the same context: HF, k2lab's default call (auto picks absorbed), k2lab naive, k2lab's
    default call inside inference mode (as ``k2lab.generate`` runs its steps; HF's generate runs under no_grad), the
    model compiled (as ``generate(compile=True)`` runs its steps), the same step hand-written with the fewest eager
    ops (``benchmarks.eager_floor``), and bare GEMVs over the step's matrices (F.linear, and k2lab's ``linear``). The
    compiled and hand-written steps are checked against the model's logits first."""
    vocab = ours.config.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=generator)
    step = torch.randint(0, vocab, (1, 1), generator=generator)
    hf_cache = ref(prompt, use_cache=True).past_key_values
    caches = {impl: ours.new_cache(1, capacity=context + 1) for impl in ("auto", "naive", "compiled")}
    for cache in caches.values():
        ours(prompt, cache=cache)

    def hf_step():
        ref(step, past_key_values=hf_cache, use_cache=True)
        hf_cache.crop(-1)  # transformers 5: a negative count of tokens to remove

    def our_step(impl: str, forward: Callable = ours, cache_key: str | None = None) -> torch.Tensor:
        cache = caches[cache_key or impl]  # each path its own cache, the compiled model too
        logits = forward(step, cache=cache, attn_impl=impl)
        cache.crop(context)
        return logits

    def generate_step():  # as k2lab.generate runs a step when nothing observes the model
        with torch.inference_mode():
            return our_step("auto")

    compiled = torch.compile(ours, dynamic=True)

    def compiled_step():  # as generate(compile=True) runs a step
        with torch.inference_mode():
            return our_step("auto", compiled, cache_key="compiled")

    token = int(step[0, 0])
    expected = our_step("auto")[0]  # [1, V]
    for name, logits in (("eager-floor", minimal_decode_step(ours, caches["auto"], token)),
                         ("compiled", compiled_step()[0])):
        if not torch.allclose(logits, expected, atol=1e-4, rtol=0):
            raise AssertionError(f"the {name} step's logits differ from the model's by "
                                 f"{(logits - expected).abs().max():.2e}: it no longer computes the same step")

    matrices = decode_matrices(ours.config, context)
    return {"hf": hf_step, "k2lab": lambda: our_step("auto"), "naive": lambda: our_step("naive"),
            "generate": generate_step, "compiled": compiled_step,
            "floor": lambda: minimal_decode_step(ours, caches["auto"], token),
            "gemv": weight_reads(F.linear, matrices)[0], "gemv split": weight_reads(linear, matrices)[0]}


def table(rows: list[tuple[str, str, list[str]]], threads: list[int]) -> str:
    """Rows of (figure, target, one cell per thread count) as an aligned text table (no target column when
    no row has a target)."""
    header = ("figure", "target", *(f"{n} thread{'s' * (n > 1)}" for n in threads))
    lines = [header, *((figure, target, *cells) for figure, target, cells in rows)]
    if not any(target for _, target, _ in rows):
        lines = [(line[0], *line[2:]) for line in lines]
    header = lines[0]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w)
                                in enumerate(zip(line, widths, strict=True))) for line in lines)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--decode-rounds", type=int, default=None,
                        help="rounds of the decode steps (default: --rounds, at least 9). A round of steps takes about "
                             "a second here, a round of prefills several: more decode rounds narrow the decode "
                             "medians for little time")
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}),
                        help="thread counts to compare (default: 1 and all cores)")
    args = parser.parse_args()
    decode_rounds = max(args.rounds, 9) if args.decode_rounds is None else args.decode_rounds
    if args.rounds < 1 or decode_rounds < 1:
        parser.error(f"--rounds and --decode-rounds must be at least 1, got {args.rounds} and {decode_rounds}")
    warnings.filterwarnings("ignore")
    threads = args.threads
    load_before = os.getloadavg()

    cfg = BENCH
    ref, ours = build_pair(cfg)
    check_supported(ours)
    gen = torch.Generator().manual_seed(0)
    print(f"config: {cfg.num_hidden_layers} layers, {cfg.hidden_size} wide, {cfg.n_routed_experts} experts "
          f"top-{cfg.num_experts_per_tok}, float32; threads {threads}; {args.rounds} rounds of prefill, "
          f"{decode_rounds} of decode steps, medians")

    ids = torch.randint(0, cfg.vocab_size, (1, args.prefill), generator=gen)
    kernels, _ = heavy_kernels(lambda: ours(ids))
    prefill = alternate_threads({
        "hf": lambda: ref(ids, use_cache=False),
        "k2lab": lambda: ours(ids),
        "kernels": kernels,
        "naive": lambda: ours(ids, attn_impl="naive"),
        "absorbed": lambda: ours(ids, attn_impl="absorbed"),
        "copy": tensor_copy(COPY_BYTES),
    }, threads, args.rounds)
    decode = {context: alternate_threads(decode_steps(ref, ours, context, gen), threads, decode_rounds)
              for context in args.contexts}
    for t in decode.values():  # the ceiling: the faster way to run the bare GEMVs
        t.update({("ceiling", n): min(t["gemv", n], t["gemv split", n]) for n in threads})
    rates = {}
    for n in threads:
        torch.set_num_threads(n)
        rates[n] = matmul_rate()
    load_after = os.getloadavg()

    def cells(fn, fmt: str) -> list[str]:
        return [format(fn(n), fmt) for n in threads]

    flops = prefill_flops(cfg, args.prefill)
    times = [(f"prefill {args.prefill}: HF / default / naive / absorbed / default's kernels alone (ms)", "",
              [" / ".join(f"{prefill[name, n] * 1e3:.0f}" for name in ("hf", "k2lab", "naive", "absorbed", "kernels"))
               for n in threads])]
    for context, t in decode.items():
        times.append((f"decode at {context}: HF / default / naive / default in inference mode / compiled / eager "
                      "floor / bare GEMVs, F.linear and split (ms)", "",
                      [" / ".join(f"{t[name, n] * 1e3:.1f}" for name in ("hf", "k2lab", "naive", "generate", "compiled",
                                                                        "floor", "gemv", "gemv split"))
                       for n in threads]))
    bandwidth = {n: 2 * COPY_BYTES / prefill["copy", n] for n in threads}
    for context in decode:
        times.append((f"decode at {context}: bytes read / copy bandwidth (ms floor)", "",
                      [f"{decode_bytes(cfg, context) / bandwidth[n] * 1e3:.1f}" for n in threads]))
    times.append(("copy bandwidth (GB/s) / float32 matmul rate (GFLOP/s)", "",
                  [f"{bandwidth[n] / 1e9:.1f} / {rates[n] / 1e9:.0f}" for n in threads]))
    print("\ntimes\n" + table(times, threads))

    rows = [(f"prefill {args.prefill}, default call, vs HF", ">= 1.2x",
             cells(lambda n: prefill["hf", n] / prefill["k2lab", n], ".2f")),
            (f"prefill {args.prefill}, default call, share of the matmul rate", "",
             cells(lambda n: flops / prefill["k2lab", n] / rates[n], ".0%")),
            (f"prefill {args.prefill}: its matmuls and attention kernels alone vs HF (the bound)", "",
             cells(lambda n: prefill["hf", n] / prefill["kernels", n], ".2f"))]
    targets = {512: ">= 2.0x", 4096: ">= 5x"}
    for context, t in decode.items():
        rows.append((f"decode at {context} context vs HF", targets.get(context, ""),
                     cells(lambda n, t=t: t["hf", n] / t["k2lab", n], ".2f")))
    for context, t in decode.items():  # each library's step as its generate runs it: k2lab's in inference mode
        rows.append((f"decode at {context} vs HF, k2lab's step as generate runs it (inference mode)", "",
                     cells(lambda n, t=t: t["hf", n] / t["generate", n], ".2f")))
    for context, t in decode.items():
        rows.append((f"decode at {context} vs HF, compiled step (generate(compile=True))", "",
                     cells(lambda n, t=t: t["hf", n] / t["compiled", n], ".2f")))
    for context, t in decode.items():
        rows.append((f"decode at {context}: bare-GEMV ceiling / k2lab step", ">= 80%",
                     cells(lambda n, t=t: t["ceiling", n] / t["k2lab", n], ".0%")))
        rows.append((f"decode at {context}: bare-GEMV ceiling / compiled step", "",
                     cells(lambda n, t=t: t["ceiling", n] / t["compiled", n], ".0%")))
    for context, t in decode.items():  # what no eager implementation of the step can beat on this machine
        rows.append((f"decode at {context}: bare-GEMV ceiling / eager-floor step", "",
                     cells(lambda n, t=t: t["ceiling", n] / t["floor", n], ".0%")))
        rows.append((f"decode at {context}: eager-floor step vs HF", "",
                     cells(lambda n, t=t: t["hf", n] / t["floor", n], ".2f")))
    first, last = args.contexts[0], args.contexts[-1]
    rows.append((f"decode step at {last} / at {first} context (flat in context)", "",
                 cells(lambda n: decode[last]["k2lab", n] / decode[first]["k2lab", n], ".2f")))
    rows.append((f"compiled step at {last} / at {first} context", "",
                 cells(lambda n: decode[last]["compiled", n] / decode[first]["compiled", n], ".2f")))
    print("\nratios\n" + table(rows, threads))

    if len(threads) > 1:
        one, most = threads[0], threads[-1]
        scaling = [(f"decode step at {c}, k2lab", "<= 0.8", f"{t['k2lab', most] / t['k2lab', one]:.2f}")
                   for c, t in decode.items()]
        scaling += [(f"decode at {c}, {how}", "", f"{t[name, most] / t[name, one]:.2f}") for c, t in decode.items()
                    for name, how in (("compiled", "compiled step"), ("floor", "eager floor"))]
        scaling += [(f"decode at {c}, bare GEMVs over the same matrices, {how}", "",
                     f"{t[name, most] / t[name, one]:.2f}") for c, t in decode.items()
                    for name, how in (("gemv", "F.linear"), ("gemv split", "split"))]
        scaling += [(f"prefill {args.prefill}, default call", "",
                     f"{prefill['k2lab', most] / prefill['k2lab', one]:.2f}"),
                    ("copy (memory bandwidth)", "", f"{prefill['copy', most] / prefill['copy', one]:.2f}")]
        width = max(len(f) for f, _, _ in scaling)
        print(f"\ntime at {most} threads / time at {one} (lower is better)")
        print("\n".join(f"{f.ljust(width)}  {target:>6}  {v:>5}" for f, target, v in scaling))
    print(f"\nload average (1, 5, 15 min) before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
