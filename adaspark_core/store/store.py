"""The persisted learned state of the online learners (DESIGN.md layout: ``store.py``).

One JSON file per (model file, machine): what a verify-cost model learned about one model on one
CPU says nothing about another, so the store is keyed by a fingerprint of both and a store whose
fingerprint differs from the current one is refused rather than silently reused. The fingerprint
itself is fingerprint.py's; the store imports no model and no engine.

File contents (``SCHEMA`` 1)::

    {"schema": 1, "fingerprint": {...}, "updated": "2025-01-01T00:00:00+00:00",
     "counts": {"requests": int, "rounds": int}, "sections": {name: state_dict}}

Each learner owns one section and (de)serialises it itself (``state()`` / ``from_state()``),
versions it and upgrades an older one itself (checks.version): this file's schema is the file's
layout only, and the store reads no learner's section.

Invariants:
- An existing file is never modified or replaced unless it was read and accepted (valid JSON, a
  known schema, the same fingerprint): a bad store is reported with StoreError and left as is.
- ``save`` is atomic (files.replace: temp file in the same directory, fsync, rename, fsync of
  the directory): a crash or SIGKILL at any moment leaves either the old or the new file, never a
  partial one. A killed writer can leave a ``.<name>.*.tmp`` file behind; it is never read. A
  store that is a symlink is written through to its target; a store path that is a device, a
  FIFO or a directory is refused at open, before anything is read or decoded.
- Schema upgrades go through ``UPGRADES``, an append-only list as in record.py.
- One process at a time learns into a store. ``open`` takes an advisory lock (``fcntl.flock`` on
  ``.<name>.lock`` beside the store's file) and holds it until ``close`` or the process ends; a
  second process is refused with StoreBusy naming the holder's pid. Refusing, not waiting or
  merging: learned states do not merge (FTRL accumulators and windows of timed samples are not
  sums), a wait would hang a pipeline behind a server that runs for hours, and a refusal tells
  the user at once what to change (``--store``). The kernel drops the lock when its holder dies,
  even by SIGKILL, so no stale lock outlives a crash. Reading (``read``, ``export``) takes no lock.
"""

from __future__ import annotations

import atexit
import fcntl
import os
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import orjson

from adaspark_core.base.errors import InputError, OutputError, StoreBusy, StoreError
from adaspark_core.base.files import landing, read_regular, replace
from adaspark_core.base.paths import stores_dir
from adaspark_core.base.schema import apply_upgrades
from adaspark_core.store.fingerprint import differences, fingerprint_key, same_fingerprint

SCHEMA = 2


def _same_file(d: dict) -> dict:
    """1 -> 2 changed the cost model's section alone (a level window per context band), which
    the cost model now upgrades itself (cost.upgrade_state: a section without a version is its
    oldest). The file's own layout did not change."""
    return d


# Append-only: UPGRADES[i] maps a store dict of schema i+1 to schema i+2. Never edit an entry
# (the one exception: 1 -> 2 moved to the section it changed, see _same_file).
UPGRADES: list[Callable[[dict], dict]] = [_same_file]

FIELDS = ("schema", "fingerprint", "updated", "counts", "sections")  # of a store file (to_json)
_DUMP = orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
_HINT = "it was left as is: move it away or run `adaspark store reset`"
# The largest store file read: a store holds a few hundred KB (24 widths' sample banks, the
# acceptance buckets), so this is a damaged or foreign file, refused before it fills the RAM.
MAX_BYTES = 64 << 20

PathLike = str | os.PathLike


def default_store_path(fp: dict) -> Path:
    """``home()/stores/<key>.json``."""
    return stores_dir() / f"{fingerprint_key(fp)}.json"


# --- the lock ----------------------------------------------------------------------------------


class _Lock:
    """The advisory lock of one store file, shared by every Store this process opens on it (a
    process may reopen its own store; it is other processes that must not write it).

    The lock file holds the holder's pid and goes when the lock is released, so stores leave no
    litter. Removing a lock file is safe only because a taker checks, once locked, that the name
    still points at the file it locked (else it locked one that its holder has just removed, and
    it takes the new one instead)."""

    held: dict[Path, "_Lock"] = {}

    def __init__(self, fd: int, name: Path):
        self.fd, self.name, self.users = fd, name, 0

    @classmethod
    def take(cls, real: Path, shown: Path) -> "_Lock":
        lock = cls.held.get(real)
        if lock is None:
            lock = cls.held[real] = cls._take(real.parent / f".{real.name}.lock", shown)
        lock.users += 1
        return lock

    @classmethod
    def _take(cls, name: Path, shown: Path) -> "_Lock":
        while True:
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise StoreError(f"cannot lock the store {shown}: cannot open {name} ({e.strerror or e})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise StoreBusy(f"the store {shown} is in use by another adaspark process (pid {holder}); two "
                                f"processes learning into one store would lose one's learning: wait for it "
                                f"to end, or give this one its own --store") from None
            try:
                if os.stat(name).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # its holder removed it between our open and our lock: take the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd, name)

    def release(self, real: Path) -> None:
        self.users -= 1
        if self.users == 0:
            del self.held[real]
            self._drop()

    def _drop(self) -> None:
        try:
            os.unlink(self.name)  # while still locked: see the class's comment
        except OSError:
            pass
        os.close(self.fd)  # closing the descriptor drops the flock

    @classmethod
    def drop_all(cls) -> None:
        """At exit: remove the lock files of the stores still open (the kernel would drop the
        locks anyway; this leaves no file behind)."""
        while cls.held:
            cls.held.popitem()[1]._drop()


atexit.register(_Lock.drop_all)


# --- reading -----------------------------------------------------------------------------------


def upgrade(d: dict) -> dict:
    """Bring a parsed store to the current schema (raises ValueError for an unknown schema)."""
    try:
        return apply_upgrades(d, UPGRADES, SCHEMA)
    except ValueError as e:
        raise ValueError(f"has {e}") from None


def _check(d: dict) -> None:
    """Raise ValueError unless ``d`` (already upgraded) has the shape of a store. A field this
    version does not know is refused, not dropped at the next save; a section it does not know is
    kept as it is (no learner here reads or writes it)."""
    unknown = sorted(set(d) - set(FIELDS))
    if unknown:
        raise ValueError(f"has a field this version does not know: {unknown[0]} (written by a newer AdaSpark?)")
    if not isinstance(d.get("fingerprint"), dict):
        raise ValueError("has no fingerprint")
    counts = d.get("counts")
    if not isinstance(counts, dict) or any(
        type(counts.get(k)) is not int or counts[k] < 0 for k in ("requests", "rounds")
    ):
        raise ValueError("has bad counts")
    sections = d.get("sections")
    if not isinstance(sections, dict) or not all(isinstance(v, dict) for v in sections.values()):
        raise ValueError("has bad sections")


def _read(path: Path, missing_ok: bool = False) -> bytes | None:
    """The file's bytes; None for a missing file if ``missing_ok``; StoreError otherwise (also for
    a FIFO, a device or a file past MAX_BYTES: files.read_regular)."""
    try:
        return read_regular(path, "the store", MAX_BYTES)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise StoreError(f"there is no store at {path}") from None
    except InputError as e:
        raise StoreError(str(e)) from None


def _parse(raw: bytes, path: Path, hint: str = _HINT) -> dict:
    """Parse, upgrade and shape-check a store file's bytes; StoreError naming ``path`` otherwise."""
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise StoreError(f"store {path} is corrupt (line {e.lineno}: {e.msg}); {hint}") from None
    if not isinstance(d, dict):
        raise StoreError(f"store {path} is corrupt (not a JSON object); {hint}")
    try:
        d = upgrade(d)
        _check(d)
    except ValueError as e:
        raise StoreError(f"store {path} {e}; {hint}") from None
    return d


def _mismatch(path: Path, stored: dict, fp: dict, hint: str) -> StoreError:
    fields = ", ".join(differences(stored, fp))
    return StoreError(f"store {path} belongs to another model or machine (differs in {fields}); {hint}")


@contextmanager
def _locked(path: PathLike):
    """Hold the lock of the store at ``path`` for one operation; yields its real file."""
    real = landing(path)
    lock = _Lock.take(real, Path(path))
    try:
        yield real
    finally:
        lock.release(real)


# --- the store ---------------------------------------------------------------------------------


class Store:
    """Learned state of one (model, machine), as named sections plus usage counts.

    Use ``Store.open(path, fp)``; change it with ``put`` / ``bump``; persist with ``save``.
    """

    def __init__(self, path: PathLike, fp: dict, *, counts: dict | None = None,
                 sections: dict | None = None, updated: str | None = None):
        self.path = Path(path)
        self.fingerprint = fp
        self.counts = dict(counts or {"requests": 0, "rounds": 0})
        self.sections: dict[str, dict] = dict(sections or {})
        self.updated = updated
        self._lock: tuple[_Lock, Path] | None = None  # held when opened to learn into (open)

    @classmethod
    def open(cls, path: PathLike, fp: dict) -> "Store":
        """Load the store at ``path``, or start an empty one if there is no file.

        Raises StoreError (and leaves the file untouched) if the file is corrupt, of an unknown
        schema, or has a fingerprint other than ``fp``.
        """
        path = Path(path)
        real = landing(path)  # a device or a FIFO is refused before it is read
        lock = _Lock.take(real, path)
        try:
            raw = _read(path, missing_ok=True)
            if raw is None:
                store = cls(path, fp)
            else:
                d = _parse(raw, path)
                if not same_fingerprint(d["fingerprint"], fp):
                    raise _mismatch(path, d["fingerprint"], fp, _HINT)
                store = cls(path, fp, counts=d["counts"], sections=d["sections"], updated=d.get("updated"))
        except BaseException:
            lock.release(real)
            raise
        store._lock = (lock, real)
        return store

    def close(self) -> None:
        """Let other processes open the store (the process's end does as much)."""
        if self._lock is not None:
            lock, real = self._lock
            self._lock = None
            lock.release(real)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def read(cls, path: PathLike, fp: dict | None = None, hint: str = _HINT) -> tuple["Store", object]:
        """(the store at ``path``, the schema of the file on disk), for inspection: validated as
        ``open`` does and, when ``fp`` is given, checked to have that fingerprint; StoreError
        ending in ``hint`` otherwise, also for a missing file. Reads the file once, never writes."""
        path = Path(path)
        raw = _read(path)
        d = _parse(raw, path, hint=hint)
        if fp is not None and not same_fingerprint(d["fingerprint"], fp):
            raise _mismatch(path, d["fingerprint"], fp, hint)
        file_schema = orjson.loads(raw).get("schema")  # _parse upgraded its copy
        return cls(path, d["fingerprint"], counts=d["counts"], sections=d["sections"], updated=d.get("updated")), file_schema

    def get(self, name: str) -> dict | None:
        """The state saved under ``name``, or None."""
        return self.sections.get(name)

    def put(self, name: str, state: dict) -> None:
        """Set section ``name``. The state is normalised through JSON now, so ``get`` returns
        exactly what a reopened store would (numpy arrays become lists, numpy scalars numbers,
        NaN/inf become None), and a state that cannot be saved (e.g. a dict with non-str keys)
        raises TypeError here, at the caller, rather than at ``save``."""
        if not isinstance(state, dict):
            raise TypeError(f"section {name!r}: state must be a dict, not {type(state).__name__}")
        self.sections[name] = orjson.loads(orjson.dumps(state, option=orjson.OPT_SERIALIZE_NUMPY))

    def bump(self, requests: int = 0, rounds: int = 0) -> None:
        """Add to the usage counts."""
        if requests < 0 or rounds < 0:
            raise ValueError("counts only grow")
        self.counts["requests"] += int(requests)
        self.counts["rounds"] += int(rounds)

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "fingerprint": self.fingerprint,
            "updated": self.updated,
            "counts": self.counts,
            "sections": self.sections,
        }

    def save(self) -> None:
        """Write the store atomically (the old file stays intact if anything fails)."""
        self.updated = datetime.now(timezone.utc).isoformat(timespec="seconds")
        try:
            replace(self.path, orjson.dumps(self.to_json(), option=_DUMP))
        except OSError as e:
            raise OutputError(f"cannot save the store {self.path}: {e.strerror or e} (the file on disk "
                              f"is as before)") from None

    @staticmethod
    def reset(path: PathLike, extra: list[PathLike] = (), keep_store: bool = False) -> bool:
        """Delete the store file at ``path`` (a symlink stays, the file it names goes) and the
        files ``extra`` that belong to it (its n-gram memory), or with ``keep_store`` only those.
        Returns whether the store file was there. StoreBusy while another process learns into it."""
        with _locked(path) as real:
            for other in extra:
                Path(other).unlink(missing_ok=True)
            if keep_store:
                return real.exists()
            try:
                real.unlink()
                return True
            except FileNotFoundError:
                return False

    @staticmethod
    def export(path: PathLike, dest: PathLike) -> None:
        """Copy the store at ``path`` to ``dest`` (checked to be a readable store first)."""
        path = Path(path)
        raw = _read(path)  # read once: what is checked is what is copied
        _parse(raw, path, hint="nothing was exported")
        replace(dest, raw)

    @staticmethod
    def import_(src: PathLike, path: PathLike, fp: dict, *, force: bool = False) -> "Store":
        """Install the store file ``src`` at ``path`` (replacing any store there) and return it.

        ``src`` is validated like ``open``: schema and fingerprint. With ``force``, a store of
        another fingerprint is accepted and its fingerprint rewritten to ``fp`` (its learned state
        then describes another model or machine until the learners adapt). ``src`` is not modified.
        """
        src = Path(src)
        hint = "nothing was imported"
        d = _parse(_read(src), src, hint=hint)
        if not same_fingerprint(d["fingerprint"], fp) and not force:
            raise _mismatch(src, d["fingerprint"], fp, hint + " (use --force to import it anyway)")
        store = Store(path, fp, counts=d["counts"], sections=d["sections"], updated=d.get("updated"))
        with _locked(path):  # never under a process that is learning into the store
            store.save()
        return store


reset = Store.reset
export = Store.export
import_ = Store.import_
