"""Where AdaSpark keeps its files: the cache home and the folders in it.

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
