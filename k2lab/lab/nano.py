"""K2-nano, the lab's bundled model: a small K2 trained by ``python -m k2lab.training --preset nano`` on the
Python standard library, stored in ``k2lab/lab/assets/nano`` in the release layout (config.json, FP8 safetensors with
per-expert names, the tokenizer files, the training log) and read by the same loader as the real K2."""

from __future__ import annotations

import torch

from ..bundled import NANO_DIR
from ..model.transformer import K2Model
from ..tokenizer.tokenizer import K2Tokenizer
from ..weights.load import load
from ..weights.writer import save_checkpoint as save_checkpoint  # re-exported: k2lab.lab.save_checkpoint


def load_nano(dtype: torch.dtype = torch.float32) -> tuple[K2Model, K2Tokenizer]:
    """The bundled K2-nano and its tokenizer (also attached as ``model.tokenizer``), offline. float32 by default: on a
    CPU it is the fast dtype."""
    if not (NANO_DIR / "config.json").is_file():
        raise FileNotFoundError(f"no K2-nano checkpoint in {NANO_DIR}; train one with python -m k2lab.training")
    model = load(NANO_DIR, dtype=dtype).eval()  # the folder holds the tokenizer too: load attaches it
    return model, model.tokenizer
