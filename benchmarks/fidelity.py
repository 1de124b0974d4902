"""Worst relative logit error of k2lab against HF transformers' DeepseekV3 (float32, eager), both attention
paths and the latent-cache decode, over the eight configs of tests/model/test_fidelity.py (which asserts < 1e-4).

    python -m benchmarks.fidelity
"""

from __future__ import annotations

import math
import sys
import tempfile
import warnings
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "model")]  # tests/: the helper modules; tests/model/: test_fidelity
from hf_oracle import hf_model, relative_error, save_and_load  # noqa: E402
from test_fidelity import CONFIGS  # noqa: E402  (the tests' configs, one source of truth)


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
