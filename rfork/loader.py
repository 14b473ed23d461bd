"""Deprecated module path: import from `rfork` (`from rfork import Loader, LoadOptions, load, pull_into`).

Kept so code written against the README of rfork 0.1 keeps working; it warns once per process.
"""

import warnings

from rfork.pull.loader import Loader, load, pull_into
from rfork.pull.one_sided import warm_transport
from rfork.pull.result import Attempt, LoadOptions, LoadResult

warnings.warn("rfork.loader is deprecated: import from rfork instead", DeprecationWarning, stacklevel=2)

__all__ = ["Attempt", "LoadOptions", "LoadResult", "Loader", "load", "pull_into", "warm_transport"]
