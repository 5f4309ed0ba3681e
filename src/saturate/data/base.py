"""The data contract, and what saturate learns from one look at the data.

A data source is any map-style `Dataset` whose samples are `(input, target)` pairs, or dicts
holding the input and the target under the task's `input_key` and `target_key` (and any
other entries: lengths, masks, several inputs): tensors, numpy arrays or Python numbers of
any shape and dtype. Batches are what the data's collate makes of them (torch's
default_collate, or the data's own: saturate.data.Data). `describe()` looks at the first
sample and learns what the run needs: the input's shape and dtype, whether inputs are
images (uint8, or float in [0, 1], (C, H, W)) that take the image paths, the kind of target
(class indices or real values) and the number of classes. A dataset may say more through
optional attributes:

- `classes` (a list of names) or `num_classes`: the number of classes, without a scan;
- `targets` / `labels` (a tensor, array or list): all the targets, for that count;
- `synthetic = True`: shown wherever results are reported;
- `notes = {"data/...": number}`: counts worth reporting (e.g. skipped files), read at the
  end of the run (the dataset may update them as it goes);
- `poll()`: called in the main process after each batch the loader delivers (e.g. to name
  the files its workers skipped);
- `mean` / `std` (per channel, in [0, 1] units): image normalisation, without a sample.

The parts of the contract live beside this module (spec: DataSpec; samples: a sample's
entries and the default stacking; in_memory: InMemory, materialize; image_stats; checks;
options); their names stay importable from here.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from saturate.data.checks import check_like_training, check_stacks, check_values, classes_of, differing
from saturate.data.image_stats import STATS_SAMPLES, channel_stats, image_stats
from saturate.data.in_memory import ImageTensors, InMemory, materialize, tensors_of
from saturate.data.options import at_least, fits_in_memory, fraction, seed
from saturate.data.samples import (
    as_inputs,
    as_tensor,
    entries,
    input_keys,
    leaves,
    length,
    named_leaves,
    sample_of,
    shapes,
    stack,
)
from saturate.data.spec import DataSpec
from saturate.errors import DataError

__all__ = [
    "STATS_SAMPLES",
    "DataSpec",
    "ImageTensors",
    "InMemory",
    "as_inputs",
    "as_tensor",
    "at_least",
    "channel_stats",
    "describe",
    "entries",
    "fits_in_memory",
    "fraction",
    "input_keys",
    "leaves",
    "materialize",
    "named_leaves",
    "seed",
    "shapes",
    "stack",
    "tensors_of",
]


def _float_image(x: torch.Tensor) -> bool:
    """A float (C, H, W) image with values in [0, 1] (torchvision's ToTensor() convention)."""
    shaped = x.is_floating_point() and x.ndim == 3 and x.shape[0] in (1, 3) and min(x.shape[1:]) > 1
    return shaped and bool(x.min() >= 0) and bool(x.max() <= 1)


def _read_time(dataset: Dataset, count: int = 16) -> float:
    """Seconds to read one sample here (the median of a few): micro-seconds for data already
    in memory, where workers would only add copies; milliseconds for files to decode."""
    import statistics
    import time

    times = []
    for i in range(min(count, length(dataset))):
        start = time.perf_counter()
        dataset[i * max(1, length(dataset) // count) % length(dataset)]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def describe(
    train: Dataset,
    val: Dataset | None,
    *,
    name: str,
    classes: bool,
    test: Dataset | None = None,
    input_key: str | list[str] = "input",
    target_key: str = "target",
    collate: bool = False,
) -> DataSpec:
    """Learn what the run needs from the training set's first sample (and its targets, to
    count classes when `classes`); check that the validation and test sets' samples look the
    same. `collate`: the data brings its own collate, so samples may differ in shape."""
    keys = (input_key, target_key)
    inputs, y, structure = sample_of(train, "training", *keys)
    if not leaves(inputs):
        raise DataError(f"data: a training sample's input holds no tensor ({type(inputs).__name__} {inputs!r:.60})")
    x = leaves(inputs)[0]  # the first input: what describes the data (channels, features, image or not)
    fixed = differing(train, "training", (inputs, y), keys) is None
    if not collate:
        check_stacks(train, "training", (inputs, y), keys)
    for other, what in ((val, "validation"), (test, "test")):
        if other is not None:
            check_like_training(other, what, (inputs, y, structure), keys, fixed=fixed, collate=collate)
    num_classes = classes_of(train, y, keys, classes)
    spec = DataSpec(
        name=name,
        input_shape=tuple(x.shape),
        input_dtype=x.dtype,
        target_shape=tuple(y.shape),
        classes=classes,
        num_classes=num_classes,
        synthetic=bool(getattr(train, "synthetic", False)),
        in_memory=isinstance(train, InMemory),
        has_val=val is not None,
        notes=getattr(train, "notes", None) or {},
        has_test=test is not None,
        structure=structure,
        input_key=input_key,
        target_key=target_key,
        float_image=isinstance(inputs, torch.Tensor) and _float_image(x),
        fixed=fixed,
        collate=collate,
        sample_s=_read_time(train),
        input_shapes=tuple(shapes(inputs)),
        target_dtype=y.dtype,
    )
    check_values(spec, (train, val, test))
    if spec.image:
        image_stats(spec, train)
    return spec
