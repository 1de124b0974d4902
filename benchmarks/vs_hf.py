"""Prefill and decode: k2lab against HF transformers' DeepseekV3 on the same random weights, float32, CPU,
and against the machine's own limits measured in the same run.

    python -m benchmarks.vs_hf [--prefill 512] [--contexts 512 4096] [--rounds 5]

- prefill: one forward over the prompt; fraction of the measured matmul rate from the active FLOPs.
- decode: one new token through each side's cache at a given context (k2lab's latent cache vs HF's
  ``past_key_values``), cropped back after every step so each timed step sees the same context. HF expands
  the cached latents for the whole context every step; k2lab's absorbed path attends over them directly.
- roofline: a decode step must read the active weights (attention, dense/shared/router, k experts per MoE
  layer, the head) and the cache; divided by the measured copy bandwidth that is the fastest possible step.
- GEMV ceiling: the same matrices read by bare matrix-vector products, one call each and no model logic around
  them, timed in the same run: the fastest an eager implementation of the step can be on this CPU.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import warnings

import torch
import torch.nn.functional as F

import k2lab
from k2lab import K2Config
from k2lab.weights.schema import checkpoint_tensors

from .timing import alternate, copy_bandwidth, matmul_rate

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


def bare_gemv_seconds(shapes: list[tuple[int, int]], rounds: int) -> float:
    """Median seconds to multiply one vector by each of fresh matrices of these shapes, one call per matrix."""
    gen = torch.Generator().manual_seed(0)
    matrices = [torch.randn(shape, generator=gen) for shape in shapes]
    vectors = {cols: torch.randn(1, cols, generator=gen) for _, cols in shapes}
    return alternate({"gemv": lambda: [F.linear(vectors[w.shape[1]], w) for w in matrices]}, rounds=rounds)["gemv"]


def gemv_read_rates(shapes: list[tuple[int, int]], rounds: int, copies_bytes: int = 100 << 20
                    ) -> dict[tuple[int, int], float]:
    """Bytes/s a one-vector product reads for each distinct shape, over enough fresh copies (about
    ``copies_bytes``) that the matrices come from memory, not from the CPU's caches."""
    rates = {}
    for shape in sorted(set(shapes)):
        nbytes = 4 * shape[0] * shape[1]
        count = max(1, copies_bytes // nbytes)
        rates[shape] = count * nbytes / bare_gemv_seconds([shape] * count, rounds)
    return rates


def prefill_flops(cfg: K2Config, tokens: int) -> float:
    """Matmul FLOPs of a prefill: 2 * active matrix parameters per token, plus causal attention (naive path)."""
    count = k2lab.count_parameters(cfg)
    matrices = count.active - count.components["embedding"] - count.components["norms"]
    heads = cfg.num_attention_heads * cfg.num_hidden_layers
    attention = 2 * heads * tokens * tokens / 2 * (cfg.qk_head_dim + cfg.v_head_dim)
    return 2 * matrices * tokens + attention


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    cfg = BENCH
    ref, ours = build_pair(cfg)
    gen = torch.Generator().manual_seed(0)
    print(
        f"config: {cfg.num_hidden_layers} layers, {cfg.hidden_size} wide, {cfg.n_routed_experts} experts "
        f"top-{cfg.num_experts_per_tok}, float32, {torch.get_num_threads()} threads"
    )

    ids = torch.randint(0, cfg.vocab_size, (1, args.prefill), generator=gen)
    t = alternate(
        {
            "hf": lambda: ref(ids, use_cache=False),
            "naive": lambda: ours(ids, attn_impl="naive"),
            "absorbed": lambda: ours(ids, attn_impl="absorbed"),
        },
        rounds=args.rounds,
    )
    rate = matmul_rate()
    flops = prefill_flops(cfg, args.prefill)
    print(
        f"\nprefill {args.prefill} tokens (median s): HF {t['hf']:.3f}  k2lab naive {t['naive']:.3f}  "
        f"absorbed {t['absorbed']:.3f}"
    )
    best = min(t["naive"], t["absorbed"])
    print(
        f"  speed vs HF: naive {t['hf'] / t['naive']:.2f}x, absorbed {t['hf'] / t['absorbed']:.2f}x; "
        f"k2lab best at {flops / best / 1e9:.1f} GFLOP/s = {flops / best / rate:.0%} of the measured "
        f"{rate / 1e9:.1f} GFLOP/s matmul rate"
    )

    bandwidth = copy_bandwidth()
    print(f"\nmeasured copy bandwidth: {bandwidth / 1e9:.1f} GB/s")
    rates = gemv_read_rates(decode_matrices(cfg, context=0)[: -cfg.num_hidden_layers], rounds=args.rounds)
    print("GEMV read rate by weight shape: " + ", ".join(f"{list(shape)} {rate / 1e9:.1f} GB/s"
                                                        for shape, rate in rates.items()))
    for context in args.contexts:
        t = decode_times(ref, ours, context, rounds=max(args.rounds, 9), generator=gen)
        floor = decode_bytes(cfg, context) / bandwidth
        print(
            f"decode at {context} context (median ms/token): HF {t['hf'] * 1e3:.2f}  k2lab naive "
            f"{t['naive'] * 1e3:.2f}  absorbed {t['absorbed'] * 1e3:.2f}"
        )
        gemv = bare_gemv_seconds(decode_matrices(cfg, context), rounds=max(args.rounds, 9))
        print(
            f"  speed vs HF: naive {t['hf'] / t['naive']:.2f}x, absorbed {t['hf'] / t['absorbed']:.2f}x; "
            f"absorbed at {floor / t['absorbed']:.0%} of the bandwidth roofline "
            f"({decode_bytes(cfg, context) / 1e6:.1f} MB per step, floor {floor * 1e3:.2f} ms)"
        )
        print(
            f"  bare GEMVs over the same matrices: {gemv * 1e3:.2f} ms = {floor / gemv:.0%} of the roofline; "
            f"k2lab absorbed at {gemv / t['absorbed']:.0%} of this eager ceiling"
        )


def decode_times(ref, ours, context: int, rounds: int, generator: torch.Generator) -> dict[str, float]:
    """Median seconds of one decode step at ``context`` cached tokens: HF, k2lab naive, k2lab absorbed."""
    vocab = ours.config.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=generator)
    step = torch.randint(0, vocab, (1, 1), generator=generator)
    hf_cache = ref(prompt, use_cache=True).past_key_values
    caches = {impl: ours.new_cache(1) for impl in ("naive", "absorbed")}
    for cache in caches.values():
        ours(prompt, cache=cache)

    def hf_step():
        ref(step, past_key_values=hf_cache, use_cache=True)
        hf_cache.crop(-1)  # transformers 5: a negative count of tokens to remove

    def our_step(impl):
        ours(step, cache=caches[impl], attn_impl=impl)
        caches[impl].crop(context)

    runs = {"hf": hf_step, "naive": lambda: our_step("naive"), "absorbed": lambda: our_step("absorbed")}
    return alternate(runs, rounds=rounds)


if __name__ == "__main__":
    main()
