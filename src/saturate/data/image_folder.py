from __future__ import annotations

import logging
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from saturate.data.base import InMemory, fraction, seed
from saturate.errors import ConfigError, DataError, Problem

log = logging.getLogger(__name__)


def decode(path: Path, size: int, channels: int) -> torch.Tensor:
    """One image file -> uint8 (C, size, size): PIL decode, convert, bilinear resize."""
    with Image.open(path) as img:
        img = img.convert("L" if channels == 1 else "RGB")
        if img.size != (size, size):
            img = img.resize((size, size), Image.BILINEAR)
        array = np.asarray(img, dtype=np.uint8)
    return torch.from_numpy(array.reshape(size, size, channels).transpose(2, 0, 1).copy())


def _unreadable(path: Path, mode: str) -> str | None:
    """None if the file decodes in full and converts to `mode`, else why not. A full decode,
    not PIL's verify(): verify() passes truncated JPEGs, which would then fail in a worker
    mid-epoch; the conversion, because some modes (LAB, CMYK to L) have none."""
    try:
        with Image.open(path) as img:
            img.load()
            img.convert(mode)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


class ImageFiles(Dataset):
    """Image files decoded one by one on access (in the DataLoader's workers)."""

    def __init__(self, files: list[Path], labels: list[int], size: int, channels: int):
        self.files, self.labels = files, torch.tensor(labels, dtype=torch.int64)
        self.size, self.channels = size, channels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return decode(self.files[index], self.size, self.channels), self.labels[index]
        except OSError as e:  # decoded at start-up: changed on disk since
            raise DataError(f"cannot read {self.files[index]} ({type(e).__name__}: {e}); it decoded at start-up") from None

    def materialize(self) -> InMemory:
        """Decode every file now, into one uint8 tensor in memory (for the resident loader)."""
        images = torch.stack([self[i][0] for i in range(len(self))])
        return InMemory(images, self.labels)


def _listing(folder: Path) -> list[Path]:
    """Every file below `folder`; a folder that cannot be read is an error naming it (rglob
    would pass over it in silence, and its images with it)."""
    files = []
    for parent, dirs, names in os.walk(folder, onerror=_unlisted):
        dirs.sort()
        files += [Path(parent) / n for n in sorted(names)]
    return [f for f in files if f.is_file()]


def _unlisted(error: OSError) -> None:
    raise DataError(f"data.root: cannot read the folder {error.filename} ({error.strerror}); its images would be lost") from None


def _scan(folder: Path, classes: list[str], strict: bool, channels: int) -> tuple[list[Path], list[int], list[str]]:
    found = []
    for label, name in enumerate(classes):
        files = _listing(folder / name)
        if not files:
            raise DataError(f"data.root: the class folder {folder / name} holds no files; remove it or add its images")
        found += [(p, label) for p in files]
    mode = "L" if channels == 1 else "RGB"
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:  # PIL decodes without the GIL
        reasons = list(pool.map(_unreadable, [path for path, _ in found], [mode] * len(found)))
    files, labels, skipped = [], [], []
    for (path, label), reason in zip(found, reasons, strict=True):
        if reason is None:
            files.append(path)
            labels.append(label)
        elif strict:
            raise DataError(f"data.strict=true: {path} is not a readable image ({reason})")
        else:
            log.warning("skipping %s: not a readable image (%s)", path, reason)
            skipped.append(str(path))
    return files, labels, skipped


def load_image_folder(*, root: str, image_size: int, channels: int, val_fraction: float, split_seed: int,
                      strict: bool) -> tuple[ImageFiles, ImageFiles]:  # fmt: skip
    """Class sub-folders under `data.root` (root/<class>/*.png|jpg|...). If root has train/
    and val/ sub-folders, those are the split; otherwise a stratified `val_fraction` split.
    Every file is decoded once at start-up (in threads) to find broken ones before training:
    unreadable, truncated or non-image files are skipped, each named in a warning and
    counted (metrics `data/skipped_files`), or with data.strict=true the first one is an
    error naming the file."""
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

    files, labels, skipped = _scan(base, classes, strict, channels)
    if split:
        val_files, val_labels, val_skipped = _scan(root / "val", classes, strict, channels)
        skipped += val_skipped
    else:
        order = list(range(len(files)))
        random.Random(split_seed).shuffle(order)
        val_idx = set()
        for label in range(len(classes)):  # stratified: the same share of every class
            members = [i for i in order if labels[i] == label]
            val_idx.update(members[: round(len(members) * val_fraction)])
        val_files, val_labels = [files[i] for i in sorted(val_idx)], [labels[i] for i in sorted(val_idx)]
        files, labels = (
            [files[i] for i in range(len(files)) if i not in val_idx],
            [labels[i] for i in range(len(labels)) if i not in val_idx],
        )
    if not files or not val_files:
        raise DataError(f"data.root={given!r}: no readable images for {'training' if not files else 'validation'}")

    train = ImageFiles(files, labels, image_size, channels)
    val = ImageFiles(val_files, val_labels, image_size, channels)
    train.classes, train.notes = classes, {"data/skipped_files": len(skipped)}
    log.info("image_folder: %d classes, %d train / %d val images, %d skipped", len(classes), len(train), len(val), len(skipped))
    return train, val
