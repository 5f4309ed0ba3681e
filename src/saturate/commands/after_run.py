"""What `saturate eval` and `saturate export` check before any work, and the rules they keep
with the folders around them.

- A run dir (what train.py wrote: `.hydra/`, a run's metrics.json, checkpoints/best.pt or
  last.pt) is data: no code or config is taken from it, even when the command runs inside
  it, and it is never `--out`, whose files would replace the run's.
- `--out` is made (or is a folder) and written to before the evaluation or the export runs,
  so that a file in its place, a read-only disk or a folder another export holds is one line
  at once, not after minutes of work; what this command made is removed again when it stops
  on a mistake before writing anything.
- A name that becomes a file name (`--name`) is a plain name: no folder in it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from saturate import record as run_record
from saturate.errors import UserError, printable

RUN_MARKS = (".hydra", "checkpoints/best.pt", "checkpoints/last.pt")
PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,99}")


def is_run_dir(folder: Path) -> bool:
    """Whether `folder` is a run dir of train.py: its .hydra/, a checkpoint of its own, or a
    metrics.json that is a run's record (an evaluation's names its checkpoint and split)."""
    if any((folder / mark).exists() or (folder / mark).is_symlink() for mark in RUN_MARKS):
        return True
    record = run_record.path(folder)
    if record.is_symlink() or not record.is_file():  # a link is no record saturate wrote: it is replaced
        return False
    try:
        found = run_record.load(folder)
    except run_record.Unreadable:
        return True  # not a record anything here wrote: kept as it is
    entries = found.entries if found is not None else {}
    return not (isinstance(entries, dict) and "checkpoint" in entries and "split" in entries)


def code_from_projects_only() -> None:
    """No run dir on sys.path: the working dir where it is one (`cd RUN && saturate eval .`,
    and the folder `python -m` puts first), and any other entry that is one."""
    kept = [p for p in sys.path if not is_run_dir(Path(p or os.getcwd()))]
    sys.path[:] = kept


def plain_name(flag: str, value: str) -> str:
    """`value` when it is a plain name (letters, digits, _ . + -, not starting with a dot)."""
    if not PLAIN.fullmatch(value) or ".." in value:
        raise UserError(
            f"{flag} {printable(value)!r}: expected a plain name (letters, digits, _ . + -; no folder, no leading dot)"
        )
    return value


def _made(out: Path) -> list[Path]:
    """The folders `out.mkdir(parents=True)` would make, outermost first."""
    missing = []
    for folder in [out, *out.parents]:
        if folder.exists() or folder.is_symlink():
            break
        missing.append(folder)
    return missing[::-1]


def _make(out: Path) -> list[Path]:
    shown = printable(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {shown}: a file is there; expected a folder (made when missing)")
    if out.is_dir() and is_run_dir(out.resolve()):
        raise UserError(
            f"--out {shown}: a run dir (its checkpoints/, {run_record.FILE}): its files would be replaced; give a "
            f"folder of its own, e.g. {printable(out / 'eval')}"
        )
    made = _made(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        _remove(made)
        raise UserError(
            f"--out {shown}: cannot write there ({e.strerror or e}); expected a folder one can write to"
        ) from None
    return made


def _remove(made: list[Path]) -> None:
    for folder in reversed(made):
        with contextlib.suppress(OSError):  # not empty: something was written, kept
            folder.rmdir()


@contextlib.contextmanager
def prepared_out(out: Path, *, exclusive: bool) -> Iterator[None]:
    """`out` made and written to (one line when it cannot be); `exclusive`: held (flock on
    the folder) for the block, refused at once where another command holds it. Folders made
    here that are still empty when the block raises are removed."""
    made = _make(out)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if exclusive:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UserError(
                    f"--out {printable(out)}: another saturate export is writing there; wait for it, or give "
                    "another --out"
                ) from None
        yield
    except BaseException:
        _remove(made)
        raise
    finally:
        os.close(fd)
