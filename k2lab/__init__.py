"""k2lab: an exact, readable and probe-able PyTorch reimplementation of the Kimi K2 architecture."""

from .accounting import count_parameters, kv_cache_bytes, weight_bytes
from .attention import LatentCache
from .config import K2Config
from .generate import generate
from .loader import load
from .model import K2Model
from .placement import plan

__all__ = [
    "K2Config", "K2Model", "LatentCache", "count_parameters", "generate", "kv_cache_bytes", "load", "plan",
    "weight_bytes",
]
