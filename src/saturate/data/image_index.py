"""What an image folder holds: every file of every class, which of them are known to be
unreadable, and their colour statistics. Found in O(files) and cached per folder.

Files are not opened at start-up: the DataLoader's workers meet a broken file when they
decode it, skip it (its slot in the batch takes the next readable image, so batches keep
their shape) and record it in the folder's skip log (`SkipLog`), from which the main process
names it in a warning and counts it (`data/skipped_files`); the next start leaves it out.
With `data.check=true` every file not yet checked is checked at start-up instead (with
`data.strict=true` too, and the first broken one is an error). The check reads each file's
first and last bytes: a JPEG that starts with its SOI marker and ends with its EOI marker, or
a PNG that starts with its signature and ends with its IEND chunk, is taken as whole (a
truncated file loses its end marker). Any other file, and any that fails, is decoded in
full, which decides.

The listing and the results are cached (`<cache>/<folder key>.npz`, plain arrays: nothing in
it can run code) with the modification time of every directory listed. A directory whose
time is unchanged has the same entries (adding, removing or renaming a file changes it), so
the next run reads the cache instead of the folder: one stat per directory, none per file.
Where a directory changed, it is listed again and files the cache knows keep what is known.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from saturate.data.skipped import SkipLog
from saturate.errors import DataError, printable

log = logging.getLogger(__name__)

VERSION = 2
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
    good: np.ndarray | None = None  # bool, per file: not known to be unreadable
    checked: np.ndarray | None = None  # bool, per file: checked (data.check or strict), or found unreadable
    bad: dict[str, str] = field(default_factory=dict)  # relative path -> why it is not a readable image
    directories: dict[str, int] = field(default_factory=dict)  # relative path -> st_mtime_ns, every directory listed
    stats: dict[str, list] = field(default_factory=dict)  # image size -> [mean, std]
    dirty: bool = False  # changed since it was read from the cache

    def readable(self) -> np.ndarray:
        """Indices of the files not known to be unreadable."""
        assert self.good is not None, "index_folder marks every file"
        return np.flatnonzero(self.good)

    def mark_bad(self, i: int, reason: str) -> None:
        assert self.good is not None and self.checked is not None, "index_folder marks every file"
        self.bad[self.names[i]], self.good[i], self.checked[i], self.dirty = reason, False, True, True


def _unlisted(path: str, error: OSError) -> DataError:
    return DataError(
        f"data.root: cannot read the folder {printable(path)} ({error.strerror}); its images would be lost"
    )


def _walk(folder: str, relative: str, names: list[str], directories: dict[str, int]) -> None:
    """Every regular file below folder/relative, sorted, into `names`; each directory's
    modification time into `directories`. No stat per file: scandir's entry types."""
    path = os.path.join(folder, relative)
    files, subdirectories = [], []
    try:
        directories[relative] = os.stat(path).st_mtime_ns
        with os.scandir(path) as it:
            for entry in it:
                if entry.is_dir():
                    subdirectories.append(entry.name)
                elif entry.is_file():
                    files.append(entry.name)
    except OSError as e:
        raise _unlisted(path, e) from None
    prefix = relative + os.sep if relative else ""
    if not subdirectories:
        names.extend([prefix + name for name in sorted(files)])
        return
    below = set(subdirectories)
    for name in sorted(files + subdirectories):  # one order for both, as a listing sorted by name
        if name in below:
            _walk(folder, prefix + name, names, directories)
        else:
            names.append(prefix + name)


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
            raise DataError(
                f"data.root: the class folder {printable(str(folder / name))} holds no files; remove it or add its "
                "images"
            )
        labels += [label] * (len(names) - before)
    return FolderIndex(PathTable.of(names), np.asarray(labels, dtype=np.int64), directories=directories), names


def _looks_whole(path: str) -> bool:
    """A JPEG with both its markers, or a PNG with its signature, a size PIL will open (its
    IHDR chunk) and its IEND chunk. Two preads on one descriptor: cheaper per file than a
    Python file object through open(). A PNG over PIL's decompression-bomb limit
    is not whole: the full decode then names it (the reader would refuse it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # unreadable: the full decode says why
        return False
    try:
        head = os.pread(fd, 24, 0)
        size = os.fstat(fd).st_size
        if size < 24:
            return False
        tail = os.pread(fd, 12, size - 12)
    finally:
        os.close(fd)
    if head[:3] == b"\xff\xd8\xff":  # decoded by libjpeg-turbo at any size (scaled down in the DCT domain)
        return tail[-2:] == b"\xff\xd9"
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    # where PIL raises DecompressionBombError
    fits = Image.MAX_IMAGE_PIXELS is None or width * height <= 2 * Image.MAX_IMAGE_PIXELS
    return head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR" and fits and tail == PNG_END


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
        key = hashlib.sha256(f"{folder.resolve()}\0{channels}".encode("utf-8", "surrogateescape")).hexdigest()[:24]
        self.path = directory / f"{key}.npz" if directory is not None else None
        if directory is not None:
            self.skip_log = SkipLog(str(directory / f"{key}.skipped.jsonl"), merge=True)
        else:  # the run's own log, in the temporary directory: per process, or per torchrun launch (its ranks share it)
            run = os.getppid() if "LOCAL_RANK" in os.environ else os.getpid()
            self.skip_log = SkipLog(
                os.path.join(tempfile.gettempdir(), f"saturate-{key}-{run}.skipped.jsonl"), merge=False
            )

    def load(self) -> FolderIndex | None:
        """The cached index, or None when there is none or it does not hold together (a
        damaged, truncated, foreign or tampered file: rebuilt with a warning naming it)."""
        if self.path is None or not self.path.is_file():
            return None
        try:
            with np.load(self.path, allow_pickle=False) as saved:
                if int(saved["version"]) != VERSION:
                    return None
                meta = json.loads(saved["meta"].tobytes())
                index = FolderIndex(
                    PathTable(saved["buffer"], saved["offsets"]),
                    saved["labels"],
                    good=saved["good"].copy(),
                    checked=saved["checked"].copy(),
                    bad=meta["bad"],
                    directories=meta["directories"],
                    stats=meta["stats"],
                )
            problem = _inconsistent(index)
        except Exception as e:  # noqa: BLE001 (damaged, truncated or foreign: rebuilt, never fatal)
            problem = f"{type(e).__name__}: {e}"
        if problem is None:
            return index
        log.warning(
            "image index cache %s is damaged (%s); checking the folder again",
            printable(str(self.path)),
            printable(problem),
        )
        return None

    def store(self, index: FolderIndex) -> None:
        """Write atomically; a cache that cannot be written is a warning (the next run checks again)."""
        if self.path is None:
            return
        meta = {"bad": index.bad, "directories": index.directories, "stats": index.stats}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp.npz")
            assert index.good is not None and index.checked is not None, "index_folder marks every file"
            np.savez(
                tmp,
                version=np.array(VERSION),
                meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                buffer=index.names.buffer,
                offsets=index.names.offsets,
                labels=index.labels,
                good=index.good,
                checked=index.checked,
            )
            os.replace(tmp, self.path)
            index.dirty = False
        except OSError as e:
            log.warning(
                "image index cache %s cannot be written (%s); the next run checks the folder again", self.path, e
            )


def _inconsistent(index: FolderIndex) -> str | None:
    """What does not hold together in an index read from the cache (None: it does): arrays
    of one length per file and of their dtypes, offsets that cut the names' buffer, labels
    in range, and the metadata's types. A cache that fails is rebuilt."""
    n, offsets = len(index.labels), index.names.offsets
    arrays = {
        "labels": (index.labels, np.int64, n),
        "good": (index.good, np.bool_, n),
        "checked": (index.checked, np.bool_, n),
        "offsets": (offsets, np.int64, n + 1),
        "buffer": (index.names.buffer, np.uint8, None),
    }
    for name, (array, dtype, length) in arrays.items():
        if (
            not isinstance(array, np.ndarray)
            or array.dtype != dtype
            or array.ndim != 1
            or (length is not None and len(array) != length)
        ):
            return f"{name}: expected a 1-d {np.dtype(dtype).name} array" + (
                f" of {length} values" if length is not None else ""
            )
    if offsets[0] != 0 or offsets[-1] != len(index.names.buffer) or (np.diff(offsets) < 0).any():
        return "offsets: they do not cut the names' buffer"
    if n and (index.labels.min() < 0):
        return "labels: a negative class index"
    if not (
        isinstance(index.bad, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in index.bad.items())
    ):
        return "meta.bad: expected {name: reason}"
    if not (
        isinstance(index.directories, dict)
        and all(isinstance(k, str) and type(v) is int for k, v in index.directories.items())
    ):
        return "meta.directories: expected {directory: modification time}"
    if not (isinstance(index.stats, dict) and all(_mean_std(v) for v in index.stats.values())):
        return "meta.stats: expected {size: [mean, std]} of finite numbers, std > 0"
    return None


def _mean_std(value) -> bool:
    """[mean, std]: two lists of finite numbers, the std's positive."""
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(c, list) and c for c in value)):
        return False
    numbers = all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for c in value for x in c
    )
    return numbers and all(x > 0 for x in value[1])


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


def _check(folder: Path, name: str, mode: str) -> str | None:
    path = os.path.join(folder, name)
    return None if _looks_whole(path) else unreadable(path, mode)


def index_folder(
    folder: Path, classes: list[str], cache: IndexCache, *, strict: bool, channels: int, check: bool = False
) -> FolderIndex:
    """The folder's index: from the cache when no directory changed, else listed (files the
    cache knows keep what is known of them), with what the skip log recorded since. With
    `check` or `strict`, every file not yet checked is checked now (`strict`: the first broken
    one is an error); otherwise files are checked when they are decoded. Files known to be
    broken are named in a warning. The caller stores the index when it is `dirty`."""
    cached = cache.load()
    if cached is not None and len(cached.labels) and cached.labels.max() >= len(classes):
        log.warning(
            "image index cache %s is damaged (labels: a class index >= %d classes); checking the folder again",
            printable(str(cache.path)),
            len(classes),
        )
        cached = None
    if cached is not None and _unchanged(folder, classes, cached):
        index = cached
    else:
        index, names = list_classes(folder, classes)
        index.good, index.checked, index.dirty = np.ones(len(names), dtype=bool), np.zeros(len(names), dtype=bool), True
        if cached is not None:
            assert cached.checked is not None  # a loaded index has them
            known = {cached.names[i]: i for i in range(len(cached.names))}
            for i, name in enumerate(names):
                j = known.get(name)
                if j is not None:
                    index.checked[i] = cached.checked[j]
                    if name in cached.bad:
                        index.mark_bad(i, cached.bad[name])
            index.stats = cached.stats if len(known) == len(names) and all(name in known for name in names) else {}
    log_entries = cache.skip_log.new()  # everything an earlier run recorded: the offset is now at the end
    if cache.skip_log.merge and log_entries:
        position = {index.names[i]: i for i in range(len(index.names))}
        for _, name, reason in log_entries:
            if name in position and name not in index.bad:
                index.mark_bad(position[name], reason)
    if strict:
        for name, reason in sorted(index.bad.items())[:1]:
            raise DataError(
                f"data.strict=true: {printable(os.path.join(folder, name))} is not a readable image ({reason})"
            )
    if strict or check:
        mode = "L" if channels == 1 else "RGB"
        assert index.checked is not None  # marked above, or loaded with the index
        for at in np.flatnonzero(~index.checked):
            name = index.names[int(at)]
            problem = _check(folder, name, mode)
            if problem is None:
                index.checked[at], index.dirty = True, True
                continue
            index.mark_bad(int(at), problem)
            if strict:
                cache.store(index)  # what was checked so far is kept
                raise DataError(
                    f"data.strict=true: {printable(os.path.join(folder, name))} is not a readable image ({problem})"
                )
    for name, reason in sorted(index.bad.items()):
        log.warning("skipping %s: not a readable image (%s)", printable(os.path.join(folder, name)), printable(reason))
    return index
