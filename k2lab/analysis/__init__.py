"""Reading a model: the activation cache, padded batches of a data set, routing traces and metrics, interventions and
the parameter, byte and KV-cache accounting."""

from ..model.activation_cache import ActivationCache
from . import interventions, routing
from .accounting import count_parameters, kv_cache_bytes, weight_bytes
from .datasets import batches

__all__ = ["ActivationCache", "batches", "count_parameters", "interventions", "kv_cache_bytes", "routing",
           "weight_bytes"]
