"""What learned state depends on: the model file, the drafter file, and the machine.

A store (store.py) is keyed by ``fingerprint_key(fingerprint(model, drafter))`` and refuses to be
opened under another fingerprint; a survey (profile.py) records ``machine()``. A file is
identified by size and SHA-256 of its content (not its path, so a copy or a move keeps its
store); digests are cached in ``paths.digest_cache_path()`` by (absolute path, size, mtime_ns).

Imports from adaspark_core only paths, files and errors: nothing here loads a model or llama.cpp
(the llama-cpp-python version is read from the installed package's metadata).
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

import orjson

from adaspark_core.base.errors import InputError
from adaspark_core.base.files import replace
from adaspark_core.base.paths import SIM_PREFIX, digest_cache_path, is_sim

_CHUNK = 1 << 20  # hash models in 1 MiB chunks: constant memory for any model size
_DUMP = orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY

PathLike = str | os.PathLike


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _model_digest(path: Path, cache: Path) -> str:
    """SHA-256 of the model file, cached by (absolute path, size, mtime_ns).

    The cache is only an optimisation: an unreadable cache is ignored and a failed write is
    swallowed, so it can never break a run. (A file rewritten with the same size inside one mtime
    tick would be missed; model files are not edited in place, so we accept that.)
    """
    st = path.stat()
    key = str(path.resolve())
    try:
        entries = orjson.loads(cache.read_bytes())
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, orjson.JSONDecodeError):
        entries = {}
    hit = entries.get(key)
    if isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
        return hit["sha256"]
    digest = _sha256_file(path)
    entries[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    try:
        replace(cache, orjson.dumps(entries, option=_DUMP))
    except (OSError, InputError):
        pass
    return digest


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_count() -> int:
    """The CPUs this process may run on (taskset / cgroup cpusets), not the machine's total: the
    verify cost depends on the threads llama.cpp actually gets."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def llama_version() -> str | None:
    """The installed llama-cpp-python's version (package metadata; the package is not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


def machine() -> dict:
    """The machine part of a fingerprint: CPU name, usable CPUs, architecture, llama-cpp-python."""
    return {
        "cpu": cpu_name(),
        "cpus": cpu_count(),
        "arch": platform.machine(),
        "llama_cpp_python": llama_version(),
    }


def fingerprint(model_path: PathLike, drafter_path: PathLike | None = None, *,
                digest_cache: PathLike | None = None, layout: dict | None = None) -> dict:
    """What the learned state depends on: the model file's content, the drafter's if there is one
    (the acceptance model learns how the drafter's candidates fare against this target), the
    machine, and where the model's layers run unless on the local CPU (``layout``,
    engine/devices.py ``DeviceLayout.fingerprint``: a verify's cost on a GPU or over RPC is not
    its cost here, so the cost model learned on one layout never prices another).

    A file is identified by size and SHA-256 of its content (not its path, so a copy or a move
    keeps its store). ``digest_cache`` is the side file caching digests (default:
    ``home()/stores/digests.json``).
    """
    cache = Path(digest_cache) if digest_cache is not None else digest_cache_path()

    def ident(p: PathLike) -> dict:
        if is_sim(str(p)):  # a simulated model (engine/simlm.py) is its name
            return {"sim": str(p)[len(SIM_PREFIX):]}
        p = Path(p)
        return {"size": p.stat().st_size, "sha256": _model_digest(p, cache)}

    drafter = {"drafter": ident(drafter_path)} if drafter_path is not None else {}
    return {
        "model": ident(model_path),
        **drafter,
        "machine": machine(),
        **({"layout": layout} if layout else {}),
    }


def _canonical(fp: dict) -> bytes:
    return orjson.dumps(fp, option=orjson.OPT_SORT_KEYS)


def same_fingerprint(a: dict, b: dict) -> bool:
    return _canonical(a) == _canonical(b)


def fingerprint_key(fp: dict) -> str:
    """A short stable hex key for ``fp``: the first 16 hex digits of SHA-256 of its canonical JSON."""
    return hashlib.sha256(_canonical(fp)).hexdigest()[:16]


def differences(a: dict, b: dict) -> list[str]:
    """Dotted names of the fields where two fingerprints differ, compared as canonical JSON (so a
    tuple and a list, or an int key and its string, do not count as a difference)."""
    return _diff(orjson.loads(_canonical(a)), orjson.loads(_canonical(b)))


def _diff(a, b, prefix: str = "") -> list[str]:
    """Dotted names of the fields where two (JSON) values differ (for the error message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".") or "fingerprint"]
