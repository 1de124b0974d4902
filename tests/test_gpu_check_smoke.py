"""``python -m benchmarks.gpu_check --smoke`` runs every code path of the GPU check on the CPU at mini size (FP8
products against dequantise-then-matmul, eager and compiled block steps, the bfloat16 copy, K2-nano's generate, the
targets' table, device_map), so that the one run a lent GPU gets is not spent on a typo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # compiles three block steps and K2-nano's decode step: a minute or two
def test_gpu_check_smoke_runs_every_section_on_the_cpu():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--smoke"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "one-pass dequantization equals the exact one bit for bit: True" in out
    assert "block-scaled product not run here (CUDA only)" in out and "e4m3 activations" in out
    for row in ("dense block 0 ", "MoE block ", "MoE block, bf16 "):
        assert f"\n{row}" in out  # each block timed, eager and compiled
    assert "compiled step:" in out and "K2-nano generate, 8 tokens:" in out
    assert "issue 42's targets" in out and "dense block 0, T=1 decode, compiled (ms)" in out
    assert out.count("greedy tokens equal: True") == 3
