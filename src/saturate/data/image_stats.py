"""Per-channel normalisation statistics of images: the data set's own `mean` and `std` (uint8
and float images), else, for uint8 images, measured on its tensors or a sample of its images."""

from __future__ import annotations

import random
from typing import cast

import torch
from torch.utils.data import Dataset

from saturate.data.in_memory import InMemory
from saturate.data.samples import entries, length
from saturate.data.spec import DataSpec
from saturate.errors import DataError

# Images read for normalisation statistics when the dataset gives none. Measured against all
# 18,000 training images of 64 px photo crops (20 samples each): 256 images put the mean within
# 0.011 of the full figure on average (worst 0.025, in [0, 1] units) and the std within 1.9 %
# (worst 4.5 %); 512 images: 0.008 and 1.3 %, for twice the decoding at start-up.
STATS_SAMPLES = 256


def channel_stats(images, chunk_elements: int = 1 << 22) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images, in [0, 1] units: `images` is a tensor
    (N, C, H, W) or an iterable of (C, H, W) images or (N, C, H, W) batches. Exact: a
    histogram of the 256 levels per channel, counted about `chunk_elements` values at a time
    (memory constant in the number and size of images; a bincount per channel does far less
    work than float64 sums of squares over every value)."""
    counts = None
    for flat in _channel_blocks(images, chunk_elements):
        if counts is None:
            counts = torch.zeros((flat.shape[0], 256), dtype=torch.int64)
        for c in range(flat.shape[0]):
            counts[c] += torch.bincount(flat[c], minlength=256)
    levels = torch.arange(256, dtype=torch.float64) / 255
    assert counts is not None, "channel_stats: no images"
    h = counts.double()
    n = h.sum(1)
    mean = (h * levels).sum(1) / n
    var = ((h * (levels - mean[:, None]).square()).sum(1) / (n - 1).clamp_min(1)).clamp_min(0)
    return tuple(mean.tolist()), tuple(var.sqrt().clamp_min(1e-3).tolist())


def _channel_blocks(images, chunk_elements: int):
    """(C, values) blocks of uint8 images: several images at a time from a tensor (N, C, H,
    W), one image or batch at a time from an iterable of (C, H, W) images or such batches."""
    if isinstance(images, torch.Tensor):
        n = max(1, chunk_elements // max(1, images[0].numel()))
        for start in range(0, len(images), n):
            yield images[start : start + n].transpose(0, 1).reshape(images.shape[1], -1)
    else:
        for image in images:
            if image.dim() == 4:
                yield from _channel_blocks(image, chunk_elements)
            else:
                yield image.reshape(image.shape[0], -1)


def image_stats(spec: DataSpec, dataset: Dataset) -> None:
    """spec.mean, spec.std (and spec.stats_images) of image data: the data set's own `mean` and
    `std` (per channel, or one number for every channel), for uint8 and float images alike;
    else, for uint8 images, measured (on its tensors, or a sample of STATS_SAMPLES images);
    float images without them stay as they are (they are in [0, 1] already, and a model made
    for them expects that)."""
    given = [getattr(dataset, name, None) for name in ("mean", "std")]
    channels = spec.input_shape[0]
    if None not in given:
        spec.mean, spec.std = _per_channel("mean", given[0], channels), _per_channel("std", given[1], channels)
        if min(spec.std) <= 0:
            raise DataError(f"data: the data set's std {spec.std}: each must be > 0 (the images are divided by it)")
    elif given != [None, None]:
        said, missing = ("mean", "std") if given[0] is not None else ("std", "mean")
        raise DataError(f"data: the data set gives `{said}` but no `{missing}`; image normalisation takes both")
    elif not spec.float_image:
        spec.mean, spec.std, spec.stats_images = _measured(dataset, spec.input_key)
    if spec.mean is not None and len(spec.mean) != channels:
        raise DataError(f"data: {len(spec.mean)} normalisation values (mean/std) for {channels} image channels")


def _per_channel(name: str, value, channels: int) -> tuple[float, ...]:
    """A data set's `mean` or `std`: a number for every channel, or one per channel."""
    try:
        values = (float(value),) * channels if isinstance(value, (int, float)) else tuple(map(float, value))
    except (TypeError, ValueError):
        raise DataError(
            f"data: the data set's {name} {value!r:.60}: expected a number or one per channel, in [0, 1] units"
        ) from None
    return values


def _measured(dataset: Dataset, key: str | list[str]) -> tuple[tuple[float, ...], tuple[float, ...], int]:
    """Per-channel mean and std of a set's uint8 images, and how many images they were read from."""
    if isinstance(dataset, InMemory):
        images = dataset.tree[key] if isinstance(dataset.tree, dict) else dataset.inputs
        return (*channel_stats(images), len(images))
    index = random.Random(0).sample(range(length(dataset)), min(length(dataset), STATS_SAMPLES))
    as_target = cast(str, key)  # read as the target too, unused: only the image is kept (a pair's keys go unread)
    return (*channel_stats(entries(dataset[i], "training", key, as_target)[0] for i in index), len(index))
