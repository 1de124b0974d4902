"""Worst relative logit error of k2lab against HF transformers' DeepseekV3 (float32, eager), both attention
paths and the latent-cache decode, over the tests' kinds of config (tests/test_fidelity.py asserts < 1e-4).

    python -m benchmarks.fidelity
"""

from __future__ import annotations

import math
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hf_oracle import hf_model, relative_error, save_and_load  # noqa: E402

from k2lab import K2Config  # noqa: E402

BASE = K2Config.mini().replace(vocab_size=512, num_hidden_layers=3)
CONFIGS = {
    "K2 switches": BASE,
    "grouped routing": BASE.replace(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4),
    "no q latent": BASE.replace(q_lora_rank=None),
    "3 dense layers": BASE.replace(num_hidden_layers=5, first_k_dense_replace=3),
    "YaRN x40, beta_fast 32": BASE.replace(rope_factor=40.0, beta_fast=32.0, rope_theta=10_000.0),
}


@torch.no_grad()
def main() -> None:
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    worst = 0.0
    for name, cfg in CONFIGS.items():
        ref = hf_model(cfg, seed=1)
        with tempfile.TemporaryDirectory() as folder:
            ours = save_and_load(ref, Path(folder))
        ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
        expected = ref(ids).logits
        errors = {impl: relative_error(ours(ids, attn_impl=impl), expected) for impl in ("naive", "absorbed")}
        cache = ours.new_cache(2)
        steps = [ours(ids[:, :32], cache=cache)] + [ours(ids[:, t : t + 1], cache=cache) for t in range(32, 64)]
        errors["cached decode"] = relative_error(torch.cat(steps, dim=1), expected)
        worst = max(worst, *errors.values())
        print(f"{name:24s} " + "  ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    print(f"worst relative error: {worst:.1e} (float32 epsilon {torch.finfo(torch.float32).eps:.1e}, "
          f"log10 ratio {math.log10(worst / torch.finfo(torch.float32).eps):.1f})")


if __name__ == "__main__":
    main()
