"""Tensor R-Fork: start LLM instances by pulling weights memory-to-memory from a running seed."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rfork")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
