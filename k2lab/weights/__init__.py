"""Checkpoints: the release layout's tensors, the stored formats behind one seam (``quant``), reading, writing,
the Hub, placement over devices and experts streamed from the files."""

from .load import load
from .placement import plan

__all__ = ["load", "plan"]
