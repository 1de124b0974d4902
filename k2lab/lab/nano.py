"""K2-nano, the lab's bundled model: a small K2 trained by ``python -m k2lab.training --preset nano`` on the
Python standard library, stored in ``k2lab/lab/assets/nano`` in the release layout (config.json, FP8 safetensors with
per-expert names, the tokenizer files, the training log) and read by the same loader as the real K2."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from ..model.transformer import K2Model
from ..tokenizer.tokenizer import K2Tokenizer
from ..weights.load import load
from ..weights.quant import QuantFormat
from ..weights.quant.base import QuantizedResident
from ..weights.schema import EXPERT_TENSOR
from ..weights.streaming import StreamedExperts
from ..weights.writer import write_checkpoint

# Package data: found through importlib.resources, so an installed wheel carries it as an editable checkout does.
# The checkpoint and its tokenizer share one folder, as in the release.
NANO_DIR = Path(str(resources.files("k2lab.lab") / "assets" / "nano"))


def load_nano(dtype: torch.dtype = torch.float32) -> tuple[K2Model, K2Tokenizer]:
    """The bundled K2-nano and its tokenizer (also attached as ``model.tokenizer``), offline. float32 by default: on a
    CPU it is the fast dtype."""
    if not (NANO_DIR / "config.json").is_file():
        raise FileNotFoundError(f"no K2-nano checkpoint in {NANO_DIR}; train one with python -m k2lab.training")
    model = load(NANO_DIR, dtype=dtype).eval()  # the folder holds the tokenizer too: load attaches it
    return model, model.tokenizer


def save_checkpoint(model: K2Model, folder: str | Path, *, fp8: bool = True,
                    format: QuantFormat | str | None = None) -> Path:
    """Write a model in the release layout, per-expert tensor names, its matrices in ``format`` (a QuantFormat or a
    name; default: FP8 in 128x128 blocks when ``fp8``, else unquantized). A model whose weights are not all in memory
    as plain tensors (streamed experts, quantized-resident matrices, meta tensors) is refused before anything is
    written; the write itself replaces ``folder`` only once complete."""
    _check_saveable(model)
    state = model.state_dict()

    def tensor(spec):
        expert = EXPERT_TENSOR.fullmatch(spec.name)
        if expert:
            layer, index, proj = expert.groups()
            return state[f"layers.{layer}.mlp.experts.{proj}"][int(index)]
        return state[spec.name.removeprefix("model.")]

    return write_checkpoint(folder, model.config, tensor, fp8=fp8, format=format)


def _check_saveable(model: K2Model) -> None:
    if not isinstance(model, K2Model):
        raise TypeError(f"model must be a K2Model, got {type(model).__name__}")
    for name, module in model.named_modules():
        if isinstance(module, StreamedExperts):
            raise ValueError(f"model cannot be saved: its routed experts are streamed from the files (load without "
                             f"expert_budget_bytes); {name} is a {type(module).__name__}")
        if isinstance(module, QuantizedResident):
            raise ValueError(f"model cannot be saved: it holds quantized-resident weights (load with "
                             f"quantized_resident=False); {name} is a {type(module).__name__}")
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            raise ValueError(f"model cannot be saved: {name} is on the meta device (it has no values)")
