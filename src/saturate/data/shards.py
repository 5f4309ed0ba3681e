"""Image data sets kept as WebDataset tar shards, read by index with `wids` (WebDataset's
indexed reader): for data that has outgrown a folder of files, or lives on another disk.

A data set is a wids index (JSON): its shards (`url`, `nsamples`; a relative url is
relative to the index file), plus `classes` and the training images' `mean`/`std`, as
`scripts/make_shards.py` writes them. Each sample is an image file's bytes under its
extension (`jpg`, `png`, ...) and its class index as text under `cls` (the WebDataset
convention). Samples are read by index, so saturate's samplers, its DDP sharding and its
bit-exact resume work exactly as for image folders. A shard is opened (and, for a remote
url, copied into `cache_dir` whole) the first time one of its samples is asked for; each
worker keeps its 10 most recent shards open. Nothing is unpickled: bytes are decoded as
images, `cls` as an integer.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from urllib.parse import quote

import torch
from torch.utils.data import Dataset

from saturate.data.decode import decode_batch
from saturate.errors import ConfigError, DataError, Problem

IMAGE_KEYS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif")


def _read_index(key: str, given: str) -> dict:
    path = Path(given).expanduser()
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"data.{key}={given!r}: no such file; expected a shard index (scripts/make_shards.py writes one)") from None
    except (OSError, ValueError) as e:
        raise DataError(f"data.{key}={given!r}: not a readable shard index ({type(e).__name__}: {e})") from None
    shards = index.get("shardlist") if isinstance(index, dict) else None
    if not shards or not all(isinstance(s, dict) and isinstance(s.get("url"), str) and isinstance(s.get("nsamples"), int) for s in shards):
        raise DataError(f"data.{key}={given!r}: expected a JSON object whose 'shardlist' lists {{'url': ..., 'nsamples': ...}}")
    for shard in shards:  # relative to the index file, as wids resolves them
        if "://" not in shard["url"] and not os.path.isabs(shard["url"]):
            shard["url"] = str(path.parent / shard["url"])
    return index


class ShardImages(Dataset):
    """The samples of a shard index, decoded on access (in the DataLoader's workers), a batch
    straight into one channels-last uint8 tensor as for image folders."""

    returns_batches = True  # __getitems__ returns the collated batch (saturate.loader)

    def __init__(self, key: str, index: dict, size: int, channels: int, cache_dir: str | None):
        self.key, self.shards, self.size, self.channels, self.cache_dir = key, index["shardlist"], size, channels, cache_dir
        self.classes = list(index.get("classes") or [])
        self.length = sum(s["nsamples"] for s in self.shards)
        self.sample_groups = [s["nsamples"] for s in self.shards]  # the sampler shuffles a few shards at a time
        if "mean" in index and "std" in index:
            self.mean, self.std = tuple(index["mean"]), tuple(index["std"])
        self._reader, self._pid = None, None

    def __len__(self) -> int:
        return self.length

    def _open(self):
        """wids' reader, made in the process that reads (each DataLoader worker its own)."""
        if self._pid != os.getpid():
            import wids

            with contextlib.redirect_stderr(io.StringIO()):  # wids prints a line per reader
                self._reader = wids.ShardListDataset(self.shards, transformations=[], localname=self._local)
            self._pid = os.getpid()
        return self._reader

    def _local(self, url: str) -> str:
        """Where a shard is read: a local one in place, a remote one copied whole into
        cache_dir (default: $WIDS_CACHE or /tmp/_wids_cache)."""
        if "://" not in url or url.startswith("file://"):
            return url.removeprefix("file://")
        directory = self.cache_dir or os.environ.get("WIDS_CACHE", "/tmp/_wids_cache")
        os.makedirs(directory, exist_ok=True)
        return os.path.join(directory, quote(url, safe="+-"))

    def _sample(self, index: int) -> tuple[bytes, int, str]:
        """(image bytes, class index, where it is) of sample `index`."""
        try:
            sample = self._open()[index]
        except Exception as e:  # noqa: BLE001 (a missing, unreadable or truncated shard: name it)
            raise DataError(f"data.{self.key}: cannot read sample {index} from its shard ({type(e).__name__}: {e})") from None
        image = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
        label = sample.get(".cls")
        where = f"data.{self.key}: sample {sample.get('__key__')} of {sample.get('__shard__')}"
        if image is None or label is None:
            raise DataError(f"{where} has keys {sorted(k for k in sample if not k.startswith('__'))}; expected an image and 'cls'")
        try:
            return image.read(), int(label.read().decode().strip()), where
        except ValueError as e:
            raise DataError(f"{where}: its class is not an integer ({e})") from None

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([index])
        return x[0].contiguous(), y[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        samples = [self._sample(i) for i in indices]

        def failure(j: int, e: Exception) -> DataError:
            return DataError(f"{samples[j][2]} is not a readable image ({type(e).__name__}: {e})")

        batch = decode_batch([data for data, _, _ in samples], self.size, self.channels, failure)
        return batch, torch.tensor([label for _, label, _ in samples], dtype=torch.int64)

    def __getstate__(self) -> dict:  # workers open their own readers
        return {**self.__dict__, "_reader": None, "_pid": None}


def load_shards(*, train: str, val: str | None, image_size: int, channels: int,
                cache_dir: str | None = None) -> tuple[ShardImages, ShardImages | None]:  # fmt: skip
    """The training (and validation) shards named by their wids index files."""
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ConfigError([Problem("data.image_size", image_size, "an integer >= 1")])
    if channels not in (1, 3):
        raise ConfigError([Problem("data.channels", channels, "one of 1, 3")])
    try:
        import wids  # noqa: F401
    except ImportError:
        raise DataError('data=shards needs wids (WebDataset\'s indexed reader): pip install -e ".[shards]"') from None
    train_index = _read_index("train", train)
    train_set = ShardImages("train", train_index, image_size, channels, cache_dir)
    val_set = ShardImages("val", _read_index("val", val), image_size, channels, cache_dir) if val else None
    if val_set is not None and val_set.classes and train_set.classes and val_set.classes != train_set.classes:
        raise DataError(f"data.val: its classes {val_set.classes[:5]}... differ from data.train's {train_set.classes[:5]}...")
    return train_set, val_set
