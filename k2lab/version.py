"""k2lab's version: the installed distribution's, read once (what saved caches and checkpoints record)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("k2lab")
    """k2lab's version, from the installed distribution (``0.0.0+unknown`` in a source tree that is not installed)."""
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
