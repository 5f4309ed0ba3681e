"""A run's record, metrics.json: what the run reached and how. Its status (completed, failed,
preempted, diverged), every figure under the names of saturate.names, how the run was set up,
the verdict and the facts it was judged on, and for a stopped run how it goes on.

This module is the one that writes the file and reads it back: the run (saturate.trainer),
a failure's record (saturate.checkpoint.rundir), `saturate eval`, tune, the sweep report, the
launchers and the trackers go through `RunRecord`. The file stays a flat JSON object, its
keys as docs/outputs.md lists them, so that any tool can read it too.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from saturate import files

FILE = "metrics.json"
MAX_BYTES = 64 << 20  # a run's record is a few KB; past this a file is not a run's


class Unreadable(Exception):
    """A file that is not a record to read: why, in a few words."""


@dataclass
class RunRecord:
    """metrics.json as a value. `entries`: every key as written."""

    entries: dict[str, Any] = field(default_factory=dict)

    def _text(self, key: str) -> str | None:
        value = self.entries.get(key)
        return value if isinstance(value, str) else None

    @property
    def status(self) -> str | None:
        """completed, failed, preempted or diverged; None where the file says none."""
        return self._text("status")

    @property
    def error(self) -> str | None:
        """Why a failed run failed, in one line."""
        return self._text("error")

    @property
    def stopped_by(self) -> str | None:
        """The signal that stopped a preempted run (SIGTERM, SIGUSR1, ...)."""
        return self._text("stopped_by")

    @property
    def resume_with(self) -> str | None:
        """The command that continues a preempted run."""
        return self._text("resume_with")

    @property
    def verdict(self) -> str | None:
        return self._text("verdict")

    @property
    def best(self) -> dict[str, Any] | None:
        """The best checkpoint's metric, value, epoch and step."""
        value = self.entries.get("best")
        return value if isinstance(value, dict) else None


def path(run_dir: str | Path) -> Path:
    return Path(run_dir) / FILE


def load(run_dir: str | Path) -> RunRecord | None:
    """The record in `run_dir`, None where there is none; Unreadable, saying why, where the
    file is a link, not a regular file (a FIFO is not waited on), too large, or not a JSON
    object."""
    try:  # O_NOFOLLOW: a link is refused; O_NONBLOCK: a FIFO does not hang the reader
        fd = os.open(path(run_dir), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Unreadable(e.strerror or str(e)) from None
    with os.fdopen(fd, "rb") as f:
        return parse(bounded(f))


def read(run_dir: str | Path) -> RunRecord | None:
    """The record in `run_dir`; None where there is none or it cannot be read (load says why)."""
    try:
        return load(run_dir)
    except Unreadable:
        return None


def bounded(f: BinaryIO) -> bytes:
    """An open file's bytes: Unreadable when it is not a regular file or more than MAX_BYTES."""
    info = os.fstat(f.fileno())
    if not stat.S_ISREG(info.st_mode):
        raise Unreadable("not a regular file")
    if info.st_size > MAX_BYTES:
        raise Unreadable(f"{info.st_size:,} bytes, more than a run writes ({MAX_BYTES:,})")
    return f.read(MAX_BYTES + 1)


def parse(data: bytes) -> RunRecord:
    """A record from the file's bytes; Unreadable when they are not a JSON object."""
    try:
        entries = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise Unreadable("not valid JSON (not UTF-8)") from None
    except RecursionError:
        raise Unreadable("not valid JSON (nested too deep)") from None
    except ValueError:
        raise Unreadable("not valid JSON") from None
    if not isinstance(entries, dict):
        raise Unreadable("not a JSON object")
    return RunRecord(entries)


def write(run_dir: str | Path, record: RunRecord) -> None:
    write_json(path(run_dir), record.entries)


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically and without following a link (saturate.files.write_text): a
    reader sees the old file or the new one, never half. A write the disk refuses (full, a
    quota) is one message naming the file, and leaves no temporary file behind."""
    files.write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
