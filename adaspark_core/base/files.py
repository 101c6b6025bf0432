"""Writing the files a user names: the store, an export, compare's results, round logs.

One set of rules, so every command treats a path the same way:

- A file is replaced (written whole) only where a regular file is, or nothing is yet. The bytes go
  to a temp file in the same folder, are fsynced, and renamed over the name, so a reader or a
  crash sees the old file or the new one, never a mix.
- A symlink is followed to the file it names, and that file is written: the link stays a link
  (a ``--store`` linked into a shared folder keeps learning there).
- Anything else at the path (a directory, a device, a FIFO, a socket) is refused with one line and
  left as is: renaming over it would replace a device node or a pipe by a plain file.
- A log is appended to. Appending destroys nothing, so besides a regular file or a new path it
  may go to a FIFO or a character device (``--log /dev/stderr``, a pipe to a compressor).

Reading the files AdaSpark keeps (the store, its n-gram memory) and a corpus to memorize follows
the same rule: only a regular file is read, and only up to a size bound given by what the file
can hold. A FIFO would block the read forever and a device (``/dev/zero``) would fill the RAM, so
both are refused with one line before a byte is read (``read_regular``).

Folders missing on the way are created; a path through something that is not a folder is
refused by name (``x.json/store.json`` where ``x.json`` is a file).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from adaspark_core.base.errors import InputError

PathLike = str | os.PathLike


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def landing(path: PathLike, *, appending: bool = False) -> Path:
    """The file a write to ``path`` lands in: the end of its symlinks, checked to be writable by
    the rules above (a log, ``appending``, may also be a FIFO or a character device). Creates the
    missing folders above it. InputError naming ``path`` otherwise."""
    real = Path(os.path.realpath(path))
    try:
        mode = os.stat(real).st_mode
    except (FileNotFoundError, NotADirectoryError):  # the latter: a file on the way, named by
        _make_folders(path, real.parent)                # _make_folders
        return real
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None
    if stat.S_ISREG(mode) or appending and (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        return real
    shown = f"{path} (the target of a link, {real})" if real != Path(path).absolute() else str(path)
    raise InputError(f"cannot write {shown}: it is {_kind(mode)}, and only a regular file is written; "
                     f"it was left as is")


def _make_folders(path: PathLike, folder: Path) -> None:
    for above in [*reversed(folder.parents), folder]:
        if above.exists() and not above.is_dir():
            raise InputError(f"cannot write {path}: {above} is not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot write {path}: cannot make the folder {folder} ({e.strerror or e})") from None


class TooLarge(InputError):
    """A file to read that holds more bytes than it can (``read_regular``)."""


def read_regular(path: PathLike, what: str, limit: int) -> bytes:
    """The bytes of the regular file at ``path`` (its symlinks followed). FileNotFoundError if
    there is none; InputError naming ``what`` and the path if it is anything else (checked on the
    open descriptor, which a FIFO without a writer does not block: O_NONBLOCK), cannot be read,
    or holds more than ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"cannot read {what} {path}: it is {_kind(st.st_mode)}; only a regular file is read")
        if st.st_size > limit:
            raise TooLarge(f"{what} {path} holds {st.st_size:,} bytes, more than the {limit:,} it can; "
                           f"it was left as is")
        data = b""
        try:
            # as much as fstat said, then on in 1 MB reads: a file that grew is read boundedly too
            while len(data) <= limit and (chunk := f.read(min(max(st.st_size + 1 - len(data), 1 << 20),
                                                              limit + 1 - len(data)))):
                data += chunk
        except OSError as e:
            raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise TooLarge(f"{what} {path} holds more than the {limit:,} bytes it can; it was left as is")
    return data


def replace(path: PathLike, data: bytes) -> Path:
    """Write ``data`` as the whole new content of ``path``, atomically (see the module's rules);
    returns the file written. A file that existed keeps its permission bits; a new one gets 0644.

    The temp file lives in the target's folder because a rename is atomic only within a file
    system. fsync before the rename makes the new bytes durable before the name points at them;
    fsync of the folder makes the rename itself durable. OSError (a full disk, a read-only
    folder) is left to the caller, the old file intact."""
    real = landing(path)
    try:
        keep = stat.S_IMODE(os.stat(real).st_mode)
    except FileNotFoundError:
        keep = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), keep)  # mkstemp makes 0600
        os.replace(tmp, real)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(real.parent, os.O_RDONLY)
    except OSError:  # e.g. platforms where a folder cannot be opened
        return real
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return real


def open_log(path: PathLike, *, fresh: bool = False) -> int:
    """A descriptor appending to the log at ``path`` (created if missing; emptied first if
    ``fresh`` and a regular file). InputError naming the path when it cannot be opened."""
    real = landing(path, appending=True)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    try:
        fd = os.open(real, flags, 0o644)
    except OSError as e:
        raise InputError(f"cannot write the round log {path}: {e.strerror or e}") from None
    if fresh and stat.S_ISREG(os.fstat(fd).st_mode):
        os.ftruncate(fd, 0)
    return fd
