"""What the notebooks stand on: the parameter cell's settings (``LabSettings``, ``load_model``), the bundled
K2-nano (``load_nano``), shipped as package data in ``k2lab/lab/assets``, the running prompt (``PROMPT``) and the
exercises' check functions (``exercises``)."""

from . import exercises
from .answers import folded
from .hf_compare import hf_deepseek_v3
from .learner import mine
from .nano import NANO_DIR, load_nano, save_checkpoint
from .settings import NANO, PROMPT, LabSettings, describe, load_model, setup_notebook, tokenizer

__all__ = [
    "NANO", "NANO_DIR", "PROMPT", "LabSettings", "describe", "exercises", "load_model", "load_nano", "save_checkpoint",
    "setup_notebook", "tokenizer",
]
__all__ += ["folded", "hf_deepseek_v3", "mine"]
