"""The n-gram memory's file beside its store (``<store>.memory``): read with the checks that keep a
damaged or oversized file from reaching the fill (a regular file within the cap, its checksum, its
owner, its counts, its tokens), written atomically (the format: memory.py,
``NgramMemory.to_bytes``). A file that fails a check is reported and left as is, never replaced:
what it held was learned, and only the user can say it may go."""

from __future__ import annotations

import math
from pathlib import Path

from adaspark_core.base.errors import InputError, OutputError, StoreError
from adaspark_core.base.files import TooLarge, read_regular, replace
from adaspark_core.candidates.memory import (
    CHECKSUM_BYTES,
    DEFAULT_CAP_MB,
    MAGIC,
    MAX_FILE_BYTES,
    MAX_HEAD,
    MemoryFileError,
    NgramMemory,
)


def memory_path(store_path: Path) -> Path:
    """The memory's file beside its store."""
    return store_path.with_name(store_path.name + ".memory")


def load(store_path: Path, owner: str, cap_mb: float | None = DEFAULT_CAP_MB,
         n_vocab: int | None = None) -> NgramMemory:
    """The memory beside ``store_path`` (an empty one if there is no file), checked against the
    model's vocabulary (``n_vocab``) and the cap it is to run under (``cap_mb``; None: any size,
    to inspect it). StoreError naming the file if it cannot be read, or if it is larger than the
    cap: the first reply would evict most of it, so a cap set too low would silently destroy what
    was learned. The file is left as is, never silently replaced."""
    path = memory_path(store_path)
    if cap_mb is None:
        cap_mb, limit = math.inf, MAX_FILE_BYTES
    else:
        # a memory within the cap has at most cap / 4 bytes of tokens (BYTES_PER_TOKEN counts 4)
        limit = len(MAGIC) + MAX_HEAD + int(cap_mb * 1e6) + CHECKSUM_BYTES
    over = (f"its cap of {cap_mb:g} MB (--memory-mb); it was left as is: raise the cap, or run "
            f"`adaspark store reset --memory` to start it afresh")
    try:
        raw = read_regular(path, "the n-gram memory", limit)
    except FileNotFoundError:
        return NgramMemory(cap_mb)
    except TooLarge:
        raise StoreError(f"the n-gram memory {path} is larger than {over}") from None
    except InputError as e:
        raise StoreError(str(e)) from None
    try:
        m = NgramMemory.from_bytes(raw, owner, cap_mb, n_vocab)
    except MemoryFileError as e:
        raise StoreError(f"the n-gram memory {path} cannot be used: {e}; it was left as is: move it away "
                         f"or run `adaspark store reset --memory`") from None
    if m.nbytes > cap_mb * 1e6:
        raise StoreError(f"the n-gram memory {path} takes {m.nbytes / 1e6:.3g} MB, more than {over}")
    return m


def save(memory: NgramMemory, store_path: Path, owner: str) -> None:
    """Write the memory beside its store, atomically, if it changed since the last save."""
    if not memory.dirty:
        return
    path = memory_path(store_path)
    try:
        replace(path, memory.to_bytes(owner))
    except OSError as e:
        raise OutputError(f"cannot save the n-gram memory {path}: {e.strerror or e} (the file on disk is as before)") from None
    memory.dirty = False
