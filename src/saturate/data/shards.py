"""Image data sets kept as WebDataset tar shards, read by index: for data that has outgrown a
folder of files.

A data set is a wids index (JSON): its shards (`url`, `nsamples`), `classes`, and the
training images' `mean`/`std`, as `saturate make-shards` writes them. Each sample is an
image file's bytes under its extension (`jpg`, `png`, ...) and its class index as text under
`cls` (the WebDataset convention). Samples are read by index, so saturate's samplers, its DDP
sharding and its bit-exact resume work exactly as for image folders. A shard is opened the
first time one of its samples is asked for, with wids' indexed tar reader; each worker
keeps its 10 most recent shards open.

What an index may name is checked before anything is opened: every shard is a **local
file**, its `url` a path relative to the index (or absolute), never a URL, a scheme or a
command. (wids itself would run a `pipe:` url through the shell, and build a shell command
for `http:`, `s3:` and `gs:` ones: saturate never hands it a url.) Every field is checked
for its type and range, and a mistake is one message naming the index file and the field.
Nothing in a shard is unpickled: bytes are decoded as images, `cls` as an integer.

A sample whose image does not decode is skipped as an image folder's broken file is
(saturate.data.skipped): its slot takes the next readable sample, it is named in a
warning and counted in `data/skipped_files`, and from the next start on it is left out.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from saturate import names
from saturate.data.decode import batch_tensor
from saturate.data.image_index import default_cache
from saturate.data.skipped import SkipLog, Skipped, fill
from saturate.errors import ConfigError, DataError, Problem, is_integer, printable

IMAGE_KEYS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif")
OPEN_SHARDS = 10  # per process: the sampler reads from about 4 shards at a time (saturate.data.samplers.GROUP_SPAN)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # pipe:, http:, s3:, file:, ...: anything wids would not just open


@dataclass
class ShardIndex:
    """A checked index: shard files (absolute paths) and their sample counts."""

    path: Path
    files: list[str]
    counts: list[int]
    classes: list[str]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_index(key: str, given: str, channels: int) -> ShardIndex:
    """The index at `given` (data.<key>), every field checked; one DataError naming the file
    and the field otherwise. Nothing it names is opened here but a stat of each shard."""
    path = Path(given).expanduser()
    where = f"data.{key}={printable(given)!r}"

    def bad(field: str, value, allowed: str) -> DataError:
        text = repr(value)
        return DataError(f"{where}: {field}={text if len(text) <= 80 else text[:77] + '...'}: expected {allowed}")

    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DataError(f"{where}: no such file; expected a shard index (saturate make-shards writes one)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{where}: not a readable shard index ({type(e).__name__}: {e})") from None
    try:
        index = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise DataError(f"{where}: not a readable shard index ({type(e).__name__}: {str(e)[:200]})") from None
    shards = index.get("shardlist") if isinstance(index, dict) else None
    if not isinstance(shards, list) or not shards:
        raise DataError(f"{where}: expected a JSON object whose 'shardlist' lists {{'url': ..., 'nsamples': ...}}")
    files, counts = [], []
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict):
            raise bad(f"shardlist[{i}]", shard, "{'url': <a local file>, 'nsamples': <an integer >= 1>}")
        url, count = shard.get("url"), shard.get("nsamples")
        if not isinstance(url, str) or not url.strip():
            raise bad(f"shardlist[{i}].url", url, "the path of a shard file, relative to the index")
        if SCHEME.match(url):
            raise bad(
                f"shardlist[{i}].url",
                url,
                "a local file path relative to the index: saturate opens local files only, never a URL, "
                "a scheme or a command",
            )
        if not is_integer(count, 1):
            raise bad(f"shardlist[{i}].nsamples", count, "an integer >= 1 (the samples in the shard)")
        file = path.parent / url  # relative to the index, as wids resolves them; an absolute path stays itself
        if not file.is_file():
            raise bad(f"shardlist[{i}].url", url, f"an existing shard file (no file at {printable(str(file))})")
        files.append(str(file))
        counts.append(count)
    classes = index.get("classes")
    if not (isinstance(classes, list) and len(classes) >= 2 and all(isinstance(c, str) for c in classes)):
        raise bad("classes", classes, "the list of class names (at least 2), as make_shards writes it")
    stats = {name: index.get(name) for name in ("mean", "std")}
    for name, value in stats.items():
        if value is None:
            continue
        if not (isinstance(value, list) and len(value) == channels and all(_number(v) for v in value)):
            raise bad(name, value, f"a list of {channels} finite numbers, one per channel (data.channels={channels})")
        if name == "std" and min(value) <= 0:
            raise bad(name, value, "standard deviations > 0 (a zero would divide every pixel by zero)")
    if (stats["mean"] is None) != (stats["std"] is None):
        raise bad("std" if stats["std"] is None else "mean", None, "both mean and std, or neither")
    mean, std = (tuple(float(v) for v in stats[n]) if stats[n] is not None else None for n in ("mean", "std"))
    return ShardIndex(path, files, counts, list(classes), mean, std)


class ShardNames:
    """Where each sample is, as text: `<shard file>#<position in it>` (what the skip log and
    the warnings name)."""

    def __init__(self, index: ShardIndex):
        self.files = [os.path.relpath(f, index.path.parent) for f in index.files]
        self.ends = np.cumsum(index.counts)

    def locate(self, i: int) -> tuple[int, int]:
        shard = int(np.searchsorted(self.ends, i, side="right"))
        return shard, i - (int(self.ends[shard - 1]) if shard else 0)

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, i: int) -> str:
        shard, inner = self.locate(i)
        return f"{self.files[shard]}#{inner}"


def skip_log(index: ShardIndex) -> SkipLog:
    """The index's skip log, kept with saturate's cache and keyed by the index file and its
    version (path, size, modification time): shards written again start a new one."""
    stat = index.path.stat()
    key = hashlib.sha256(
        f"{index.path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode("utf-8", "surrogateescape")
    )
    return SkipLog(str(default_cache().parent / "shards" / f"{key.hexdigest()[:24]}.skipped.jsonl"), merge=True)


class ShardImages(Dataset):
    """The samples of a shard index, decoded on access (in the DataLoader's workers), a batch
    straight into one uint8 tensor as for image folders; a sample that does not decode is
    skipped (its slot takes the next readable one), named and counted."""

    returns_batches = True  # __getitems__ returns the collated batch (saturate.data.streaming)

    def __init__(self, key: str, index: ShardIndex, size: int, channels: int, notes: dict):
        self.key, self.index, self.size, self.channels, self.notes = key, index, size, channels, notes
        self.classes = index.classes
        self.names = ShardNames(index)
        self.sample_groups = list(index.counts)  # the sampler shuffles a few shards at a time
        if index.mean is not None:
            self.mean, self.std = index.mean, index.std
        log_ = skip_log(index)
        # left out from the start
        known = {name: i for _, name, _ in log_.new() if (i := self._position(name)) is not None}
        self.skipped = Skipped(index.path.parent, self.names, log_, notes, strict=False, known=set(known))
        self.skipped.files.update(known.values())
        notes[names.SKIPPED_FILES] = notes.get(names.SKIPPED_FILES, 0) + len(known)
        self._open: OrderedDict[int, Any] = OrderedDict()  # wids' readers (an optional library)
        self._pid: int | None = None

    def _position(self, name: str) -> int | None:
        """The sample a skip-log name stands for (None if the index has no such sample)."""
        file, _, inner = name.rpartition("#")
        if file not in self.names.files or not inner.isdigit():
            return None
        shard = self.names.files.index(file)
        start = int(self.names.ends[shard - 1]) if shard else 0
        return start + int(inner) if int(inner) < self.index.counts[shard] else None

    def __len__(self) -> int:
        return len(self.names)

    def poll(self) -> None:
        """Called by the loader in the main process after each batch: names the samples skipped since."""
        self.skipped.poll()

    def _shard(self, shard: int):
        """wids' indexed reader of one local shard file, made in the process that reads (each
        DataLoader worker its own), the OPEN_SHARDS most recent kept open."""
        from wids.wids import IndexedTarSamples

        if self._pid != os.getpid():
            self._open, self._pid = OrderedDict(), os.getpid()
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        file, count = self.index.files[shard], self.index.counts[shard]
        reader = IndexedTarSamples(path=file)
        if len(reader) != count:
            reader.close()
            raise DataError(
                f"data.{self.key}={printable(str(self.index.path))}: shardlist[{shard}].nsamples={count}, but "
                f"{printable(file)} holds {len(reader)} samples; write the index again (saturate make-shards)"
            )
        self._open[shard] = reader
        while len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)[1].close()
        return reader

    def _sample(self, i: int) -> tuple[bytes | Exception, int]:
        """(image bytes, or why they cannot be read; class index) of sample `i`. A shard that
        cannot be opened or a sample without an image or a class is an error naming it."""
        shard, inner = self.names.locate(i)
        where = f"data.{self.key}: sample {printable(self.names[i])}"
        try:
            sample = self._shard(shard)[inner]
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 (a missing, unreadable or truncated shard: name it)
            raise DataError(f"{where}: cannot read it from its shard ({type(e).__name__}: {e})") from None
        image = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
        label = sample.get(".cls")
        if image is None or label is None:
            raise DataError(
                f"{where} has keys {sorted(k for k in sample if not k.startswith('__'))}; expected an image and 'cls'"
            )
        try:
            y = int(label.read().decode().strip())
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{where}: its class is not an integer ({e})") from None
        if not 0 <= y < len(self.classes):
            raise DataError(
                f"{where}: class {y}, outside the index's {len(self.classes)} classes (0 to {len(self.classes) - 1})"
            )
        try:
            return image.read(), y
        except OSError as e:
            return e, y

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([index])
        return x[0].contiguous(), y[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        samples = [self._sample(i) for i in indices]
        first = next((data for data, _ in samples if isinstance(data, bytes)), b"")
        batch = batch_tensor(len(indices), self.size, self.channels, first)
        labels = {i: y for i, (_, y) in zip(indices, samples, strict=True)}

        def fetch(i: int) -> bytes | Exception:
            data, labels[i] = self._sample(i)
            return data

        used = fill(
            batch,
            list(indices),
            [data for data, _ in samples],
            skipped=self.skipped,
            file_of=int,
            fetch=fetch,
            length=len(self),
        )
        return batch, torch.tensor([labels[i] for i in used], dtype=torch.int64)

    def __getstate__(self) -> dict:  # workers open their own readers
        return {**self.__dict__, "_open": OrderedDict(), "_pid": None}


def load_shards(
    *, train: str, val: str | None, image_size: int, channels: int
) -> tuple[ShardImages, ShardImages | None]:
    """The training (and validation) shards named by their wids index files."""
    if not is_integer(image_size, 1):
        raise ConfigError([Problem("data.image_size", image_size, "an integer >= 1")])
    if channels not in (1, 3):
        raise ConfigError([Problem("data.channels", channels, "one of 1, 3")])
    try:
        import wids  # noqa: F401
    except ImportError:
        raise DataError('data=shards needs wids (WebDataset\'s indexed reader): pip install -e ".[shards]"') from None
    notes: dict = {names.SKIPPED_FILES: 0}
    train_set = ShardImages("train", read_index("train", train, channels), image_size, channels, notes)
    val_set = ShardImages("val", read_index("val", val, channels), image_size, channels, notes) if val else None
    if val_set is not None and val_set.classes != train_set.classes:
        raise DataError(
            f"data.val: its classes {val_set.classes[:5]}... differ from data.train's {train_set.classes[:5]}..."
        )
    return train_set, val_set
