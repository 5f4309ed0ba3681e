"""How saturate reads and writes files it does not own outright: one rule for each.

Writing: every file is created without following a link. A whole file (a report, a record,
an export) goes through a temporary file beside it and a rename, so a link planted where the
file goes is replaced by the file, never written through, and a reader sees the old file or
the new one, never half. A file written as it grows (a CSV of metrics) is opened with
O_NOFOLLOW, so a link in its place is refused.

Reading: a file named by a user (weights, a checkpoint) is opened without blocking and read
only when it is a regular file, so a FIFO or a device is refused at once instead of holding
the process in `open()`.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import IO, BinaryIO

from saturate.errors import UserError, printable


class NotAFile(UserError):
    """A path that is not a regular file (a FIFO, a device, a folder, a link where none may be)."""


def write_bytes(path: str | Path, data: bytes) -> None:
    """`data` to `path` through a temporary file and a rename (a link at `path` is replaced,
    not followed). A write the disk refuses is one message naming the file; no temporary file
    is left behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)  # the umask applies
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:  # a stop signal ending the process meanwhile leaves no temporary file either
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise UserError(f"cannot write {printable(path)}: {e.strerror or e}") from None
        raise


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def fresh(path: str | Path, suffix: str = ".tmp") -> Path:
    """A new empty file beside `path` (O_EXCL: never a link, never another's file; the umask
    applies), for a library that writes to a name (`suffix`: the ending it insists on): rename
    it onto `path` once written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
    return tmp


def open_growing(path: str | Path, mode: str = "w") -> IO[str]:
    """A text file written as it grows ("w" or "a"), opened with O_NOFOLLOW: a link in its
    place is refused (OSError ELOOP), never written through."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    fd = os.open(path, flags, 0o666)
    return os.fdopen(fd, mode, encoding="utf-8", newline="")


def open_regular(path: str | Path, what: str) -> BinaryIO:
    """`path` opened for reading, refused at once (NotAFile, naming `what`, the key or
    command reading it) when it is not a regular file: O_NONBLOCK makes opening a FIFO return
    instead of waiting for a writer. FileNotFoundError and other OSErrors go to the caller."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = (
                "a folder" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode) else "not a file"
            )
            raise NotAFile(f"{what}={printable(path)}: expected a regular file; this is {kind}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
