"""What an image folder holds: every file of every class, which of them are readable images,
and their colour statistics. Found in O(files), checked cheaply, cached per folder.

The check reads each file's first and last bytes: a JPEG that starts with its SOI marker and
ends with its EOI marker, or a PNG that starts with its signature and ends with its IEND
chunk, is taken as whole (a truncated file loses its end marker). Any other file, and any
that fails, is decoded in full, which decides: a broken one is skipped and named in a
warning (data.strict=true: the first is an error).

The listing and the results are cached (`<cache>/<folder key>.npz`, plain arrays: nothing in
it can run code) with the modification time of every directory listed. A directory whose
time is unchanged has the same entries (adding, removing or renaming a file changes it), so
the next run reads the cache instead of the folder: one stat per directory, none per file.
Where a directory changed, it is listed again and only files new to the cache are checked.
A file rewritten in place keeps its directory's time: if it no longer decodes, the worker
that meets it stops the run with a message naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from saturate.errors import DataError

log = logging.getLogger(__name__)

VERSION = 1
PNG_SIGNATURE, PNG_END = b"\x89PNG\r\n\x1a\n", b"\x00\x00\x00\x00IEND\xaeB`\x82"


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "saturate" / "image_index"


class PathTable:
    """Many paths as one bytes buffer and an offsets array: two objects, not a million
    strings, so DataLoader workers do not copy it page by page as reference counts change."""

    def __init__(self, buffer: np.ndarray, offsets: np.ndarray):
        self.buffer, self.offsets = buffer, offsets

    @classmethod
    def of(cls, paths: list[str]) -> PathTable:
        encoded = [p.encode("utf-8", "surrogateescape") for p in paths]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        return self.buffer[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8", "surrogateescape")


@dataclass
class FolderIndex:
    """A folder's files, class by class (paths relative to the folder), and what is known of them."""

    names: PathTable
    labels: np.ndarray  # int64, per file
    good: np.ndarray | None = None  # bool, per file: a readable image
    bad: dict[str, str] = field(default_factory=dict)  # relative path -> why it is not a readable image
    directories: dict[str, int] = field(default_factory=dict)  # relative path -> st_mtime_ns, every directory listed
    stats: dict[str, list] = field(default_factory=dict)  # image size -> [mean, std]

    def readable(self) -> np.ndarray:
        """Indices of the files that are readable images."""
        return np.flatnonzero(self.good)


def _unlisted(path: str, error: OSError) -> DataError:
    return DataError(f"data.root: cannot read the folder {path} ({error.strerror}); its images would be lost")


def _walk(folder: str, relative: str, names: list[str], directories: dict[str, int]) -> None:
    """Every regular file below folder/relative, sorted, into `names`; each directory's
    modification time into `directories`. No stat per file: scandir's entry types."""
    path = os.path.join(folder, relative)
    try:
        directories[relative] = os.stat(path).st_mtime_ns
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as e:
        raise _unlisted(path, e) from None
    for entry in entries:
        if entry.is_dir():
            _walk(folder, os.path.join(relative, entry.name), names, directories)
        elif entry.is_file():
            names.append(os.path.join(relative, entry.name))


def list_classes(folder: Path, classes: list[str]) -> tuple[FolderIndex, list[str]]:
    """Every regular file below folder/<class>, class by class (the index, and the names as
    strings); an empty class or a folder that cannot be read is an error naming it."""
    names: list[str] = []
    labels: list[int] = []
    directories: dict[str, int] = {}
    for label, name in enumerate(classes):
        before = len(names)
        _walk(str(folder), name, names, directories)
        if len(names) == before:
            raise DataError(f"data.root: the class folder {folder / name} holds no files; remove it or add its images")
        labels += [label] * (len(names) - before)
    return FolderIndex(PathTable.of(names), np.asarray(labels, dtype=np.int64), directories=directories), names


def _looks_whole(path: str) -> bool:
    """A JPEG with both its markers, or a PNG with its signature and IEND chunk. Two preads
    on one descriptor: 5.7 us per file against 9.3 us through open() (measured, 64 px JPEGs)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # unreadable: the full decode says why
        return False
    try:
        head = os.pread(fd, 8, 0)
        size = os.fstat(fd).st_size
        if size < 20:
            return False
        tail = os.pread(fd, 12, size - 12)
    finally:
        os.close(fd)
    if head[:3] == b"\xff\xd8\xff":
        return tail[-2:] == b"\xff\xd9"
    return head == PNG_SIGNATURE and tail == PNG_END


def unreadable(path: str, mode: str) -> str | None:
    """None if the file decodes in full and converts to `mode`, else why not."""
    try:
        with Image.open(path) as img:
            img.load()
            try:
                img.convert(mode)
            except ValueError:  # no direct conversion (CMYK to L): the decoder goes through RGB
                img.convert("RGB").convert(mode)
        return None
    except Exception as e:  # noqa: BLE001 (whatever PIL raises, the file is not an image saturate can use)
        return f"{type(e).__name__}: {e}"


class IndexCache:
    """Where a folder's index is kept: keyed by the folder's absolute path and the channels."""

    def __init__(self, directory: Path | None, folder: Path, channels: int):
        key = hashlib.sha256(f"{folder.resolve()}\0{channels}".encode()).hexdigest()[:24]
        self.path = directory / f"{key}.npz" if directory is not None else None

    def load(self) -> FolderIndex | None:
        if self.path is None or not self.path.is_file():
            return None
        try:
            with np.load(self.path, allow_pickle=False) as saved:
                if int(saved["version"]) != VERSION:
                    return None
                meta = json.loads(saved["meta"].tobytes())
                return FolderIndex(PathTable(saved["buffer"], saved["offsets"]), saved["labels"], good=saved["good"], bad=meta["bad"],
                                   directories=meta["directories"], stats=meta["stats"])  # fmt: skip
        except Exception as e:  # noqa: BLE001 (damaged, truncated or foreign: rebuilt, never fatal)
            log.warning("image index cache %s is unreadable (%s); checking the folder again", self.path, e)
            return None

    def store(self, index: FolderIndex) -> None:
        """Write atomically; a cache that cannot be written is a warning (the next run checks again)."""
        if self.path is None:
            return
        meta = {"bad": index.bad, "directories": index.directories, "stats": index.stats}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp.npz")
            arrays = {"buffer": index.names.buffer, "offsets": index.names.offsets, "labels": index.labels, "good": index.good}
            np.savez(tmp, version=np.array(VERSION), meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("image index cache %s cannot be written (%s); the next run checks the folder again", self.path, e)


def _unchanged(folder: Path, classes: list[str], cached: FolderIndex) -> bool:
    """Whether every directory the cache listed still has its modification time, and the
    classes are the same."""
    if {d for d in cached.directories if os.sep not in d} != set(classes):
        return False
    for relative, mtime in cached.directories.items():
        try:
            if os.stat(os.path.join(folder, relative)).st_mtime_ns != mtime:
                return False
        except OSError:
            return False
    return True


def index_folder(folder: Path, classes: list[str], cache: IndexCache, *, strict: bool, channels: int) -> FolderIndex:
    """The folder's index: from the cache when no directory changed, else listed and
    checked (files the cache knows keep their verdict). Broken files are named in a
    warning, or with `strict` the first is an error."""
    cached = cache.load()
    if cached is not None and _unchanged(folder, classes, cached):
        index = cached
    else:
        index, names = list_classes(folder, classes)
        known = set()
        if cached is not None:
            known = {cached.names[i] for i in range(len(cached.names))}
            index.stats = cached.stats if set(names) == known else {}
        mode = "L" if channels == 1 else "RGB"
        index.good = np.ones(len(names), dtype=bool)
        for i, name in enumerate(names):
            if name in known:
                reason = cached.bad.get(name)
            else:
                path = os.path.join(folder, name)
                reason = None if _looks_whole(path) else unreadable(path, mode)
            if reason is not None:
                index.bad[name], index.good[i] = reason, False
        cache.store(index)
    for name, reason in sorted(index.bad.items()):
        path = os.path.join(folder, name)
        if strict:
            raise DataError(f"data.strict=true: {path} is not a readable image ({reason})")
        log.warning("skipping %s: not a readable image (%s)", path, reason)
    return index
