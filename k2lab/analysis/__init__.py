"""Reading a model: the activation cache, routing traces and metrics, interventions and the parameter, byte and
KV-cache accounting."""

from . import interventions, routing
from .accounting import count_parameters, kv_cache_bytes, weight_bytes
from .cache import ActivationCache

__all__ = ["ActivationCache", "count_parameters", "interventions", "kv_cache_bytes", "routing", "weight_bytes"]
