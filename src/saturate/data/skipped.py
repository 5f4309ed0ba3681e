"""Broken samples met after start-up: recorded by whichever process decodes them, named and
counted by the main process, left out from then on. Shared by image folders and shards.

A DataLoader worker cannot tell the main process anything but a batch, so a worker that
meets a sample it cannot decode appends it to a skip log (`SkipLog`: one JSON line per
sample, O_APPEND, so lines from any process or rank land whole) and fills its slot with the
next readable sample (batches keep their shape; the same samples give the same batches).
The main process reads what is new after each batch (`Skipped.poll`: one stat when nothing
is), names each sample in a warning and counts it in `data/skipped_files`.

Nothing read from a skip log can run code or stop a run: each line is parsed with
`json.loads` and kept only if it is `[index, name, reason]` with an integer and two strings;
anything else (a damaged line, one nested a million deep, a 1e999) is passed over.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Set
from pathlib import Path

from saturate import names
from saturate.errors import DataError, printable

log = logging.getLogger(__name__)


class SkipLog:
    """Samples found unreadable after start-up: one JSON line `[index, name, why]` each,
    appended with O_APPEND. `merge`: the next start reads the log to leave them out (the
    log is kept with a cache); otherwise it belongs to this run only."""

    def __init__(self, path: str, *, merge: bool):
        self.path, self.merge, self.offset = path, merge, 0

    def append(self, index: int, name: str, reason: str) -> bool:
        """Record one sample; False if the log cannot be written."""
        line = (json.dumps([index, name, reason]) + "\n").encode("utf-8", "surrogateescape")
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
            return True
        except OSError:
            return False

    def new(self) -> list[tuple[int, str, str]]:
        """The entries written since the last call: one stat when there are none."""
        try:
            if os.stat(self.path).st_size <= self.offset:
                return []
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written is read next time
        self.offset += len(whole)
        return [entry for line in whole.splitlines() if (entry := _entry(line)) is not None]


def _entry(line: bytes) -> tuple[int, str, str] | None:
    """One line of a skip log, or None for anything that is not `[int, str, str]`."""
    if len(line) > 1 << 16:  # a line saturate writes is a name and a reason: far shorter
        return None
    try:
        value = json.loads(line.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        return None
    if not (isinstance(value, list) and len(value) == 3):
        return None
    index, name, reason = value
    if (
        isinstance(index, bool)
        or not isinstance(index, int)
        or not isinstance(name, str)
        or not isinstance(reason, str)
    ):
        return None
    return index, name, reason


class Skipped:
    """The broken samples of one data set (an image folder, a shard index) met in this run:
    recorded by whichever process decodes them, named and counted by the main process
    (`poll`), left out of later batches by the process that met them and, after a poll, by
    workers started later. `names[i]` says where sample `i` is, relative to `where`; `notes`
    is the data set's, shared by its parts (a folder's train/ and val/)."""

    def __init__(
        self, where: Path | str, names, skip_log: SkipLog, notes: dict, *, strict: bool, known: Set[str] = frozenset()
    ):
        self.where, self.names, self.log, self.notes, self.strict = str(where), names, skip_log, notes, strict
        self.files: set[int] = set()  # samples found unreadable in this run
        self.named: set[str] = set(known)  # named already (at start-up)

    def path(self, index: int) -> str:
        return os.path.join(self.where, self.names[index])

    def record(self, index: int, error: Exception) -> None:
        """Sample `index` does not read or decode: skipped and logged, or with data.strict=true
        an error (it passed the check at start-up: it changed since)."""
        reason = why(error)
        if self.strict:
            raise DataError(
                f"cannot read {printable(self.path(index))} ({reason}); it was whole at start-up (data.strict=true): "
                "remove or replace it"
            )
        self.files.add(index)
        if not self.log.append(index, self.names[index], reason):
            raise DataError(
                f"cannot read {printable(self.path(index))} ({reason}), and cannot record it as skipped "
                f"({printable(self.log.path)} is not writable): remove or replace it"
            )

    def poll(self) -> None:
        """Name and count what the log holds that this process has not seen (one stat when nothing is new)."""
        for index, name, reason in self.log.new():
            if name in self.named:
                continue
            self.named.add(name)
            if 0 <= index < len(self.names) and self.names[index] == name:
                self.files.add(index)
            log.warning(
                "skipping %s: not a readable image (%s)", printable(os.path.join(self.where, name)), printable(reason)
            )
            self.notes[names.SKIPPED_FILES] = self.notes.get(names.SKIPPED_FILES, 0) + 1


def why(error: Exception) -> str:
    """Why a sample did not decode, in one line."""
    from PIL import UnidentifiedImageError

    if isinstance(error, UnidentifiedImageError):  # PIL's message names its in-memory buffer, not the file
        return f"{type(error).__name__}: not an image format the decoders know"
    return f"{type(error).__name__}: {error}"


def fill(batch, positions: list[int], encoded: list, *, skipped: Skipped, file_of, fetch, length: int) -> list[int]:
    """Decode `encoded[j]` (bytes, or the error reading them) into `batch[j]`, the sample at
    `positions[j]` of a data set of `length` samples. A sample that does not read or decode
    is recorded and its slot takes the next readable sample (`fetch(file)`: its bytes or the
    error; `file_of(position)`: the id `skipped` knows it by). Returns the positions used."""
    from saturate.data.decode import UNREADABLE, decode_into

    used = list(positions)
    for j, data in enumerate(encoded):
        file = file_of(positions[j])
        if file not in skipped.files:
            try:
                if isinstance(data, bytes):
                    decode_into(data, batch[j])
                    continue
            except UNREADABLE as e:
                data = e
            skipped.record(file, data)
        used[j] = _next_readable(positions[j], batch[j], skipped=skipped, file_of=file_of, fetch=fetch, length=length)
    return used


def _next_readable(position: int, slot, *, skipped: Skipped, file_of, fetch, length: int) -> int:
    """Decode the first readable sample after `position` into `slot`; its position."""
    from saturate.data.decode import UNREADABLE, decode_into

    for _ in range(length - 1):
        position = (position + 1) % length
        file = file_of(position)
        if file in skipped.files:
            continue
        data = fetch(file)
        try:
            if isinstance(data, bytes):
                decode_into(data, slot)
                return position
        except UNREADABLE as e:
            data = e
        skipped.record(file, data)
    raise DataError(
        f"none of the {length} images in {printable(skipped.where)} can be read (skipped: see the warnings)"
    )
