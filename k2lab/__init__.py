"""k2lab: an exact, readable and probe-able PyTorch reimplementation of the Kimi K2 architecture."""

from . import interventions, routing
from .accounting import count_parameters, kv_cache_bytes, weight_bytes
from .attention import LatentCache
from .config import K2Config
from .generate import generate
from .loader import load
from .model import K2Model
from .nano import load_nano
from .placement import plan
from .tokenizer import K2Tokenizer, load_tokenizer

__all__ = [
    "K2Config", "K2Model", "K2Tokenizer", "LatentCache", "count_parameters", "generate", "interventions",
    "kv_cache_bytes", "load", "load_nano", "load_tokenizer", "plan", "routing", "weight_bytes",
]
