from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from saturate.data.base import STATS_SAMPLES, InMemory, channel_stats, fraction, seed
from saturate.data.decode import decode_batch, read
from saturate.data.image_index import FolderIndex, IndexCache, default_cache, index_folder
from saturate.errors import ConfigError, DataError, Problem

log = logging.getLogger(__name__)


class ImageFiles(Dataset):
    """Image files decoded on access (in the DataLoader's workers): `__getitems__` decodes a
    whole batch straight into one uint8 tensor laid out for what the decoder writes
    (saturate.data.decode.batch_tensor; the device pipeline makes the layout the model asks
    for), with no per-sample collate."""

    returns_batches = True  # __getitems__ returns the collated batch (saturate.loader)

    def __init__(self, folder: Path, index: FolderIndex, chosen: np.ndarray, size: int, channels: int):
        self.folder, self.names, self.chosen = str(folder), index.names, chosen  # sample i is file chosen[i] of the index
        self.labels = torch.as_tensor(index.labels[chosen])
        self.size, self.channels = size, channels

    def __len__(self) -> int:
        return len(self.chosen)

    def path(self, index: int) -> str:
        return os.path.join(self.folder, self.names[int(self.chosen[index])])

    def _bytes(self, index: int) -> bytes:
        path = self.path(index)
        try:
            return read(path)
        except OSError as e:
            raise DataError(f"cannot read {path} ({type(e).__name__}: {e}); it was listed at start-up: was it moved?") from None

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([index])
        return x[0].contiguous(), y[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch (N, C, H, W): channels last in memory when the files are already at
        image_size, contiguous when they are resized (saturate.data.decode.batch_tensor)."""

        def failure(j: int, e: Exception) -> DataError:
            return DataError(f"cannot read {self.path(indices[j])} ({type(e).__name__}: {e}); its first and last bytes looked whole "
                             "at start-up: remove or replace it")  # fmt: skip

        batch = decode_batch([self._bytes(i) for i in indices], self.size, self.channels, failure)
        return batch, self.labels[torch.as_tensor(indices, dtype=torch.int64)]

    def materialize(self) -> InMemory:
        """Decode every file now, into one uint8 tensor in memory (for the resident loader)."""
        images, labels = self.__getitems__(list(range(len(self))))
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


def _stats(dataset: ImageFiles, index: FolderIndex, cache: IndexCache, split: str) -> None:
    """Per-channel mean/std from a fixed sample of the training images, one image at a time
    (constant memory in the image size), cached with the folder's index under the image size
    and the split that chose the training images."""
    key = f"{dataset.size} {split}"
    if key not in index.stats:
        chosen = random.Random(0).sample(range(len(dataset)), min(len(dataset), STATS_SAMPLES))
        mean, std = channel_stats(dataset[i][0] for i in chosen)
        index.stats[key] = [list(mean), list(std)]
        cache.store(index)
    dataset.mean, dataset.std = (tuple(v) for v in index.stats[key])


def load_image_folder(*, root: str, image_size: int, channels: int, val_fraction: float, split_seed: int, strict: bool,
                      index_cache: str | None = None) -> tuple[ImageFiles, ImageFiles]:  # fmt: skip
    """Class sub-folders under `data.root` (root/<class>/*.png|jpg|...). If root has train/
    and val/ sub-folders, those are the split; otherwise a stratified `val_fraction` split.
    Every file is checked at start-up (saturate.data.image_index: its first and last bytes,
    a full decode where they do not look whole; cached, so the next run checks only what
    changed): unreadable, truncated or non-image files are skipped, each named in a warning
    and counted (metrics `data/skipped_files`), or with data.strict=true the first one is an
    error naming the file. `index_cache`: where the check results and colour statistics
    are kept (null: ~/.cache/saturate/image_index, "": nowhere)."""
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ConfigError([Problem("data.image_size", image_size, "an integer >= 1")])
    if channels not in (1, 3):
        raise ConfigError([Problem("data.channels", channels, "one of 1, 3")])
    fraction("val_fraction", val_fraction)
    seed("split_seed", split_seed)
    if not str(root).strip():
        raise ConfigError([Problem("data.root", root, "a folder of class sub-folders (empty: it would scan the working directory)")])
    given, root = root, Path(root).expanduser()
    if not root.is_dir():
        raise DataError(f"data.root={given!r}: no such folder; expected class sub-folders (root/<class>/<image files>)")
    split = (root / "train").is_dir() and (root / "val").is_dir()
    base = root / "train" if split else root
    try:
        classes = sorted(p.name for p in base.iterdir() if p.is_dir())
    except OSError as e:
        raise DataError(f"data.root={given!r}: cannot read {base} ({e.strerror})") from None
    if len(classes) < 2:
        raise DataError(f"data.root={given!r}: found {len(classes)} class sub-folder(s) in {base}; need at least 2")
    cache_dir = default_cache() if index_cache is None else (Path(index_cache).expanduser() if str(index_cache).strip() else None)
    cache = IndexCache(cache_dir, base, channels)
    index = index_folder(base, classes, cache, strict=strict, channels=channels)
    readable = index.readable()
    skipped = len(index.bad)
    if split:
        val_index = index_folder(root / "val", classes, IndexCache(cache_dir, root / "val", channels), strict=strict, channels=channels)
        train_chosen, val_chosen, val_base = readable, val_index.readable(), root / "val"
        skipped += len(val_index.bad)
    else:
        train_at, val_at = _split(index.labels[readable], len(classes), val_fraction, split_seed)
        train_chosen, val_chosen, val_base, val_index = readable[train_at], readable[val_at], base, index
    if not len(train_chosen) or not len(val_chosen):
        raise DataError(f"data.root={given!r}: no readable images for {'training' if not len(train_chosen) else 'validation'}")

    train = ImageFiles(base, index, train_chosen, image_size, channels)
    val = ImageFiles(val_base, val_index, val_chosen, image_size, channels)
    train.classes, train.notes = classes, {"data/skipped_files": skipped}
    _stats(train, index, cache, "train/" if split else f"{val_fraction} {split_seed}")
    log.info("image_folder: %d classes, %d train / %d val images, %d skipped", len(classes), len(train), len(val), skipped)
    return train, val
