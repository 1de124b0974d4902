"""What the notebooks stand on: the parameter cell's settings (``LabSettings``, ``load_model``), the bundled
K2-nano (``load_nano``), shipped as package data in ``k2lab/lab/assets``, the running prompt (``PROMPT``) and the
exercises' check functions (``exercises``).
The learner's own module (``mine``: ``@lab.mine`` keeps an exercise's answer in mine.py, ``lab.mine.load()`` gives it
back with k2lab's references where a piece is missing), HF's DeepseekV3 holding a state dict, for comparisons
(``hf_deepseek_v3``); in a notebook, ``solutions`` keeps solution cells' output folded and the learner's answers in
place."""

from . import exercises, solutions
from .hf_compare import hf_deepseek_v3
from .learner import mine
from .nano import NANO_DIR, load_nano, save_checkpoint
from .settings import NANO, PROMPT, LabSettings, describe, load_model, setup_notebook, tokenizer

__all__ = [
    "NANO", "NANO_DIR", "PROMPT", "LabSettings", "describe", "exercises", "load_model", "load_nano", "save_checkpoint",
    "setup_notebook", "solutions", "tokenizer",
]
__all__ += ["hf_deepseek_v3", "mine"]
