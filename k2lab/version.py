"""k2lab's version: the installed distribution's, read once (what saved caches and checkpoints record)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("k2lab")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
