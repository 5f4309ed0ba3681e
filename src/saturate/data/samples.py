"""A sample's entries: its input and target read from a pair or a dict, as tensors, named by
their place; and samples stacked into a batch (torch's default collate, with a refusal that
names the entry whose shapes differ)."""

from __future__ import annotations

from collections.abc import Sized
from typing import Any, cast

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map
from torch.utils.data import Dataset, default_collate

from saturate.errors import DataError

# What lifts a refusal of samples that do not stack, as a user writes it: a collate that pads
# (the data callable's `collate` entry), or a data set that makes its batches itself
PADDED = (
    "pad them to one shape in the data set, give the data a collate function that pads a batch (return {'train': "
    "..., 'collate': saturate.data.pad_collate}), or batch them in the data set (returns_batches = True, its "
    "__getitems__(indices) returning the batch)"
)


def length(dataset: Dataset | Sized) -> int:
    """The samples of a map-style data set: len(), which torch's Dataset leaves to its
    subclasses to define (a data set without one raises TypeError, as len() does)."""
    return len(cast(Sized, dataset))


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


def sample_of(
    dataset: Dataset, what: str, input_key, target_key: str, index: int = 0
) -> tuple[object, torch.Tensor, str]:
    """(input, target, structure) of sample `index`: a pair, or a dict holding both."""
    try:
        n = length(dataset)
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
            "dicts and lists; drop that entry from the samples, or give the data a collate function (return "
            "{'train': ..., 'collate': fn})"
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
                f"{other}; {PADDED}"
            )
    raise DataError("data: samples do not stack into a batch (their shapes differ)")


def named_leaves(tree, name: str) -> list[tuple[str, Any]]:
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


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
