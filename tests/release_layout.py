"""Synthetic checkpoints in the K2 release layout for the loader's tests, with an independent oracle.

``write_release`` takes random HF DeepseekV3 weights, writes them as the release does (FP8 e4m3 blocks with
partial edges, per-expert names, four shards ``model-i-of-4`` and an index, a stale ``rotary_emb.inv_freq``), and
returns HF transformers loaded with the dequantized tensors, read back with the safetensors library and scaled
block by block in plain loops: nothing of k2lab's reading or dequantization enters the reference.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hf_oracle import hf_config, hf_model
from safetensors.torch import load_file, save_file
from tiny import token_ids  # noqa: F401  (the loader tests take it from here)

from k2lab import K2Config
from k2lab.weights.quant.fp8 import FP8Format
from k2lab.weights.writer import write_checkpoint

# Dimensions chosen so no matrix is a whole number of blocks, with non-square blocks so a transposed scale grid
# cannot pass: kv_a_proj_with_mqa has 40 + 16 = 56 rows = 32 + 24 (a partial row block), width 200 = 4*48 + 8.
TINY_FP8 = K2Config.mini().replace(
    vocab_size=384, hidden_size=200, intermediate_size=300, moe_intermediate_size=80, num_hidden_layers=4,
    q_lora_rank=72, kv_lora_rank=40, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=16,
    num_experts_per_tok=4,
)
TINY_FORMAT = FP8Format(block=(32, 48))
STALE = "model.layers.0.self_attn.rotary_emb.inv_freq"


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No transformers progress bars on stderr while the helpers save and load references."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


_written: dict[tuple[K2Config, int], Path] = {}


@pytest.fixture(autouse=True, scope="module")
def single_thread() -> Iterator[None]:
    """One intra-op thread while a module's tests run (import this fixture to apply it). Tiny tensors gain nothing
    from a second thread, and OpenMP's hand-offs made these tests 5x slower on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def release(tmp_path_factory, cfg: K2Config = TINY_FP8, seed: int = 0) -> Path:
    """The release folder for (cfg, seed), written once per test session and shared by the test modules."""
    if (cfg, seed) not in _written:
        folder = tmp_path_factory.mktemp("release")
        write_release(cfg, folder, seed)
        _written[cfg, seed] = folder
    return _written[cfg, seed]


def write_release(cfg: K2Config, folder: Path, seed: int = 0, num_shards: int = 4) -> None:
    """Random HF weights written as the release into ``folder``."""
    hf = hf_model(cfg, seed)
    with tempfile.TemporaryDirectory() as tmp, _quiet_transformers():
        hf.save_pretrained(tmp)  # per-expert names, as released
        tensors = {k: v for f in sorted(Path(tmp).glob("*.safetensors")) for k, v in load_file(f).items()}
    stale = {STALE: torch.arange(cfg.qk_rope_head_dim // 2, dtype=torch.float32)}
    write_checkpoint(folder, cfg, lambda spec: tensors[spec.name], num_shards=num_shards, format=TINY_FORMAT,
                     extra=stale)


def dequantized_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a release folder in float32, FP8 ones multiplied by their scales one block at a time."""
    block = json.loads((folder / "config.json").read_text())["quantization_config"]["weight_block_size"]
    stored = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    out = {}
    for name, tensor in stored.items():
        if name.endswith("_scale_inv") or "rotary_emb" in name:
            continue
        values = tensor.float()
        if tensor.dtype == torch.float8_e4m3fn:
            scale = stored[name + "_scale_inv"]
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    values[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= scale[i, j]
        out[name] = values
    return out


def hf_reference(cfg: K2Config, tensors: dict[str, torch.Tensor], num_layers: int | None = None):
    """HF DeepseekV3 (float32, eager) holding ``tensors``, optionally cut to its first ``num_layers`` blocks."""
    from transformers import DeepseekV3ForCausalLM

    if num_layers is not None:
        cfg = cfg.replace(num_hidden_layers=num_layers, first_k_dense_replace=min(cfg.first_k_dense_replace,
                                                                                  num_layers))
        tensors = {k: v for k, v in tensors.items()
                   if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    with tempfile.TemporaryDirectory() as tmp, _quiet_transformers():
        hf_config(cfg).save_pretrained(tmp)
        save_file(tensors, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        return DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()


def copy_release(folder: Path, to: Path) -> Path:
    """A copy to damage in one test without touching the shared one."""
    return Path(shutil.copytree(folder, to))

