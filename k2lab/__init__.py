"""k2lab: an exact, readable and probe-able PyTorch reimplementation of the Kimi K2 architecture.

The package's rooms, in the direction data flows:

    config.py    K2Config: the architecture only
    model/       the modules, probes and decoding          (config -> model)
    weights/     checkpoints, stored formats, placement    (weights -> model)
    analysis/    activation cache, routing, interventions, accounting   (model -> analysis)
    viz/         plotly figures and widgets, imported on demand          (analysis -> viz)
    tokenizer/   K2's tokenizer and chat layout
    training/    K2's recipe on a small model
    lab/         the notebooks' settings and the bundled K2-nano
"""

from importlib.metadata import PackageNotFoundError, version

from .analysis import interventions, routing
from .analysis.accounting import count_parameters, kv_cache_bytes, weight_bytes
from .config import K2Config
from .lab.nano import load_nano
from .model import K2Model, LatentCache, generate, get_act_name
from .tokenizer import K2Tokenizer, load_tokenizer
from .weights import load, plan

try:
    __version__ = version("k2lab")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0.0.0+unknown"

__all__ = [
    "K2Config", "K2Model", "K2Tokenizer", "LatentCache", "__version__", "count_parameters", "generate",
    "get_act_name", "interventions", "kv_cache_bytes", "load", "load_nano", "load_tokenizer", "plan", "routing",
    "weight_bytes",
]
