"""What the notebooks stand on: the parameter cell's settings (``LabSettings``, ``load_model``) and the bundled
K2-nano (``load_nano``), shipped as package data in ``k2lab/lab/assets``."""

from .nano import NANO_DIR, load_nano, save_checkpoint
from .settings import NANO, LabSettings, describe, load_model, setup_notebook, tokenizer

__all__ = [
    "NANO", "NANO_DIR", "LabSettings", "describe", "load_model", "load_nano", "save_checkpoint", "setup_notebook",
    "tokenizer",
]
