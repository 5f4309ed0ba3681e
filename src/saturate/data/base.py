"""The data contract, and what saturate learns from one look at the data.

A data source is any map-style `Dataset` whose samples are `(input, target)`: tensors or
numpy arrays (or Python numbers) of any shape and dtype. `describe()` looks at the first
sample and learns what the run needs: the input's shape and dtype, whether inputs are uint8
images (C, H, W) that take the image fast paths, the kind of target (class indices or real
values) and the number of classes. A dataset may say more through optional attributes:

- `classes` (a list of names) or `num_classes`: the number of classes, without a scan;
- `targets` / `labels` (a tensor, array or list): all the targets, for that count;
- `synthetic = True`: shown wherever results are reported;
- `notes = {"data/...": number}`: counts worth reporting (e.g. skipped files), read at the
  end of the run (the dataset may update them as it goes);
- `poll()`: called in the main process after each batch the loader delivers (e.g. to name
  the files its workers skipped);
- `mean` / `std` (per channel, in [0, 1] units): image normalisation, without a sample.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from saturate.errors import ConfigError, DataError, Problem

log = logging.getLogger(__name__)

# Images read for normalisation statistics when the dataset gives none. Measured against all
# 18,000 training images of 64 px photo crops (20 samples each): 256 images put the mean within
# 0.011 of the full figure on average (worst 0.025, in [0, 1] units) and the std within 1.9 %
# (worst 4.5 %); 512 images: 0.008 and 1.3 %, for twice the decoding at start-up.
STATS_SAMPLES = 256


def fraction(key: str, value) -> None:
    """A built-in data option's check: `data.<key>` is a number in (0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError([Problem(f"data.{key}", value, "a number in (0, 1)")])


def seed(key: str, value) -> None:
    """A built-in data option's check: `data.<key>` is a seed every generator accepts."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**32 - 1:
        raise ConfigError([Problem(f"data.{key}", value, "an integer in [0, 4294967295]")])


def fits_in_memory(what: str, nbytes: int) -> None:
    """A data set about to be made in memory must fit in what the host has available."""
    import psutil

    available = psutil.virtual_memory().available
    if nbytes > 0.8 * available:
        raise DataError(f"{what}: {nbytes / 2**30:.1f} GiB in memory, more than the {available / 2**30:.1f} GiB available; make it smaller")


def at_least(key: str, value, low: int) -> None:
    """A built-in data option's check: `data.<key>` is an integer >= low."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError([Problem(f"data.{key}", value, f"an integer >= {low}")])


def as_tensor(value) -> torch.Tensor:
    """A sample's input or target as a tensor (numpy arrays and Python numbers included)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, (bool, int, float, np.generic)):
        return torch.tensor(value)
    raise DataError(f"data: a sample holds a {type(value).__name__}; expected a tensor, a numpy array or a number")


@dataclass
class DataSpec:
    """What the run knows about its data, learnt from one sample (and the targets)."""

    name: str
    input_shape: tuple[int, ...]  # one sample's, e.g. (C, H, W) or (T, F)
    input_dtype: torch.dtype
    target_shape: tuple[int, ...]  # () for a class index or a single value
    classes: bool  # targets are integer class indices
    num_classes: int | None  # when `classes`
    mean: tuple[float, ...] | None = None  # images: per channel, [0, 1] units
    std: tuple[float, ...] | None = None
    synthetic: bool = False
    in_memory: bool = False  # one in-memory tensor (no per-sample decoding)
    has_val: bool = True
    notes: dict = field(default_factory=dict)

    @property
    def image(self) -> bool:
        """uint8 (C, H, W): copied as uint8, normalised (and augmented) on the device."""
        return self.input_dtype == torch.uint8 and len(self.input_shape) == 3

    @property
    def num_outputs(self) -> int:
        """Values the model predicts per sample: classes, or the target's size."""
        return self.num_classes if self.classes else int(np.prod(self.target_shape, dtype=np.int64))

    def describe(self) -> str:
        shape = "x".join(map(str, self.input_shape)) or "scalar"
        kind = f"{self.num_classes} classes" if self.classes else f"real targets of shape {tuple(self.target_shape)}"
        return f"{shape} {str(self.input_dtype).removeprefix('torch.')} inputs{' (images)' if self.image else ''}, {kind}"


def channel_stats(images, chunk_elements: int = 1 << 22) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images, in [0, 1] units: `images` is a tensor
    (N, C, H, W) or an iterable of (C, H, W) images or (N, C, H, W) batches. Exact: a
    histogram of the 256 levels per channel, counted about `chunk_elements` values at a time
    (memory constant in the number and size of images; 6x faster than float64 sums of
    squares, measured on 512 images of 64 px: 4.3 ms against 27)."""
    counts = None
    for flat in _channel_blocks(images, chunk_elements):
        if counts is None:
            counts = torch.zeros((flat.shape[0], 256), dtype=torch.int64)
        for c in range(flat.shape[0]):
            counts[c] += torch.bincount(flat[c], minlength=256)
    levels = torch.arange(256, dtype=torch.float64) / 255
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


class InMemory(Dataset):
    """A data set held as two tensors: inputs (N, ...) and targets (N, ...). Batches are
    gathered in one `index_select` (see `__getitems__`); the resident loader keeps them on
    the device."""

    returns_batches = True  # __getitems__ returns the collated batch (saturate.loader)

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        if len(inputs) != len(targets):
            raise DataError(f"data: {len(inputs)} inputs but {len(targets)} targets")
        self.inputs, self.targets = inputs, targets

    @property
    def images(self) -> torch.Tensor:  # the image datasets' names for the same tensors
        return self.inputs

    @property
    def labels(self) -> torch.Tensor:
        return self.targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch in one gather; the DataLoader calls this instead of __getitem__ per
        sample (and then collates nothing: see saturate.loader.StreamLoader)."""
        index = torch.tensor(indices)
        return self.inputs.index_select(0, index), self.targets.index_select(0, index)


ImageTensors = InMemory  # uint8 images (N, C, H, W) with int64 labels (N,): the built-in image sets


def materialize(dataset: Dataset) -> InMemory:
    """Every sample of `dataset` read once into one pair of tensors (the resident loader)."""
    if isinstance(dataset, InMemory):
        return dataset
    if hasattr(dataset, "materialize"):
        return dataset.materialize()
    first = dataset[0]
    x0, y0 = as_tensor(first[0]), as_tensor(first[1])
    inputs = torch.empty((len(dataset), *x0.shape), dtype=x0.dtype)
    targets = torch.empty((len(dataset), *y0.shape), dtype=y0.dtype)
    for i in range(len(dataset)):
        x, y = dataset[i]
        inputs[i], targets[i] = as_tensor(x), as_tensor(y)
    return InMemory(inputs, targets)


def _sample(dataset: Dataset, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        n = len(dataset)
    except TypeError:
        raise DataError(f"data: the {what} set has no len(); saturate needs a map-style Dataset (__len__ and __getitem__)") from None
    if n == 0:
        raise DataError(f"data: the {what} set is empty")
    sample = dataset[0]
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise DataError(f"data: a {what} sample is a {type(sample).__name__}; expected a pair (input, target)")
    return as_tensor(sample[0]), as_tensor(sample[1])


def _all_targets(dataset: Dataset) -> torch.Tensor:
    """Every target of the set: from its `targets`/`labels` attribute, or read one by one."""
    for name in ("targets", "labels"):
        found = getattr(dataset, name, None)
        if isinstance(found, (torch.Tensor, np.ndarray, list, tuple)) and len(found) == len(dataset):
            return torch.as_tensor(np.asarray(found)) if not isinstance(found, torch.Tensor) else found
    log.info("data: reading every target once to count the classes (give the dataset a `classes` or `targets` attribute to skip this)")
    return torch.stack([as_tensor(dataset[i][1]) for i in range(len(dataset))])


def _known_targets(dataset: Dataset) -> torch.Tensor | None:
    """The set's targets when it holds them already (a `targets`/`labels` attribute of one per
    sample, or an in-memory tensor): checked for free; None when only reading every sample
    would tell."""
    if isinstance(dataset, InMemory):
        return dataset.targets
    for name in ("targets", "labels"):
        found = getattr(dataset, name, None)
        if isinstance(found, (torch.Tensor, np.ndarray, list, tuple)) and len(found) == len(dataset):
            return torch.as_tensor(np.asarray(found)) if not isinstance(found, torch.Tensor) else found
    return None


def _num_classes(dataset: Dataset) -> int:
    if isinstance(getattr(dataset, "num_classes", None), int):
        return dataset.num_classes
    if isinstance(getattr(dataset, "classes", None), (list, tuple)):
        return len(dataset.classes)
    targets = _all_targets(dataset)
    if targets.numel() and targets.min() < 0:
        raise DataError(f"data: a class index is {int(targets.min())}; class indices start at 0")
    return int(targets.max()) + 1


def _check_classes(dataset: Dataset, what: str, num_classes: int) -> None:
    """Every class index the set holds (where it holds them already) is in [0, num_classes):
    one out of range would be an IndexError at the first step (a device-side assert on CUDA)."""
    targets = _known_targets(dataset)
    if targets is None or not targets.numel():
        return
    targets = targets.reshape(-1)
    bad = (targets < 0) | (targets >= num_classes)
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        source = "the data's `classes`/`num_classes`" if hasattr(dataset, "classes") or hasattr(dataset, "num_classes") else "the targets"
        raise DataError(f"data: the {what} set's target {int(targets[first])} (sample {first}; {int(bad.sum())} such) is not a class "
                        f"index in [0, {num_classes - 1}]: {source} give {num_classes} classes")  # fmt: skip


def _check_finite(dataset: Dataset, what: str) -> None:
    """An in-memory set's inputs and targets hold no NaN or inf: a loss over them is NaN
    whatever the learning rate (checked where the tensors are at hand, once)."""
    if not isinstance(dataset, InMemory):
        return
    for name, values in (("inputs", dataset.inputs), ("targets", dataset.targets)):
        if values.is_floating_point():
            bad = ~torch.isfinite(values.reshape(len(values), -1)).all(dim=1)
            if bool(bad.any()):
                raise DataError(f"data: {int(bad.sum())} {what} sample(s) hold NaN or inf {name} (the first: sample "
                                f"{int(bad.nonzero()[0])}); remove or fill them: a loss over them is NaN at any learning rate")  # fmt: skip


def stack(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input, target)` samples stacked into a batch (torch's default_collate), or a DataError
    naming the part whose shapes differ."""
    try:
        return default_collate(samples)
    except RuntimeError as e:
        if "stack expects each tensor to be equal size" not in str(e):
            raise
    for k, part in enumerate(("input", "target")):
        shapes = [tuple(as_tensor(sample[k]).shape) for sample in samples]
        if len(set(shapes)) > 1:
            other = next(i for i, shape in enumerate(shapes) if shape != shapes[0])
            raise DataError(f"data: samples do not stack into a batch: the {part} of one sample has shape {shapes[0]}, of another "
                            f"{shapes[other]}; pad them to one shape in the data set (samples of variable length need a collate "
                            "function that pads them)")  # fmt: skip
    raise DataError("data: samples do not stack into a batch (their shapes differ)")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _check_stacks(dataset: Dataset, what: str, first: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Samples of one shape stack into a batch; look at a few besides the first (a data set
    that returns whole batches makes them itself)."""
    if getattr(dataset, "returns_batches", False):
        return
    n = len(dataset)
    for i in sorted({1, n // 2, n - 1} - {0}):
        if i >= n:
            continue
        other = dataset[i]
        for part, a, b in (("input", first[0], other[0]), ("target", first[1], other[1])):
            b = as_tensor(b)
            if a.shape != b.shape:
                raise DataError(f"data: {what} samples do not stack into a batch: the {part} of sample 0 has shape {tuple(a.shape)}, "
                                f"of sample {i} {tuple(b.shape)}; pad them to one shape in the data set (samples of variable length "
                                "need a collate function that pads them)")  # fmt: skip


def _image_stats(dataset: Dataset) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if getattr(dataset, "mean", None) is not None and getattr(dataset, "std", None) is not None:
        return tuple(dataset.mean), tuple(dataset.std)
    if isinstance(dataset, InMemory):
        return channel_stats(dataset.inputs)
    index = random.Random(0).sample(range(len(dataset)), min(len(dataset), STATS_SAMPLES))
    return channel_stats(as_tensor(dataset[i][0]) for i in index)


def describe(train: Dataset, val: Dataset | None, *, name: str, classes: bool) -> DataSpec:
    """Learn what the run needs from the training set's first sample (and its targets, to
    count classes when `classes`); check that the validation set's samples look the same."""
    x, y = _sample(train, "training")
    _check_stacks(train, "training", (x, y))
    if val is not None:
        vx, vy = _sample(val, "validation")
        if vx.shape != x.shape or vx.dtype != x.dtype:
            raise DataError(f"data: validation inputs are {_dtype(vx)} {tuple(vx.shape)}, training inputs {_dtype(x)} {tuple(x.shape)}; "
                            "they must match")  # fmt: skip
        if vy.shape != y.shape or vy.is_floating_point() != y.is_floating_point():
            raise DataError(f"data: validation targets are {_dtype(vy)} {tuple(vy.shape)}, training targets {_dtype(y)} {tuple(y.shape)}; "
                            "they must match (the task and the metrics compare them alike)")  # fmt: skip
        _check_stacks(val, "validation", (vx, vy))
    integer = not (y.is_floating_point() or y.is_complex())
    if classes and (not integer or y.ndim != 0):
        dtype = str(y.dtype).removeprefix("torch.")
        raise DataError(f"task=classification: the targets are {dtype} of shape {tuple(y.shape)}; classification needs one "
                        "integer class index per sample. For real-valued targets use task=regression")  # fmt: skip
    spec = DataSpec(
        name=name, input_shape=tuple(x.shape), input_dtype=x.dtype, target_shape=tuple(y.shape), classes=classes,
        num_classes=_num_classes(train) if classes else None, synthetic=bool(getattr(train, "synthetic", False)),
        in_memory=isinstance(train, InMemory), has_val=val is not None, notes=getattr(train, "notes", None) or {},
    )  # fmt: skip
    if classes and spec.num_classes < 2:
        raise DataError(f"data: {spec.num_classes} class(es) in the training targets; classification needs at least 2")
    for dataset, what in ((train, "training"), (val, "validation")):
        if dataset is not None:
            _check_finite(dataset, what)
            if classes:
                _check_classes(dataset, what, spec.num_classes)
    if spec.image:
        spec.mean, spec.std = _image_stats(train)
        if len(spec.mean) != x.shape[0]:
            raise DataError(f"data: {len(spec.mean)} normalisation values (mean/std) for {x.shape[0]} image channels")
    return spec
