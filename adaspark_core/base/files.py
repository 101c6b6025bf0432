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

Every file a user names to be read (a store, its n-gram memory, a corpus, a conversation set,
a prompt file, a trace, a round log) follows the same rule: only a regular file is read, and only
up to a size bound given by what the file can hold. A FIFO would block the read forever, a device
(``/dev/zero``) would fill the RAM and a folder is not a file, so each is refused with one line
naming the path (and a link's target) before it is opened. ``read_regular`` reads a file whole;
``open_regular`` streams one line by line, each line bounded as well, for files that are long
but whose lines are small (round logs and traces): a reader then holds one line at a time.

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
    """A file to read that holds more bytes than it can (``read_regular``, ``open_regular``)."""


def _refused(path: PathLike, what: str, mode: int) -> InputError:
    real = os.path.realpath(path)
    shown = f"{path} (a link to {real})" if real != os.path.abspath(path) else str(path)
    return InputError(f"cannot read {what} {shown}: it is {_kind(mode)}; only a regular file is read")


def _open_regular(path: PathLike, what: str, limit: int) -> tuple[int, int]:
    """(a read-only descriptor of the regular file at ``path``, its size). FileNotFoundError if
    there is none; InputError naming ``what`` and the path if it is anything else, cannot be
    opened, or holds more than ``limit`` bytes.

    The kind is checked by ``stat`` before the open, so a device or a FIFO is never opened (an
    open can act by itself: a tape rewinds, a watchdog arms), and again on the open descriptor,
    in case the name changed in between; O_NONBLOCK keeps that open from waiting for a FIFO's
    writer."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _refused(path, what, mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refused(path, what, st.st_mode)
        if st.st_size > limit:
            raise TooLarge(f"{what} {path} holds {st.st_size:,} bytes, more than the {limit:,} it can; "
                           f"it was left as is")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(path: PathLike, what: str, limit: int) -> bytes:
    """The bytes of the regular file at ``path`` (its symlinks followed). FileNotFoundError if
    there is none; InputError naming ``what`` and the path if it is anything else (a folder, a
    device, a FIFO, a socket), cannot be read, or holds more than ``limit`` bytes."""
    fd, size = _open_regular(path, what, limit)
    data = b""
    with os.fdopen(fd, "rb") as f:
        try:
            # As much as fstat said, then on in 1 MB reads: a file that grew is read boundedly
            # too. Not f.read(limit + 1): that allocates the whole bound up front.
            while len(data) <= limit and (chunk := f.read(min(max(size + 1 - len(data), 1 << 20),
                                                              limit + 1 - len(data)))):
                data += chunk
        except OSError as e:
            raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise TooLarge(f"{what} {path} holds more than the {limit:,} bytes it can; it was left as is")
    return data


class Lines:
    """The lines of a regular file opened by ``open_regular``, one at a time: an iterator (as a
    file object is) of each line's bytes, its newline included (a last line cut short has none,
    so a reader can tell it from a whole one). A line longer than ``line_limit`` bytes, or more
    than ``limit`` bytes in all (a file that grew while it was read), is TooLarge naming the file
    and line: the reader never holds more than one bounded line. A context manager."""

    def __init__(self, fd: int, path: PathLike, what: str, limit: int, line_limit: int):
        self._f = os.fdopen(fd, "rb")
        self.path, self.what, self.limit, self.line_limit = path, what, limit, line_limit
        self.lineno = 0  # of the last line read
        self._total = 0

    def __iter__(self) -> "Lines":
        return self

    def __next__(self) -> bytes:
        try:
            line = self._f.readline(self.line_limit + 1)
        except OSError as e:
            raise InputError(f"cannot read {self.what} {self.path}: {e.strerror or e}") from None
        if not line:
            raise StopIteration
        self.lineno += 1
        if len(line) > self.line_limit:
            raise TooLarge(f"{self.path}:{self.lineno}: a line longer than {self.line_limit:,} bytes, more than "
                           f"a line of {self.what} holds; it was left as is")
        self._total += len(line)
        if self._total > self.limit:
            raise TooLarge(f"{self.what} {self.path} holds more than the {self.limit:,} bytes it can; "
                           f"it was left as is")
        return line

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "Lines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_regular(path: PathLike, what: str, limit: int, line_limit: int) -> Lines:
    """The regular file at ``path``, checked as ``read_regular`` checks it (FileNotFoundError,
    InputError, TooLarge alike), to read line by line (``Lines``): for a long file of short lines,
    a round log or a trace, which is streamed rather than read whole."""
    fd, _ = _open_regular(path, what, limit)
    return Lines(fd, path, what, limit, line_limit)


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
