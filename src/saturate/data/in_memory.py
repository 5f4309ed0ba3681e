"""Data sets held as tensors: InMemory (the built-in image sets, the resident loader's data),
and materialize(), which reads any data set of fixed-shape samples into one."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

from saturate.data.samples import as_tensor, length
from saturate.errors import DataError


class InMemory(Dataset):
    """A data set held as tensors with the samples along their first dimension: `inputs` and
    `targets` (N, ...), or any structure of such tensors (`tree`, e.g. a dict). Batches are
    gathered in one `index_select` per tensor (see `__getitems__`); the resident loader
    keeps them on the device."""

    returns_batches = True  # __getitems__ returns the collated batch (saturate.data.streaming)
    # what a source may say of its set (the data contract, saturate.data.base): declared, never
    # defaulted, so that a set that says nothing has no such attribute
    num_classes: int
    synthetic: bool

    def __init__(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None, *, tree=None):
        self.tree: Any = (inputs, targets) if tree is None else tree  # any structure (pytree) of tensors
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


def materialize(dataset: Dataset | list) -> InMemory:
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
    stores = [torch.empty((length(dataset), *leaf.shape), dtype=leaf.dtype) for leaf in leaves]
    for start in range(0, length(dataset), READ_CHUNK):  # a chunk at a time: the samples' copies stay small
        samples = [dataset[i] for i in range(start, min(start + READ_CHUNK, length(dataset)))]
        for store, values in zip(stores, _collated(samples, stores, start), strict=True):
            store[start : start + len(samples)] = values
    return InMemory(tree=tree_unflatten(stores, spec))


READ_CHUNK = 1024  # samples batched at once by materialize


def _collated(samples: list, stores: list[torch.Tensor], start: int) -> list[torch.Tensor]:
    """The leaves of `samples` batched by the default collate (one stack per entry, not a
    copy per entry per sample), or, where they do not batch as sample 0 did (another number of
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
