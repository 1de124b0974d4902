"""k2lab: an exact, readable and probe-able PyTorch reimplementation of the Kimi K2 architecture."""

from .accounting import count_parameters, kv_cache_bytes, weight_bytes
from .attention import LatentCache
from .checkpoint import load
from .config import K2Config
from .generate import generate
from .model import K2Model

__all__ = [
    "K2Config", "K2Model", "LatentCache", "count_parameters", "generate", "kv_cache_bytes", "load", "weight_bytes",
]
