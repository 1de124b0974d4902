"""k2lab: an exact, readable and probe-able PyTorch reimplementation of the Kimi K2 architecture.

The package's rooms, in the direction data flows:

    config.py    K2Config: the architecture only
    hf_config.py config.json <-> K2Config, the architecture's part of it
    model/       the modules, probes and decoding          (config -> model)
    weights/     checkpoints, stored formats, placement    (weights -> model)
    analysis/    activation cache, routing, interventions, accounting   (model -> analysis)
    viz/         plotly figures and widgets, imported on demand          (analysis -> viz)
    tokenizer/   K2's tokenizer and chat layout
    training/    K2's recipe on a small model
    lab/         the notebooks' settings and the bundled K2-nano
    bundled.py   where the package data (K2-nano) lies, for the lab and training alike
"""

from importlib import import_module
from typing import TYPE_CHECKING

from .config import K2Config
from .version import __version__

# The public names, each imported from its room on first use, so that ``import k2lab.model`` runs no checkpoint,
# tokenizer or analysis code, and ``import k2lab`` stays quick. name -> (module, attribute or None for the module).
_LAZY = {
    "K2Model": ("k2lab.model", "K2Model"),
    "LatentCache": ("k2lab.model", "LatentCache"),
    "generate": ("k2lab.model", "generate"),
    "get_act_name": ("k2lab.model", "get_act_name"),
    "load": ("k2lab.weights", "load"),
    "plan": ("k2lab.weights", "plan"),
    "K2Tokenizer": ("k2lab.tokenizer", "K2Tokenizer"),
    "load_tokenizer": ("k2lab.tokenizer", "load_tokenizer"),
    "load_nano": ("k2lab.lab.nano", "load_nano"),
    "count_parameters": ("k2lab.analysis.accounting", "count_parameters"),
    "kv_cache_bytes": ("k2lab.analysis.accounting", "kv_cache_bytes"),
    "weight_bytes": ("k2lab.analysis.accounting", "weight_bytes"),
    "interventions": ("k2lab.analysis.interventions", None),
    "routing": ("k2lab.analysis.routing", None),
    "circuits": ("k2lab.analysis.circuits", None),
    "patching": ("k2lab.analysis.patching", None),
    "lab": ("k2lab.lab", None),
    "viz": ("k2lab.viz", None),  # plotly and ipywidgets load here, on first use
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'k2lab' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = import_module(module) if attribute is None else getattr(import_module(module), attribute)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


if TYPE_CHECKING:  # what type checkers and IDEs see
    from .analysis import circuits, interventions, patching, routing
    from .analysis.accounting import count_parameters, kv_cache_bytes, weight_bytes
    from .lab.nano import load_nano
    from .model import K2Model, LatentCache, generate, get_act_name
    from .tokenizer import K2Tokenizer, load_tokenizer
    from .weights import load, plan

__all__ = [
    "K2Config", "K2Model", "K2Tokenizer", "LatentCache", "__version__", "circuits", "count_parameters", "generate",
    "get_act_name", "interventions", "kv_cache_bytes", "load", "load_nano", "load_tokenizer", "patching", "plan",
    "routing", "weight_bytes",
]
