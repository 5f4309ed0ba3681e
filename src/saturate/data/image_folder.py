"""`data=image_folder`: class sub-folders of image files, decoded in the loader's workers.

Files are listed, not opened, at start-up (saturate.data.image_index; cached, so the next
run lists only directories that changed). An unreadable, truncated or non-image file is
skipped when it is first decoded (its slot takes the next readable image), named in a
warning and counted (metrics `data/skipped_files`), and left out from the next start on.
With data.check=true every file is checked at start-up instead (its first and last bytes, a
full decode where they do not look whole; once per file, cached), so broken files are named
before training; with data.strict=true too, and the first broken one is an error naming it
(a file that breaks later is an error when it is read).
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from saturate import names
from saturate.data.decode import batch_tensor, read, read_many, will_read
from saturate.data.image_index import FolderIndex, IndexCache, default_cache, index_folder
from saturate.data.image_stats import STATS_SAMPLES, channel_stats
from saturate.data.in_memory import InMemory
from saturate.data.options import fraction, seed
from saturate.data.skipped import Skipped, fill
from saturate.errors import ConfigError, DataError, Problem, is_integer, printable

log = logging.getLogger(__name__)


class ImageFiles(Dataset):
    """Image files decoded on access (in the DataLoader's workers): `__getitems__` decodes a
    whole batch straight into one uint8 tensor laid out for what the decoder writes
    (saturate.data.decode.batch_tensor; the device pipeline makes the layout the model asks
    for), with no per-sample collate. A file that does not decode is recorded (`Skipped`)
    and its slot takes the next readable image of the data set: batches keep their shape,
    and the same files give the same batches."""

    returns_batches = True  # __getitems__ returns the collated batch (saturate.data.streaming)
    # set by load_image_folder on the training set (the data contract, saturate.data.base):
    # declared, never defaulted, so that the validation set has none
    classes: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __init__(
        self, folder: Path, index: FolderIndex, chosen: np.ndarray, size: int, channels: int, skipped: Skipped
    ):
        # sample i is file chosen[i] of the index
        self.folder, self.names, self.chosen = (
            str(folder),
            index.names,
            chosen,
        )
        self.labels = torch.as_tensor(index.labels[chosen])
        self.size, self.channels, self.skipped, self.notes = size, channels, skipped, skipped.notes

    def __len__(self) -> int:
        return len(self.chosen)

    def path(self, index: int) -> str:
        return os.path.join(self.folder, self.names[int(self.chosen[index])])

    def poll(self) -> None:
        """Called by the loader in the main process after each batch: names the files skipped since."""
        self.skipped.poll()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([index])
        return x[0].contiguous(), y[0]

    def _read(self, file: int) -> bytes | OSError:
        try:
            return read(os.path.join(self.folder, self.names[file]))
        except OSError as e:
            return e

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch (N, C, H, W): channels last in memory when the files are already at
        image_size, contiguous when they are resized (saturate.data.decode.batch_tensor).
        All files are read, then decoded: the reads are issued together rather than each
        waiting for the previous image's decode."""
        files = self.chosen[indices].tolist()
        encoded = read_many([os.path.join(self.folder, self.names[file]) for file in files])
        first = next((data for data in encoded if isinstance(data, bytes)), b"")
        batch = batch_tensor(len(indices), self.size, self.channels, first)
        used = fill(
            batch,
            list(indices),
            encoded,
            skipped=self.skipped,
            file_of=lambda i: int(self.chosen[i]),
            fetch=self._read,
            length=len(self),
        )
        return batch, self.labels[torch.as_tensor(used, dtype=torch.int64)]

    def materialize(self) -> InMemory:
        """Decode every file now, into one uint8 tensor in memory (for the resident loader);
        files that do not decode are left out."""
        images, labels = self.__getitems__(list(range(len(self))))
        self.poll()
        if self.skipped.files:
            keep = torch.as_tensor(np.flatnonzero(~np.isin(self.chosen, list(self.skipped.files))))
            images, labels = images[keep], labels[keep]
        return InMemory(images.contiguous(), labels)


def _split(labels: np.ndarray, classes: int, val_fraction: float, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A stratified split in O(files): one seeded shuffle of every index, then the first
    `val_fraction` of each class in that order is validation."""
    order = list(range(len(labels)))
    random.Random(split_seed).shuffle(order)
    shuffled = np.asarray(order, dtype=np.int64)
    grouped = shuffled[np.argsort(labels[shuffled], kind="stable")]  # by class, shuffled order kept within each
    counts = np.bincount(labels, minlength=classes)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    is_val = np.zeros(len(labels), dtype=bool)
    for start, count in zip(starts, counts, strict=True):
        is_val[grouped[start : start + round(count * val_fraction)]] = True
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


def _stats(dataset: ImageFiles, index: FolderIndex, split: str) -> None:
    """Per-channel mean/std from a fixed sample of the training images, decoded a batch at a
    time (memory bounded in the image size), kept with the folder's index under the image
    size and the split that chose the training images."""
    key = f"{dataset.size} {split}"
    if key not in index.stats:
        chosen = random.Random(0).sample(range(len(dataset)), min(len(dataset), STATS_SAMPLES))
        will_read(dataset.path(i) for i in chosen)
        chunk = max(1, (1 << 20) // (dataset.channels * dataset.size**2))  # about 1 MB of pixels at a time
        mean, std = channel_stats(dataset.__getitems__(chosen[i : i + chunk])[0] for i in range(0, len(chosen), chunk))
        index.stats[key], index.dirty = [list(mean), list(std)], True
    dataset.mean, dataset.std = (tuple(v) for v in index.stats[key])


def _check_args(root, image_size, channels, val_fraction, split_seed, strict, check) -> None:
    if not is_integer(image_size, 1):
        raise ConfigError([Problem("data.image_size", image_size, "an integer >= 1")])
    if channels not in (1, 3):
        raise ConfigError([Problem("data.channels", channels, "one of 1, 3")])
    fraction("val_fraction", val_fraction)
    seed("split_seed", split_seed)
    for key, value in (("check", check), ("strict", strict)):
        if not isinstance(value, bool):
            raise ConfigError([Problem(f"data.{key}", value, "true or false")])
    if not str(root).strip():
        raise ConfigError(
            [Problem("data.root", root, "a folder of class sub-folders (empty: it would scan the working directory)")]
        )


def _classes(given: str, root: Path, base: Path) -> list[str]:
    """The class sub-folders' names, sorted (at least two)."""
    if not root.is_dir():
        raise DataError(f"data.root={given!r}: no such folder; expected class sub-folders (root/<class>/<image files>)")
    try:
        classes = sorted(p.name for p in base.iterdir() if p.is_dir())
    except OSError as e:
        raise DataError(f"data.root={printable(given)!r}: cannot read {printable(str(base))} ({e.strerror})") from None
    if len(classes) < 2:
        raise DataError(
            f"data.root={printable(given)!r}: found {len(classes)} class sub-folder(s) in {printable(str(base))}; "
            "need at least 2"
        )
    return classes


def load_image_folder(
    *,
    root: str,
    image_size: int,
    channels: int,
    val_fraction: float,
    split_seed: int,
    strict: bool,
    check: bool = False,
    index_cache: str | None = None,
) -> tuple[ImageFiles, ImageFiles]:
    """Class sub-folders under `data.root` (root/<class>/*.png|jpg|...). If root has train/
    and val/ sub-folders, those are the split; otherwise a stratified `val_fraction` split
    of every file listed (so the split does not move when a broken file is found).
    `index_cache`: where the index, what is known of its files and the colour statistics are
    kept (null: ~/.cache/saturate/image_index, "": nowhere)."""
    _check_args(root, image_size, channels, val_fraction, split_seed, strict, check)
    given, top = root, Path(root).expanduser()
    split = (top / "train").is_dir() and (top / "val").is_dir()
    base = top / "train" if split else top
    classes = _classes(given, top, base)
    cache_dir = _cache_dir(index_cache)
    cache = IndexCache(cache_dir, base, channels)
    index = index_folder(base, classes, cache, strict=strict, channels=channels, check=check)
    notes = {names.SKIPPED_FILES: len(index.bad)}
    skipped = Skipped(base, index.names, cache.skip_log, notes, strict=strict, known=set(index.bad))
    if split:
        val_base = top / "val"
        val_index, val_skipped = _val_folder(
            val_base, classes, cache_dir, notes, strict=strict, channels=channels, check=check
        )
        train_chosen, val_chosen = index.readable(), val_index.readable()
    else:
        train_at, val_at = _split(index.labels, len(classes), val_fraction, split_seed)
        assert index.good is not None  # index_folder marks every file
        train_chosen, val_chosen = train_at[index.good[train_at]], val_at[index.good[val_at]]
        val_base, val_index, val_skipped = base, index, skipped
    if not len(train_chosen) or not len(val_chosen):
        empty = "training" if not len(train_chosen) else "validation"
        raise DataError(f"data.root={given!r}: no readable images for {empty}")

    train = ImageFiles(base, index, train_chosen, image_size, channels, skipped)
    val = ImageFiles(val_base, val_index, val_chosen, image_size, channels, val_skipped)
    train.classes = classes
    _stats(train, index, "train/" if split else f"{val_fraction} {split_seed}")
    if index.dirty:
        cache.store(index)
    train.poll()  # broken files among those the statistics read
    skipped_so_far = notes[names.SKIPPED_FILES]
    log.info(
        "image_folder: %d classes, %d train / %d val images, %d skipped so far",
        len(classes),
        len(train),
        len(val),
        skipped_so_far,
    )
    return train, val


def _cache_dir(index_cache: str | None) -> Path | None:
    """Where the index is kept: null for the default, "" for nowhere."""
    if index_cache is None:
        return default_cache()
    return Path(index_cache).expanduser() if str(index_cache).strip() else None


def _val_folder(val_base: Path, classes, cache_dir, notes: dict, *, strict: bool, channels: int, check: bool):
    """The index of a val/ folder beside train/, and its record of skipped files."""
    val_cache = IndexCache(cache_dir, val_base, channels)
    val_index = index_folder(val_base, classes, val_cache, strict=strict, channels=channels, check=check)
    notes[names.SKIPPED_FILES] += len(val_index.bad)
    val_skipped = Skipped(val_base, val_index.names, val_cache.skip_log, notes, strict=strict, known=set(val_index.bad))
    if val_index.dirty:
        val_cache.store(val_index)
    return val_index, val_skipped
