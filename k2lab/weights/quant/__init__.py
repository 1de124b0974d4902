"""Stored weight formats behind one seam (base.py), one module per format. Importing a format's module registers it:
config.json's quantization_config then chooses it (``format_from_quantization_config``)."""

from . import fp8, int4  # noqa: F401 - registers FP8Format, Int4Format
from .base import UNQUANTIZED, QuantFormat, Stored, format_from_quantization_config, register, resolve_format

__all__ = ["UNQUANTIZED", "QuantFormat", "Stored", "format_from_quantization_config", "register", "resolve_format"]
