"""What describe() checks before a run starts: every split's samples alike and stackable,
class indices in range, in-memory values finite; and the number of classes."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch.utils.data import Dataset

from saturate.data.in_memory import InMemory
from saturate.data.samples import PADDED, dtype_name, entries, length, named_leaves, sample_of
from saturate.data.spec import DataSpec
from saturate.errors import DataError

log = logging.getLogger(__name__)


def _all_targets(dataset: Dataset, input_key: str = "input", target_key: str = "target") -> torch.Tensor:
    """Every target of the set: from its `targets`/`labels` attribute, or read one by one."""
    known = _known_targets(dataset, target_key)
    if known is not None:
        return known
    log.info(
        "data: reading every target once to count the classes (give the dataset a `classes` or `targets` attribute "
        "to skip this)"
    )
    return torch.stack([entries(dataset[i], "training", input_key, target_key)[1] for i in range(length(dataset))])


def _known_targets(dataset: Dataset, target_key: str = "target") -> torch.Tensor | None:
    """The set's targets when it holds them already (a `targets`/`labels` attribute of one per
    sample, or an in-memory tensor): checked for free; None when only reading every sample
    would tell."""
    if isinstance(dataset, InMemory):
        return dataset.tree[target_key] if isinstance(dataset.tree, dict) else dataset.targets
    for name in ("targets", "labels"):
        found = getattr(dataset, name, None)
        if isinstance(found, (torch.Tensor, np.ndarray, list, tuple)) and len(found) == length(dataset):
            return torch.as_tensor(np.asarray(found)) if not isinstance(found, torch.Tensor) else found
    return None


def _num_classes(dataset: Dataset, input_key: str = "input", target_key: str = "target") -> int:
    said, names = getattr(dataset, "num_classes", None), getattr(dataset, "classes", None)
    if isinstance(said, int):
        return said
    if isinstance(names, (list, tuple)):
        return len(names)
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


def differing(dataset: Dataset, what: str, first: tuple, keys: tuple) -> tuple | None:
    """(entry, sample, its shape, sample 0's) of the first of a few samples besides sample 0
    whose input (any of them) or target has another shape than sample 0's; None when they
    all match (a data set that returns whole batches makes them itself)."""
    if getattr(dataset, "returns_batches", False):
        return None
    n = length(dataset)
    mine = [*named_leaves(first[0], "input"), ("target", first[1])]
    for i in sorted({1, n // 2, n - 1} - {0}):
        if i >= n:
            continue
        x, y = entries(dataset[i], what, *keys)
        for (name, a), (_, b) in zip(mine, [*named_leaves(x, "input"), ("target", y)], strict=False):
            if a.shape != b.shape:
                return name, i, tuple(b.shape), tuple(a.shape)
    return None


def check_stacks(dataset: Dataset, what: str, first: tuple, keys: tuple) -> None:
    """Samples of one shape stack into a batch with torch's default collate; say which
    entry differs and the fix when they do not."""
    found = differing(dataset, what, first, keys)
    if found is not None:
        part, i, shape, shape0 = found
        raise DataError(
            f"data: {what} samples do not stack into a batch: the {part} of sample 0 has shape {shape0}, of "
            f"sample {i} {shape}; {PADDED}"
        )


def check_like_training(other: Dataset, what: str, first: tuple, keys: tuple, *, fixed: bool, collate: bool):
    """A validation or test set's samples have the training samples' structure, shapes and
    dtypes: the same shapes, or, where a collate batches them (`collate`; training samples of
    several shapes have one), the same past their first dimension (a sequence's length)."""
    x, y, structure = first
    vx, vy, other_structure = sample_of(other, what, *keys)
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
    collated = collate or not fixed  # a collate batches the samples: their lengths may differ
    for (name, a), (_, b) in zip(mine, theirs, strict=True):
        same = (b.shape[1:] == a.shape[1:] and b.ndim == a.ndim) if collated else b.shape == a.shape
        if not same or b.dtype != a.dtype:
            said = f"{what} {name} is {dtype_name(b)} {tuple(b.shape)}, the training {name} {dtype_name(a)}"
            if b.shape == a.shape:
                lifts = "they must match"
            elif collated:
                lifts = "samples must match past their first dimension (the length the collate pads)"
            else:
                lifts = _not_batches(b.ndim == a.ndim and b.shape[1:] == a.shape[1:])
            raise DataError(f"data: {said} {tuple(a.shape)}; {lifts}")
    same_target = (vy.ndim == y.ndim) if collated else (vy.shape == y.shape)
    if not same_target or vy.is_floating_point() != y.is_floating_point():
        said = (
            f"{what} targets are {dtype_name(vy)} {tuple(vy.shape)}, training targets {dtype_name(y)} {tuple(y.shape)}"
        )
        alike = "(the task and the metrics compare them alike)"
        if vy.is_floating_point() != y.is_floating_point():
            lifts = f"they must match {alike}"
        elif collated:
            lifts = f"they must match in their number of dimensions {alike}"
        else:
            lifts = f"they must match {alike}: {_not_batches(vy.ndim == y.ndim)}"
        raise DataError(f"data: {said}; {lifts}")
    if not collate:
        check_stacks(other, what, (vx, vy), keys)


def _not_batches(lengths: bool) -> str:
    """What lifts a refusal of another split's sample of another shape, as a user writes it:
    the split gives samples, not batches (the loader batches them); where only a sequence's
    length differs (`lengths`), a collate that pads them."""
    samples = "samples must match, not batches (the loader makes the batches: loader.eval_batch_size for evaluation)"
    if not lengths:
        return samples
    padded = "return {'train': ..., 'collate': saturate.data.pad_collate}"
    return f"{samples}; sequences of several lengths take a collate that pads them ({padded})"


def check_values(spec: DataSpec, splits: tuple) -> None:
    """Class indices in range (and at least two classes); in-memory values finite."""
    num_classes = spec.num_classes
    if spec.classes:
        assert num_classes is not None, "describe() counts the classes of class targets"
        if num_classes < 2:
            raise DataError(f"data: {num_classes} class(es) in the training targets; classification needs at least 2")
    for dataset, what in zip(splits, ("training", "validation", "test"), strict=True):
        if dataset is not None:
            _check_finite(dataset, what)
            if spec.classes and num_classes is not None:
                _check_classes(dataset, what, num_classes, spec.target_key)


def classes_of(train: Dataset, y: torch.Tensor, keys: tuple, classes: bool) -> int | None:
    """The number of classes: counted in the targets (classification, whose targets must be
    class indices: one per sample, or one per position of a sequence), else what the dataset
    says (num_classes, classes)."""
    integer = not (y.is_floating_point() or y.is_complex())
    if classes and not integer:
        raise DataError(
            f"task=classification: the targets are {dtype_name(y)} of shape {tuple(y.shape)}; classification needs "
            "integer class indices (one per sample, or one per position). For real-valued targets use task=regression"
        )
    num_classes = _num_classes(train, *keys) if classes else getattr(train, "num_classes", None)
    names = getattr(train, "classes", None)
    if num_classes is None and isinstance(names, (list, tuple)):
        num_classes = len(names)
    return num_classes
