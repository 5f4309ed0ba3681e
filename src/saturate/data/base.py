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
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

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
        raise DataError(
            f"{what}: {nbytes / 2**30:.1f} GiB in memory, more than the {available / 2**30:.1f} GiB available; make "
            "it smaller"
        )


def at_least(key: str, value, low: int) -> None:
    """A built-in data option's check: `data.<key>` is an integer >= low."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError([Problem(f"data.{key}", value, f"an integer >= {low}")])


def as_tensor(value, what: str = "a sample") -> torch.Tensor:
    """A sample's entry as a tensor (numpy arrays and Python numbers included)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, (bool, int, float, np.generic)):
        return torch.tensor(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, np.generic)) for v in value):
        return torch.tensor(value)
    raise DataError(
        f"data: {what} is a {type(value).__name__}; expected a tensor, a numpy array, a list of numbers or a number"
        " (an input may also be a tuple, list or dict of these: the model gets them as separate arguments)"
    )


def as_inputs(value, what: str):
    """A sample's input: one tensor, or a tuple, list or dict of them (nested where it makes
    sense); `what` names it in a refusal, each entry by its place (`input[1]`, `input.past`)."""
    if isinstance(value, dict):
        return {k: as_inputs(v, f"{what}.{k}") for k, v in value.items()}
    if (
        isinstance(value, (tuple, list))
        and value
        and not all(isinstance(v, (bool, int, float, np.generic)) for v in value)
    ):
        return type(value)(as_inputs(v, f"{what}[{i}]") for i, v in enumerate(value))
    return as_tensor(value, what)


def leaves(tree) -> list[torch.Tensor]:
    """The tensors of an input, in the order the model gets them."""
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def shapes(tree) -> list[tuple[int, ...]]:
    return [tuple(leaf.shape) for leaf in leaves(tree)]


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
    has_test: bool = False
    structure: str = "pair"  # pair: (input, target); dict: the input and target under input_key and target_key
    input_key: str = "input"
    target_key: str = "target"
    # float (C, H, W) in [0, 1] (the ToTensor() convention): augmented as images, not normalised
    float_image: bool = False
    fixed: bool = True  # every sample has the same shapes (variable-length samples need a collate; no resident loader)
    collate: bool = False  # the data brings its own collate function
    sample_s: float | None = None  # seconds to read one sample in this process (the num_workers=auto rule)
    input_shapes: tuple[tuple[int, ...], ...] = ()  # every input tensor's shape (several inputs: a tuple or dict)
    target_dtype: torch.dtype | None = None
    host_keys: tuple[str, ...] = ()  # dict entries the loaders leave on the host: the task reads them there

    @property
    def image(self) -> bool:
        """uint8 (C, H, W): copied as uint8, normalised (and augmented) on the device; or a
        float (C, H, W) image in [0, 1], augmented, not normalised."""
        single = len(self.input_shapes) <= 1
        return single and ((self.input_dtype == torch.uint8 and len(self.input_shape) == 3) or self.float_image)

    @property
    def mask_target(self) -> bool:
        """The targets are masks of the images (integer (H, W), the images' height and width):
        a geometric augmentation moves them with the image."""
        integer = self.target_dtype is not None and not self.target_dtype.is_floating_point
        return self.image and integer and tuple(self.target_shape) == tuple(self.input_shape[-2:])

    @property
    def target_entry(self):
        """Where the target is in a batch: 1 of a pair, the target key of a dict."""
        return 1 if self.structure == "pair" else self.target_key

    @property
    def image_entry(self):
        """Where the image is in a batch: 0 of a pair, the input key of a dict."""
        return 0 if self.structure == "pair" else self.input_key

    @property
    def num_outputs(self) -> int:
        """Values the model predicts per sample: classes, or the target's size."""
        return self.num_classes if self.classes else int(np.prod(self.target_shape, dtype=np.int64))

    def describe(self) -> str:
        if len(self.input_shapes) > 1:
            shown = ", ".join("x".join(map(str, s)) or "scalar" for s in self.input_shapes)
            kind = (
                f"{self.num_classes} classes" if self.classes else f"real targets of shape {tuple(self.target_shape)}"
            )
            return f"{len(self.input_shapes)} inputs ({shown}), {kind}"
        shape = "x".join(map(str, self.input_shape)) or "scalar"
        kind = f"{self.num_classes} classes" if self.classes else f"real targets of shape {tuple(self.target_shape)}"
        return (
            f"{shape} {str(self.input_dtype).removeprefix('torch.')} inputs{' (images)' if self.image else ''}, {kind}"
        )


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
    """A data set held as tensors with the samples along their first dimension: `inputs` and
    `targets` (N, ...), or any structure of such tensors (`tree`, e.g. a dict). Batches are
    gathered in one `index_select` per tensor (see `__getitems__`); the resident loader
    keeps them on the device."""

    returns_batches = True  # __getitems__ returns the collated batch (saturate.data.streaming)

    def __init__(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None, *, tree=None):
        self.tree = (inputs, targets) if tree is None else tree
        sizes = {len(leaf) for leaf in tree_leaves(self.tree)}
        if len(sizes) != 1:
            raise DataError(
                f"data: in-memory tensors of different lengths ({', '.join(map(str, sorted(sizes)))} samples)"
            )
        self.length = sizes.pop()

    @property
    def inputs(self) -> torch.Tensor:  # of an (inputs, targets) pair
        return self.tree[0]

    @property
    def targets(self) -> torch.Tensor:
        return self.tree[1]

    images, labels = inputs, targets  # the image datasets' names for the same tensors

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return tree_map(lambda t: t[index], self.tree)

    def __getitems__(self, indices: list[int]):
        """A whole batch in one gather per tensor; the DataLoader calls this instead of
        __getitem__ per sample (and then collates nothing: see saturate.data.streaming.StreamLoader)."""
        index = torch.tensor(indices)
        return tree_map(lambda t: t.index_select(0, index), self.tree)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in tree_leaves(self.tree))


ImageTensors = InMemory  # uint8 images (N, C, H, W) with int64 labels (N,): the built-in image sets


def tensors_of(dataset) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None] | None:
    """A TensorDataset's tensors, or a Subset of one's (random_split's) with its indices: held
    resident by one gather per tensor, not read sample by sample. None for anything else (a
    subclass may read its samples its own way)."""
    if type(dataset) is TensorDataset:
        return tuple(dataset.tensors), None
    if type(dataset) is Subset and type(dataset.dataset) is TensorDataset:
        tensors = tuple(dataset.dataset.tensors)
        index = torch.as_tensor(list(dataset.indices), dtype=torch.long)
        inside = not len(index) or (index.min() >= 0 and index.max() < len(tensors[0]))  # else: as __getitem__ says
        return (tensors, index) if inside else None
    return None


def _as_collated(value) -> torch.Tensor:
    """A sample's entry as torch's default collate batches it: as as_tensor does, but a Python
    float as float64 (the collate's dtype for it; torch.tensor would make it float32)."""
    return torch.tensor(value, dtype=torch.float64) if isinstance(value, float) else as_tensor(value)


def materialize(dataset: Dataset) -> InMemory:
    """Every sample of `dataset` read once into tensors of the samples' structure, each entry
    in the dtype the DataLoader's default collate gives it (the resident loader trains on what
    the DataLoader would give); samples must have fixed shapes."""
    if isinstance(dataset, InMemory):
        return dataset
    if hasattr(dataset, "materialize"):
        return dataset.materialize()
    source = tensors_of(dataset)
    if source is not None:  # a copy on the host, contiguous, as the samples' stores below would be
        tensors, index = source
        held = [t.detach() if index is None else t.detach().index_select(0, index.to(t.device)) for t in tensors]
        return InMemory(tree=tuple(t.to("cpu", memory_format=torch.contiguous_format, copy=True) for t in held))
    leaves, spec = tree_flatten(tree_map(_as_collated, dataset[0]))
    stores = [torch.empty((len(dataset), *leaf.shape), dtype=leaf.dtype) for leaf in leaves]
    for start in range(0, len(dataset), READ_CHUNK):  # a chunk at a time: the samples' copies stay small
        samples = [dataset[i] for i in range(start, min(start + READ_CHUNK, len(dataset)))]
        for store, values in zip(stores, _collated(samples, stores, start), strict=True):
            store[start : start + len(samples)] = values
    return InMemory(tree=tree_unflatten(stores, spec))


READ_CHUNK = 1024  # samples batched at once by materialize


def _collated(samples: list, stores: list[torch.Tensor], start: int) -> list[torch.Tensor]:
    """The leaves of `samples` batched by the default collate (one stack per entry: 5x faster
    than entry by entry), or, where they do not batch as sample 0 did (another number of
    entries, dtype or shape), entry by entry, cast to sample 0's dtype as before, naming a
    sample whose shape differs."""
    try:
        leaves = tree_leaves(default_collate(samples))  # its tuples come back as lists: the leaves are in order
        if len(leaves) == len(stores) and all(
            isinstance(v, torch.Tensor) and v.shape[1:] == s.shape[1:] and v.dtype == s.dtype
            for v, s in zip(leaves, stores, strict=True)
        ):
            return leaves
    except (RuntimeError, TypeError, ValueError):  # shapes or types that do not stack: named below
        pass
    batched = [torch.empty((len(samples), *s.shape[1:]), dtype=s.dtype) for s in stores]
    for j, sample in enumerate(samples):
        values, _ = tree_flatten(tree_map(_as_collated, sample))
        for held, store, value in zip(batched, stores, values, strict=True):
            if value.shape != store.shape[1:]:
                raise DataError(
                    f"loader.resident=true: sample {start + j} has an entry of shape {tuple(value.shape)}, sample 0 "
                    f"{tuple(store.shape[1:])}; a resident data set holds samples of one shape"
                )
            held[j] = value
    return batched


def _sample(
    dataset: Dataset, what: str, input_key, target_key: str, index: int = 0
) -> tuple[object, torch.Tensor, str]:
    """(input, target, structure) of sample `index`: a pair, or a dict holding both."""
    try:
        n = len(dataset)
    except TypeError:
        raise DataError(
            f"data: the {what} set has no len(); saturate needs a map-style Dataset (__len__ and __getitem__)"
        ) from None
    if n == 0:
        raise DataError(f"data: the {what} set is empty")
    sample = dataset[index]
    return (*entries(sample, what, input_key, target_key), "dict" if isinstance(sample, dict) else "pair")


def input_keys(input_key) -> list[str]:
    """The dict keys the input is read from: one, or several (the model gets them in order)."""
    return [str(k) for k in input_key] if isinstance(input_key, (list, tuple)) else [str(input_key)]


def entries(sample, what: str, input_key="input", target_key: str = "target") -> tuple[object, torch.Tensor]:
    """A sample's input and target: the two of a pair, or a dict's `input_key` (or keys) and
    `target_key` entries. The input is a tensor, or a tuple, list or dict of them."""
    if isinstance(sample, (tuple, list)) and len(sample) == 2:
        return as_inputs(sample[0], f"a {what} sample's input"), as_tensor(sample[1], f"a {what} sample's target")
    if isinstance(sample, dict):
        keys = input_keys(input_key)
        missing = [key for key in (*keys, target_key) if key not in sample]
        if missing:
            reads = " and ".join(map(repr, keys))
            raise DataError(
                f"data: a {what} sample is a dict with keys {sorted(map(str, sample))}; the task reads its input from "
                f"{reads} and its target from {target_key!r} (task.input_key, task.target_key)"
            )
        raw = sample[keys[0]] if len(keys) == 1 else tuple(sample[k] for k in keys)
        name = f"a {what} sample's {keys[0]!r}" if len(keys) == 1 else f"a {what} sample's input"
        return as_inputs(raw, name), as_tensor(sample[target_key], f"a {what} sample's {target_key!r}")
    raise DataError(
        f"data: a {what} sample is a {type(sample).__name__}; expected a pair (input, target) or a dict holding them"
    )


def _all_targets(dataset: Dataset, input_key: str = "input", target_key: str = "target") -> torch.Tensor:
    """Every target of the set: from its `targets`/`labels` attribute, or read one by one."""
    known = _known_targets(dataset, target_key)
    if known is not None:
        return known
    log.info(
        "data: reading every target once to count the classes (give the dataset a `classes` or `targets` attribute "
        "to skip this)"
    )
    return torch.stack([entries(dataset[i], "training", input_key, target_key)[1] for i in range(len(dataset))])


def _known_targets(dataset: Dataset, target_key: str = "target") -> torch.Tensor | None:
    """The set's targets when it holds them already (a `targets`/`labels` attribute of one per
    sample, or an in-memory tensor): checked for free; None when only reading every sample
    would tell."""
    if isinstance(dataset, InMemory):
        return dataset.tree[target_key] if isinstance(dataset.tree, dict) else dataset.targets
    for name in ("targets", "labels"):
        found = getattr(dataset, name, None)
        if isinstance(found, (torch.Tensor, np.ndarray, list, tuple)) and len(found) == len(dataset):
            return torch.as_tensor(np.asarray(found)) if not isinstance(found, torch.Tensor) else found
    return None


def _num_classes(dataset: Dataset, input_key: str = "input", target_key: str = "target") -> int:
    if isinstance(getattr(dataset, "num_classes", None), int):
        return dataset.num_classes
    if isinstance(getattr(dataset, "classes", None), (list, tuple)):
        return len(dataset.classes)
    targets = _all_targets(dataset, input_key, target_key)
    if targets.numel() and targets.min() < 0:
        raise DataError(f"data: a class index is {int(targets.min())}; class indices start at 0")
    return int(targets.max()) + 1


def _check_classes(dataset: Dataset, what: str, num_classes: int, target_key: str = "target") -> None:
    """Every class index the set holds (where it holds them already) is in [0, num_classes):
    one out of range would be an IndexError at the first step (a device-side assert on CUDA)."""
    targets = _known_targets(dataset, target_key)
    if targets is None or not targets.numel():
        return
    targets = targets.reshape(-1)
    bad = (targets < 0) | (targets >= num_classes)
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        source = (
            "the data's `classes`/`num_classes`"
            if hasattr(dataset, "classes") or hasattr(dataset, "num_classes")
            else "the targets"
        )
        raise DataError(
            f"data: the {what} set's target {int(targets[first])} (sample {first}; {int(bad.sum())} such) is not a "
            f"class index in [0, {num_classes - 1}]: {source} give {num_classes} classes"
        )


def _check_finite(dataset: Dataset, what: str) -> None:
    """An in-memory set's inputs and targets hold no NaN or inf: a loss over them is NaN
    whatever the learning rate (checked where the tensors are at hand, once)."""
    if not isinstance(dataset, InMemory):
        return
    named = (
        dataset.tree.items()
        if isinstance(dataset.tree, dict)
        else zip(("inputs", "targets"), dataset.tree, strict=False)
    )
    for name, values in named:
        if isinstance(values, torch.Tensor) and values.is_floating_point():
            bad = ~torch.isfinite(values.reshape(len(values), -1)).all(dim=1)
            if bool(bad.any()):
                raise DataError(
                    f"data: {int(bad.sum())} {what} sample(s) hold NaN or inf {name} (the first: sample "
                    f"{int(bad.nonzero()[0])}); remove or fill them: a loss over them is NaN at any learning rate"
                )


def stack(samples: list):
    """Samples stacked into a batch (torch's default_collate: pairs, dicts, nested), or a
    DataError naming the entry whose shapes differ and the fix."""
    try:
        return default_collate(samples)
    except TypeError as e:  # an entry default_collate cannot batch (None, an object)
        if "default_collate" not in str(e):
            raise
        odd = [
            (name, type(v).__name__)
            for name, v in named_leaves(samples[0], "")
            if v is None or not isinstance(v, (torch.Tensor, np.ndarray, int, float, str, bytes, bool))
        ]
        where = f" (the sample's {odd[0][0] or 'value'} is a {odd[0][1]})" if odd else ""
        raise DataError(
            f"data: samples do not batch{where}: the default collate takes tensors, numpy arrays, numbers, strings, "
            "dicts and lists; drop that entry from the samples, or give the data a collate function"
        ) from None
    except RuntimeError as e:
        if "stack expects each tensor to be equal size" not in str(e):
            raise
    flat = [tree_flatten(tree_map(as_tensor, sample)) for sample in samples]
    names = _leaf_names(samples[0])
    for k, name in enumerate(names):
        shapes = [tuple(leaves[k].shape) for leaves, _ in flat]
        if len(set(shapes)) > 1:
            other = next(shape for shape in shapes if shape != shapes[0])
            raise DataError(
                f"data: samples do not stack into a batch: the {name} of one sample has shape {shapes[0]}, of another "
                f"{other}; pad them to one shape in the data set, or give the data a collate function that pads a "
                "batch (return {'train': ..., 'collate': saturate.data.pad_collate})"
            )
    raise DataError("data: samples do not stack into a batch (their shapes differ)")


def named_leaves(tree, name: str) -> list[tuple[str, object]]:
    """A sample's (or an input's) entries by name, in pytree order: `input`, `input[1]`, `input.past`."""
    if isinstance(tree, dict):
        return [pair for k, v in tree.items() for pair in named_leaves(v, f"{name}.{k}" if name else str(k))]
    if isinstance(tree, (tuple, list)) and tree and not all(isinstance(v, (bool, int, float)) for v in tree):
        return [pair for i, v in enumerate(tree) for pair in named_leaves(v, f"{name}[{i}]")]
    return [(name, tree)]


def _leaf_names(sample) -> list[str]:
    """Names of a sample's entries in pytree order: a pair's input (or its inputs) and target, a dict's keys."""
    if isinstance(sample, (tuple, list)) and len(sample) == 2:
        return [name for name, _ in named_leaves(sample[0], "input")] + ["target"]
    if isinstance(sample, dict):
        return [name for name, _ in named_leaves(sample, "")]  # torch's pytree keeps a dict's order
    return [f"entry {i}" for i in range(len(tree_leaves(sample)))]


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _differing(dataset: Dataset, what: str, first: tuple, keys: tuple) -> tuple | None:
    """(entry, sample, its shape, sample 0's) of the first of a few samples besides sample 0
    whose input (any of them) or target has another shape than sample 0's; None when they
    all match (a data set that returns whole batches makes them itself)."""
    if getattr(dataset, "returns_batches", False):
        return None
    n = len(dataset)
    mine = [*named_leaves(first[0], "input"), ("target", first[1])]
    for i in sorted({1, n // 2, n - 1} - {0}):
        if i >= n:
            continue
        x, y = entries(dataset[i], what, *keys)
        for (name, a), (_, b) in zip(mine, [*named_leaves(x, "input"), ("target", y)], strict=False):
            if a.shape != b.shape:
                return name, i, tuple(b.shape), tuple(a.shape)
    return None


def _check_stacks(dataset: Dataset, what: str, first: tuple, keys: tuple) -> None:
    """Samples of one shape stack into a batch with torch's default collate; say which
    entry differs and the fix when they do not."""
    found = _differing(dataset, what, first, keys)
    if found is not None:
        part, i, shape, shape0 = found
        raise DataError(
            f"data: {what} samples do not stack into a batch: the {part} of sample 0 has shape {shape0}, of "
            f"sample {i} {shape}; pad them to one shape in the data set, or give the data a collate function that "
            "pads a batch (return {'train': ..., 'collate': saturate.data.pad_collate})"
        )


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
    for i in range(min(count, len(dataset))):
        start = time.perf_counter()
        dataset[i * max(1, len(dataset) // count) % len(dataset)]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _image_stats(dataset: Dataset, key: str = "input") -> tuple[tuple[float, ...], tuple[float, ...]]:
    if getattr(dataset, "mean", None) is not None and getattr(dataset, "std", None) is not None:
        return tuple(dataset.mean), tuple(dataset.std)
    if isinstance(dataset, InMemory):
        return channel_stats(dataset.tree[key] if isinstance(dataset.tree, dict) else dataset.inputs)
    index = random.Random(0).sample(range(len(dataset)), min(len(dataset), STATS_SAMPLES))
    return channel_stats(entries(dataset[i], "training", key, key)[0] for i in index)


def _check_like_training(other: Dataset, what: str, first: tuple, keys: tuple, *, fixed: bool, collate: bool):
    """A validation or test set's samples have the training samples' structure, shapes and dtypes."""
    x, y, structure = first
    vx, vy, other_structure = _sample(other, what, *keys)
    if other_structure != structure:
        raise DataError(
            f"data: {what} samples are {'dicts' if other_structure == 'dict' else 'pairs'}, training samples "
            f"{'dicts' if structure == 'dict' else 'pairs'}; they must have one structure"
        )
    mine, theirs = named_leaves(x, "input"), named_leaves(vx, "input")
    if [n for n, _ in mine] != [n for n, _ in theirs]:
        raise DataError(
            f"data: {what} inputs are {', '.join(n for n, _ in theirs)}, training inputs "
            f"{', '.join(n for n, _ in mine)}; they must match"
        )
    for (name, a), (_, b) in zip(mine, theirs, strict=True):
        same = (b.shape == a.shape) if fixed else (b.shape[1:] == a.shape[1:])
        if not same or b.dtype != a.dtype:
            raise DataError(
                f"data: {what} {name} is {_dtype(b)} {tuple(b.shape)}, the training {name} {_dtype(a)} "
                f"{tuple(a.shape)}; they must match"
            )
    same_target = (vy.shape == y.shape) if fixed else (vy.ndim == y.ndim)
    if not same_target or vy.is_floating_point() != y.is_floating_point():
        raise DataError(
            f"data: {what} targets are {_dtype(vy)} {tuple(vy.shape)}, training targets {_dtype(y)} {tuple(y.shape)}; "
            "they must match (the task and the metrics compare them alike)"
        )
    if not collate:
        _check_stacks(other, what, (vx, vy), keys)


def _check_values(spec: DataSpec, splits: tuple) -> None:
    """Class indices in range (and at least two classes); in-memory values finite."""
    if spec.classes and spec.num_classes < 2:
        raise DataError(f"data: {spec.num_classes} class(es) in the training targets; classification needs at least 2")
    for dataset, what in zip(splits, ("training", "validation", "test"), strict=True):
        if dataset is not None:
            _check_finite(dataset, what)
            if spec.classes:
                _check_classes(dataset, what, spec.num_classes, spec.target_key)


def _classes_of(train: Dataset, y: torch.Tensor, keys: tuple, classes: bool) -> int | None:
    """The number of classes: counted in the targets (classification, whose targets must be
    class indices), else what the dataset says (num_classes, classes)."""
    integer = not (y.is_floating_point() or y.is_complex())
    if classes and (not integer or y.ndim != 0):
        raise DataError(
            f"task=classification: the targets are {_dtype(y)} of shape {tuple(y.shape)}; classification needs one "
            "integer class index per sample. For real-valued targets use task=regression"
        )
    num_classes = _num_classes(train, *keys) if classes else getattr(train, "num_classes", None)
    if num_classes is None and isinstance(getattr(train, "classes", None), (list, tuple)):
        num_classes = len(train.classes)
    return num_classes


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
    inputs, y, structure = _sample(train, "training", *keys)
    if not leaves(inputs):
        raise DataError(f"data: a training sample's input holds no tensor ({type(inputs).__name__} {inputs!r:.60})")
    x = leaves(inputs)[0]  # the first input: what describes the data (channels, features, image or not)
    fixed = _differing(train, "training", (inputs, y), keys) is None
    if not collate:
        _check_stacks(train, "training", (inputs, y), keys)
    for other, what in ((val, "validation"), (test, "test")):
        if other is not None:
            _check_like_training(other, what, (inputs, y, structure), keys, fixed=fixed, collate=collate)
    num_classes = _classes_of(train, y, keys, classes)
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
    _check_values(spec, (train, val, test))
    if spec.image and not spec.float_image:
        spec.mean, spec.std = _image_stats(train, input_key)
        if len(spec.mean) != x.shape[0]:
            raise DataError(f"data: {len(spec.mean)} normalisation values (mean/std) for {x.shape[0]} image channels")
    return spec
