"""K2-nano, the lab's bundled model: a small K2 trained by ``python -m k2lab.training --preset nano`` on the
Python standard library, stored in ``k2lab/lab/assets/nano`` in the release layout (config.json, FP8 safetensors with
per-expert names, the tokenizer files, the training log) and read by the same loader as the real K2."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import torch

from ..model.transformer import K2Model
from ..tokenizer.tokenizer import K2Tokenizer, load_tokenizer
from ..weights.load import load
from ..weights.quant.fp8 import FP8Linear, FP8RoutedExperts
from ..weights.streaming import StreamedExperts
from ..weights.writer import write_checkpoint

# Package data: found through importlib.resources, so an installed wheel carries it as an editable checkout does.
# The checkpoint and its tokenizer share one folder, as in the release.
NANO_DIR = Path(str(resources.files("k2lab.lab") / "assets" / "nano"))
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")


def load_nano(dtype: torch.dtype = torch.float32) -> tuple[K2Model, K2Tokenizer]:
    """The bundled K2-nano and its tokenizer, offline. float32 by default: on a CPU it is the fast dtype."""
    if not (NANO_DIR / "config.json").is_file():
        raise FileNotFoundError(f"no K2-nano checkpoint in {NANO_DIR}; train one with python -m k2lab.training")
    return load(NANO_DIR, dtype=dtype).eval(), load_tokenizer(NANO_DIR)


def save_checkpoint(model: K2Model, folder: str | Path, *, fp8: bool = True) -> Path:
    """Write a model in the release layout (FP8 matrices when ``fp8``, per-expert tensor names). A model whose
    weights are not all in memory as plain tensors (streamed experts, FP8-resident matrices, meta tensors) is
    refused before anything is written; the write itself replaces ``folder`` only once complete."""
    _check_saveable(model)
    state = model.state_dict()

    def tensor(spec):
        expert = _EXPERT.fullmatch(spec.name)
        if expert:
            layer, index, proj = expert.groups()
            return state[f"layers.{layer}.mlp.experts.{proj}"][int(index)]
        return state[spec.name.removeprefix("model.")]

    cfg = model.config if not fp8 or model.config.fp8_block_size else model.config.replace(fp8_block_size=(128, 128))
    return write_checkpoint(folder, cfg, tensor, fp8=fp8)


def _check_saveable(model: K2Model) -> None:
    if not isinstance(model, K2Model):
        raise TypeError(f"model must be a K2Model, got {type(model).__name__}")
    held = {StreamedExperts: "its routed experts are streamed from the files (load without expert_budget_bytes)",
            FP8Linear: "it holds FP8-resident matrices (load with fp8_resident=False)",
            FP8RoutedExperts: "it holds FP8-resident experts (load with fp8_resident=False)"}
    for name, module in model.named_modules():
        if type(module) in held:
            raise ValueError(f"model cannot be saved: {held[type(module)]}; {name} is a {type(module).__name__}")
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            raise ValueError(f"model cannot be saved: {name} is on the meta device (it has no values)")
