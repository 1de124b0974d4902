"""What the notebooks stand on: the parameter cell's settings (``LabSettings``, ``load_model``), the bundled
K2-nano (``load_nano``), shipped as package data in ``k2lab/lab/assets``, the running prompt (``PROMPT``) and the
exercises' check functions (``exercises``); in a notebook, ``solutions`` keeps solution cells' output folded and
the learner's answers in place."""

from . import exercises, solutions
from .nano import NANO_DIR, load_nano, save_checkpoint
from .settings import NANO, PROMPT, LabSettings, describe, load_model, setup_notebook, tokenizer

__all__ = [
    "NANO", "NANO_DIR", "PROMPT", "LabSettings", "describe", "exercises", "load_model", "load_nano", "save_checkpoint",
    "setup_notebook", "solutions", "tokenizer",
]
