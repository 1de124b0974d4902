"""Write one true-size K2 MoE layer with random FP8 weights in the release layout, for real_shape_layer.py.

    python -m benchmarks.write_real_shape_layer [--folder /tmp/k2lab-real-shape-layer]

The slice is K2's config with a single block, a MoE one: MLA at true size (7168 wide, 64 heads, latents 1536 and
512), the router, 384 routed experts of 2048 and the shared expert, with the true 163,840-token embedding and
head. About 22 GB on disk in three shards (embedding; the block, 17 GB of it e4m3 experts; norm and head).

A shard is never in memory: the writer asks for one tensor at a time. The e4m3 values of each matrix are a slice,
at a random offset, of one pool of quantized N(0, 1) draws, with per-block scales that make the weights
N(0, 1/fan_in): random enough for routing and timing, and fast to make on a CPU.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch

from k2lab import K2Config
from k2lab.analysis.accounting import weight_bytes
from k2lab.weights.quant.fp8 import FP8, FP8_MAX, FP8Format, scale_shape
from k2lab.weights.reader import INDEX_FILE
from k2lab.weights.schema import TensorSpec
from k2lab.weights.writer import write_checkpoint

CONFIG = K2Config.kimi_k2().replace(num_hidden_layers=1, first_k_dense_replace=0)
DEFAULT_FOLDER = Path(tempfile.gettempdir()) / "k2lab-real-shape-layer"
POOL_SIZE = 2**26  # e4m3 values to slice matrices from: more than o_proj's 58.7 M
SIGMA = FP8_MAX / 4.5  # pool spread: a 128x128 block's largest |N(0,1)| (~4.3) lands just under 448


class RandomRelease:
    """``source(spec)`` for write_checkpoint: random tensors in the release's formats."""

    def __init__(self, cfg: K2Config, seed: int = 0):
        self.cfg, self.gen = cfg, torch.Generator().manual_seed(seed)
        self.pool = (torch.randn(POOL_SIZE, generator=self.gen) * SIGMA).clamp(-FP8_MAX, FP8_MAX).to(FP8)

    def __call__(self, spec: TensorSpec) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if spec.quantizable:  # the release stores every quantizable matrix in FP8
            start = torch.randint(0, POOL_SIZE - spec.numel, (), generator=self.gen).item()
            values = self.pool[start : start + spec.numel].view(spec.shape)
            jitter = 1 + 0.1 * (torch.rand(scale_shape(spec.shape, FP8Format().block), generator=self.gen) - 0.5)
            return values, jitter / (SIGMA * math.sqrt(spec.shape[1]))
        if spec.component == "norms" or spec.name.endswith("layernorm.weight"):
            return torch.ones(spec.shape)
        if spec.name.endswith("e_score_correction_bias"):
            return 0.01 * torch.randn(spec.shape, generator=self.gen)
        # Unit-scale embeddings; a router spread wide enough that top-8 has no near-ties; 1/sqrt(fan_in) otherwise.
        fan_in = spec.shape[1]
        std = {"embedding": 1.0, "router": 3 / math.sqrt(fan_in)}.get(spec.component, 1 / math.sqrt(fan_in))
        return torch.randn(spec.shape, generator=self.gen, dtype=torch.bfloat16).mul_(std)


def write(folder: Path = DEFAULT_FOLDER) -> Path:
    """Write the slice into ``folder`` (refusing if the disk lacks room); the index is written last, so a folder
    with an index is complete."""
    need = weight_bytes(CONFIG, format="fp8", scales=True)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < need * 1.05:
        raise SystemExit(f"{folder}: {free / 1e9:.1f} GB free, the slice needs {need / 1e9:.1f} GB")
    (folder / INDEX_FILE).unlink(missing_ok=True)
    start = time.perf_counter()
    print(f"writing {need / 1e9:.1f} GB of random K2 weights (one true-size MoE block) to {folder} ...")
    write_checkpoint(folder, CONFIG, RandomRelease(CONFIG), num_shards=3, progress=True)
    print(f"done in {time.perf_counter() - start:.0f} s")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", type=Path, default=DEFAULT_FOLDER)
    write(parser.parse_args().folder)


if __name__ == "__main__":
    main()
