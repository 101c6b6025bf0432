"""Where AdaSpark keeps its files: the cache home and the folders in it; and the one model name
that is not a file, a simulated model's (``sim:CURVE``, engine/simlm.py).

The ground floor: this module imports nothing from adaspark_core, so the store, the fingerprint
and the model cache can all name their folders without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """The cache directory: $ADASPARK_HOME, else $XDG_CACHE_HOME/adaspark, else ~/.cache/adaspark."""
    if os.environ.get("ADASPARK_HOME"):
        return Path(os.environ["ADASPARK_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaspark"


def stores_dir() -> Path:
    """``home()/stores``: the learned stores and the model digest cache."""
    return home() / "stores"


def digest_cache_path() -> Path:
    """``home()/stores/digests.json``: the SHA-256 of model files, cached by path, size and mtime."""
    return stores_dir() / "digests.json"


def models_dir() -> Path:
    """``home()/models``: the models prepared into the cache (the requantised default)."""
    return home() / "models"


# Here, not in engine/simlm.py: the fingerprint (store/) tells a simulated model's name from a file
# path without importing the engine.
SIM_PREFIX = "sim:"  # the prefix of a simulated model's name (``--model sim:CURVE``)


def is_sim(spec: object) -> bool:
    """Whether ``spec`` names a simulated model rather than a file."""
    return isinstance(spec, str) and spec.startswith(SIM_PREFIX)
