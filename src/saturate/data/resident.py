"""The resident loader: the whole data set held as tensors (on the device when it fits), a
batch an index slice of the epoch's order; and the rule that decides, for loader.resident=auto,
when data is read rather than computed and may be held so."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import time
from collections.abc import Iterator
from typing import cast

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map

from saturate.config.schema import LoaderConfig
from saturate.data.in_memory import InMemory, materialize, tensors_of
from saturate.data.samplers import ONE_PROCESS, Shard, batches_per_epoch, drawn_seed, epoch_sampler
from saturate.data.samples import stack
from saturate.data.spec import DataSpec
from saturate.data.to_device import DevicePipeline, HostBatch, PlainPipeline
from saturate.errors import DataError

log = logging.getLogger(__name__)

IN_MEMORY_S = 100e-6  # a sample read faster than this is in memory already: workers would only add copies


RESIDENT_NOTE = "loader.resident=auto: the data is read, not computed: held as tensors, each batch an index slice"
READ_ONCE_S = 2.0  # the most reading a data set once may take at start-up for loader.resident=auto


def memory_budget(device: torch.device) -> int:
    """Bytes of memory on `device` this process could still take. On CUDA: the device's free
    memory plus what this process's caching allocator holds unused (after the batch search
    and the compile warm-up it keeps their blocks: free to us, not to mem_get_info), and never
    past device.memory_fraction's cap on the allocator (torch 2.6 and newer: before, torch
    cannot say what the cap is, and the whole device counts). On the CPU: the host's
    available memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        held = torch.cuda.memory_reserved(device) - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
        cap = fraction * total - allocated
        return int(max(0, min(free + held, cap)))
    import psutil

    return psutil.virtual_memory().available


def resident_bytes(spec: DataSpec, samples: int) -> int:
    """What `samples` samples of this data take held as one tensor (inputs and targets)."""
    element = torch.empty((), dtype=spec.input_dtype).element_size()
    return samples * (math.prod(spec.input_shape) * element + 8 * max(1, math.prod(spec.target_shape)))


@contextlib.contextmanager
def room_for_resident(cfg: LoaderConfig, spec: DataSpec, samples: int, device: torch.device):
    """For the block, the device memory a resident data set will take is taken already (one
    empty tensor of its size): the batch-size search, run before the data is placed, then
    chooses a batch that leaves room for it. Nothing is taken when the data would stay in
    host memory (over resident_memory_fraction) or the device is not CUDA."""
    need = resident_bytes(spec, samples) if cfg.resident is True and device.type == "cuda" else 0
    held = (
        torch.empty(need, dtype=torch.uint8, device=device)
        if 0 < need <= cfg.resident_memory_fraction * memory_budget(device)
        else None
    )
    try:
        yield
    finally:
        del held


class ResidentLoader:
    """The whole data set stored once on the training device (images as uint8); a batch is an index
    slice of the epoch's permutation, gathered there: no workers, no per-batch copy
    (airbench-style). The permutation is the one ResumableSampler draws, so resident and
    streaming loaders see the same batches for the same seed.

    If the data would take more than `resident_memory_fraction` of the device's free memory,
    it stays in host memory and each gathered batch is staged through pinned memory for an
    asynchronous copy (a warning says so)."""

    def __init__(
        self,
        data: InMemory,
        cfg: LoaderConfig,
        to_device: DevicePipeline | PlainPipeline,
        *,
        train: bool,
        shard: Shard = ONE_PROCESS,
        limit_batches: int = -1,
        drawn: int = 0,
    ):
        device = to_device.device
        nbytes = data.nbytes
        budget = int(cfg.resident_memory_fraction * memory_budget(device))
        home = device
        if nbytes > budget:
            home = torch.device("cpu")
            log.warning(
                "loader.resident: the data (%.0f MB) exceeds loader.resident_memory_fraction=%g of free %s memory "
                "(%.0f MB); keeping it in host memory and staging batches through pinned memory",
                nbytes / 2**20,
                cfg.resident_memory_fraction,
                device.type,
                budget / 2**20,
            )
        self.tensors, self.dataset = tree_map(lambda t: t.to(home), data.tree), data
        self.home, self.to_device = home, to_device
        self.stage = home != device  # host-resident for a CUDA device: pin each gathered batch
        self.train, self.draws_globally = train, cfg.order == "global"
        self.sampler = epoch_sampler(data, cfg, train=train, shard=shard, drawn=drawn)
        self.batch_size, self.num_workers = cfg.batch_size, 0
        self.batches_per_epoch = batches_per_epoch(
            self.sampler.num_samples, cfg.batch_size, cfg.drop_last and train, limit_batches
        )

    def __len__(self) -> int:
        return self.batches_per_epoch

    def order(self, epoch: int, start: int = 0) -> torch.Tensor:
        """This rank's sample order for `epoch`: the training sampler's, computed as a tensor
        (its list form costs milliseconds per epoch at CIFAR size); for evaluation, the
        unpadded shard. With loader.order=global it draws what a plain DataLoader's iterator
        draws from torch's global generator when it starts: its base seed (no workers here
        to use it), then, for training, the order's seed."""
        s = self.sampler
        if self.draws_globally and start == 0:
            drawn_seed()
        if not self.train:  # in order, in streams, or drawn for this evaluation
            s.set_epoch(epoch)
            return torch.tensor(s.indices, dtype=torch.int64)
        s.set_epoch(epoch)
        s.start = start
        return s.shard(s.permutation())

    def epoch(self, epoch: int, start: int = 0) -> Iterator[HostBatch]:
        self.to_device.begin_epoch(epoch, start)
        order = self.order(epoch, start)
        # pinned and queued behind the last step: the host does not wait for the GPU to drain
        if self.home.type == "cuda":
            order = order.pin_memory().to(self.home, non_blocking=True)
        for b in range(start, self.batches_per_epoch):
            index = order[b * self.batch_size : (b + 1) * self.batch_size]
            yield tree_map(functools.partial(_gather, index=index, pin=self.stage), self.tensors)


def _gather(t: torch.Tensor, index: torch.Tensor, pin: bool) -> torch.Tensor:
    out = t.index_select(0, index)
    return out.pin_memory() if pin else out


def resident_for(cfg: LoaderConfig, data, spec: DataSpec, device: torch.device, workers: int, placement: str) -> bool:
    """loader.resident, decided. `auto` holds the data resident on a CPU run when no worker
    is asked for and every split is read, not computed (`read_in_place`): tensors in memory
    already (InMemory), or a data set whose samples take micro-seconds to read, come back the
    same each time and batch the same way as tensors, read once in at most READ_ONCE_S and
    within resident_memory_fraction of the host's available memory. Batches are then index
    slices, the DataLoader's per-batch work gone: the same batches in the same order
    (ResidentLoader). On CUDA, auto stays off: the data set in device memory is
    loader=resident's choice."""
    if cfg.resident != "auto":
        return bool(cfg.resident)
    if device.type != "cpu" or workers != 0 or placement == "cpu" or not spec.fixed or data.collate is not None:
        return False
    splits = [s for s in (data.train, data.val, data.test) if s is not None]
    reads = [read_in_place(s) for s in splits]
    known = [r for r in reads if r is not None]
    if len(known) < len(reads):
        return False
    seconds = sum(len(s) * r[1] for s, r in zip(splits, known, strict=True))  # InMemory's: 0
    nbytes = sum(len(s) * r[0] for s, r in zip(splits, known, strict=True))
    return seconds <= READ_ONCE_S and nbytes <= cfg.resident_memory_fraction * memory_budget(device)


def read_in_place(dataset) -> tuple[int, float] | None:
    """(bytes, seconds) a sample of `dataset` takes held and read, if the data set is read,
    not computed: InMemory; or map-style, two samples each read in under IN_MEMORY_S, the
    same twice (bit for bit), no global generator moved by reading them, and stacked by the
    default collate into what materialize() holds. Else None (a random augmentation in
    __getitem__, files to decode, entries the collate batches otherwise)."""
    if isinstance(dataset, InMemory):
        return dataset.nbytes // max(1, len(dataset)), 0.0
    map_style = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    if not map_style or isinstance(dataset, torch.utils.data.IterableDataset) or not len(dataset):
        return None
    source = tensors_of(dataset)
    if source is not None:  # gathered, not read: no time per sample
        return sum(t[0].nbytes for t in source[0]), 0.0
    # get_state()'s default (legacy=True) is the legacy tuple, which numpy's stubs do not single out
    numpy, python, torch_state = cast(tuple, np.random.get_state()), random.getstate(), torch.get_rng_state()
    try:  # what it draws, put back: the DataLoader's runs must see the streams they would without the probe
        started = time.perf_counter()
        first = [dataset[i] for i in (0, len(dataset) // 2)]
        seconds = (time.perf_counter() - started) / 2
        if seconds >= IN_MEMORY_S:  # files to decode
            return None
        again = [dataset[i] for i in (0, len(dataset) // 2)]
        after = cast(tuple, np.random.get_state())
        moved = not (
            torch.equal(torch_state, torch.get_rng_state())
            and np.array_equal(numpy[1], after[1])
            and numpy[2:] == after[2:]
            and python == random.getstate()
        )
    except Exception:  # noqa: BLE001 (a sample that cannot be read: the DataLoader meets it and says so in its words)
        return None
    finally:
        torch.set_rng_state(torch_state)
        np.random.set_state(numpy)
        random.setstate(python)
    if moved:
        return None
    try:
        collated, held = stack(first), materialize(first).tree
    except (DataError, TypeError, RuntimeError):
        return None
    pairs = list(zip(tree_leaves(collated), tree_leaves(held), strict=False))
    same = len(tree_leaves(collated)) == len(tree_leaves(held)) and all(
        isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs
    )
    if not same or not _equal(first, again):
        return None
    return sum(t.nbytes for t in tree_leaves(held)) // 2, seconds


def _equal(a, b) -> bool:
    """Two reads of the same samples, bit for bit."""
    la, lb = tree_leaves(a), tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y) for x, y in zip(la, lb, strict=True)
    )
