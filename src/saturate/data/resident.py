"""Batches for the loop: host batches from a DataLoader, moved to the device by `to_device`.

The engine only sees two calls: `epoch(e, start)` gives the host batches of epoch `e` from
batch `start` on (so a run resumes mid-epoch in the same order), and `to_device(batch)`
copies one batch to the device and prepares it there. Where augmentation runs is decided
when the loader is built, never in the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from saturate.config.schema import AugmentationConfig, LoaderConfig, TrainerConfig
from saturate.data.augment import BatchAugment, Preview, SampleAugment, Schedule
from saturate.data.base import DataSpec, InMemory, materialize, stack, tensors_of
from saturate.data.mix import MixedPipeline
from saturate.errors import DataError, UserError

log = logging.getLogger(__name__)

# what the collate makes: (inputs, targets), a dict, nested; uint8 or float images (B, C, H, W) among them
HostBatch = object


@dataclass(frozen=True)
class Shard:
    """Which share of the samples this rank reads (`rank` of `world_size`), in the order
    `seed` (and the epoch) draws."""

    seed: int = 0
    rank: int = 0
    world_size: int = 1


def cpus_per_process() -> int:
    """CPUs this process may use, shared with the other processes on this node."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def auto_workers(per_sample_work: bool, cap: int = 8) -> int:
    """The `num_workers: auto` rule. Data that is already an in-memory tensor needs no
    workers: a worker would only add inter-process copies. Otherwise one worker per CPU
    this process may use, less one for the main process, at most `cap`."""
    if not per_sample_work:
        return 0
    return max(1, min(cap, cpus_per_process() - 1))


def move(batch, device: torch.device, non_blocking: bool, keep: tuple[str, ...] = ()):
    """Every tensor of a batch (any structure: torch's pytree) on `device`, but a dict's
    entries named in `keep` (what the task reads on the host: CTC's lengths, which PyTorch's
    loss would otherwise copy back with a blocking copy); float64 becomes float32, the
    model's dtype. Host tensors are pinned by the loader on CUDA, so the copies run
    asynchronously."""

    def to(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.to(device, dtype=torch.float32 if leaf.dtype == torch.float64 else None, non_blocking=non_blocking)

    if keep and isinstance(batch, dict):
        return {k: v if k in keep else tree_map(to, v) for k, v in batch.items()}
    return tree_map(to, batch)


class PlainPipeline:
    """Host batch -> device batch, values unchanged: inputs that are not images reach the
    model as the dataset gave them (float64 becomes float32, the model's dtype); the task
    casts the targets it reads."""

    def __init__(self, device: torch.device, *, non_blocking: bool, keep: tuple[str, ...] = ()):
        self.device, self.non_blocking, self.keep = device, non_blocking, keep

    def begin_epoch(self, epoch: int, start: int) -> None:
        pass

    def __call__(self, batch):
        return move(batch, self.device, self.non_blocking, self.keep)


class DevicePipeline:
    """Host image batch -> the model's batch on the device: the whole batch copied, then its
    image entry (`entry`: 0 of a pair, the input key of a dict) augmented there (when
    augmentation runs on the device), normalised (uint8 images; float images in [0, 1] are
    left as they are) and laid out as channels_last if asked.

    `preview(x, epoch)`, if given, sees the images the model gets before normalisation
    (uint8, or floats in [0, 1]) and decides when to record them.
    """

    def __init__(
        self,
        device: torch.device,
        mean,
        std,
        *,
        non_blocking: bool,
        channels_last: bool,
        augment=None,
        preview=None,
        entry=0,
        normalise: bool = True,
        mask_entry=None,
        keep: tuple[str, ...] = (),
    ):
        self.device, self.non_blocking, self.augment, self.preview = device, non_blocking, augment, preview
        self.entry, self.normalise, self.mask_entry, self.keep = entry, normalise, mask_entry, keep
        if normalise:
            std = torch.tensor(std, device=device).view(1, -1, 1, 1)
            # (x - mean) / std
            self.scale, self.shift = (
                1 / std,
                -torch.tensor(mean, device=device).view(1, -1, 1, 1) / std,
            )
            self.scale_u8 = self.scale / 255  # the same, straight from uint8 when nothing runs in between
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.epoch = self.batch = 0

    def begin_epoch(self, epoch: int, start: int) -> None:
        self.epoch, self.batch = epoch, start

    def __call__(self, batch):
        batch = move(batch, self.device, self.non_blocking, self.keep)
        x = batch[self.entry]
        uint8 = x.dtype == torch.uint8
        if self.augment is None:
            if self.preview is not None:
                self.preview(x, self.epoch)
            if uint8 and self.normalise:
                x = x.float().mul_(self.scale_u8).add_(self.shift)
        else:
            x = x.float().div_(255) if uint8 else x.float()
            if self.mask_entry is None:
                x = self.augment(x, self.epoch, self.batch)
            else:  # the targets are masks of the images: moved with them
                x, masks = self.augment(x, self.epoch, self.batch, batch[self.mask_entry])
                batch = _replace(batch, self.mask_entry, masks)
            if self.preview is not None:
                self.preview(x, self.epoch)
            if uint8 and self.normalise:
                x = x.mul_(self.scale).add_(self.shift)
        self.batch += 1
        return _replace(batch, self.entry, x.contiguous(memory_format=self.memory_format))


def _replace(batch, entry, value):
    """`batch` with `entry` (a pair's index, a dict's key) replaced by `value`."""
    if isinstance(batch, dict):
        return {**batch, entry: value}
    parts = list(batch)
    parts[entry] = value
    return type(batch)(parts) if isinstance(batch, tuple) else parts


def already_collated(batch: HostBatch) -> HostBatch:
    """collate_fn for datasets whose __getitems__ returns a whole batch."""
    return batch


GROUP_SPAN = 4  # groups (shards) shuffled together: a worker reads from about this many at a time


def grouped_permutation(sizes: list[int], generator: torch.Generator, span: int = GROUP_SPAN) -> list[int]:
    """A shuffle that keeps reads local: the groups (contiguous index ranges of these sizes,
    e.g. a data set's shards) in a random order, `span` of them at a time shuffled together.
    A function of the generator's seed only, like torch.randperm."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    order = torch.randperm(len(sizes), generator=generator).tolist()
    indices: list[int] = []
    for k in range(0, len(order), span):
        members = torch.cat([torch.arange(starts[g], starts[g] + sizes[g]) for g in order[k : k + span]])
        indices += members[torch.randperm(len(members), generator=generator)].tolist()
    return indices


def drawn_seed() -> int:
    """One int64 from torch's global generator, drawn as torch.utils.data draws a DataLoader
    iterator's base seed and RandomSampler (no generator given) its epoch's seed."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class ResumableSampler(DistributedSampler):
    """DistributedSampler (sharded by rank) that can start an epoch part-way through, at the
    first sample of batch `start`. Its epoch's order is torch.randperm under a seed: seed +
    epoch (`order="seeded"`, DistributedSampler's), or one drawn from torch's global generator
    (`order="global"`, RandomSampler's draw: a plain loop's order for the same seed; the
    draw made before a resume inside the epoch is kept, see state_dict). With `keyed`, it
    yields (epoch, index) so that a per-sample augmentation in a worker knows the epoch. A
    data set with `sample_groups` (its shards' sizes) is shuffled group-wise
    (grouped_permutation)."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        keyed: bool,
        order: str = "seeded",
    ):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        self.batch_size, self.start, self.keyed, self.order = batch_size, 0, keyed, order
        self.groups = getattr(dataset, "sample_groups", None)
        self.drawn: tuple[int, int] | None = None  # order=global: (epoch, the seed drawn for it)

    def epoch_seed(self) -> int:
        """The seed of this epoch's order (a global one is drawn here, unless the epoch resumes
        part-way through with the seed drawn when it began)."""
        if self.order == "seeded":
            return self.seed + self.epoch
        if not (self.start > 0 and self.drawn is not None and self.drawn[0] == self.epoch):
            self.drawn = (self.epoch, drawn_seed())
        return self.drawn[1]

    def permutation(self) -> torch.Tensor:
        """All samples in this epoch's order, before sharding."""
        generator = torch.Generator().manual_seed(self.epoch_seed())
        if self.groups:
            return torch.tensor(grouped_permutation(self.groups, generator), dtype=torch.int64)
        return torch.randperm(len(self.dataset), generator=generator)

    def shard(self, order: torch.Tensor) -> torch.Tensor:
        """This rank's share, as DistributedSampler takes it: equal shares (the order repeated
        from its start to fill the last), every world_size-th sample from `rank`."""
        if self.drop_last:
            order = order[: self.total_size]
        elif (padding := self.total_size - len(order)) > 0:
            order = torch.cat([order, order.repeat(-(-padding // len(order)))[:padding]])
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator:
        indices = self.shard(self.permutation())[self.start * self.batch_size :].tolist()
        return ((self.epoch, i) for i in indices) if self.keyed else iter(indices)

    def __len__(self) -> int:
        return self.num_samples - self.start * self.batch_size

    def state_dict(self) -> dict:
        """What a resume inside an epoch needs of the order: the seed drawn for it (global)."""
        return {"order": self.order, "drawn": list(self.drawn) if self.drawn else None}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("order", "seeded")
        if saved != self.order:
            log.warning(
                "loader.order=%s, the checkpoint's run had %s: an epoch resumed part-way through mixes the two orders "
                "(samples seen twice or not at all); resume at an epoch's end, or with loader.order=%s",
                self.order,
                saved,
                saved,
            )
        drawn = state.get("drawn") if saved == self.order else None
        self.drawn = tuple(drawn) if drawn else None


class EvalShard(torch.utils.data.Sampler):
    """This rank's share of an evaluation set, in order and without the padding a
    DistributedSampler adds (it would count some samples twice)."""

    def __init__(self, n: int, rank: int, world_size: int):
        self.indices = range(rank, n, world_size)
        self.num_samples, self.start = len(self.indices), 0

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def epoch_sampler(dataset: Dataset, cfg: LoaderConfig, *, train: bool, shard: Shard, keyed: bool = False):
    """Training: shuffled (loader.order), sharded by rank, resumable. Evaluation: this
    rank's share in order, unpadded."""
    if train:
        return ResumableSampler(
            dataset,
            batch_size=cfg.batch_size,
            seed=shard.seed,
            rank=shard.rank,
            world_size=shard.world_size,
            keyed=keyed,
            order=cfg.order,
        )
    return EvalShard(len(dataset), shard.rank, shard.world_size)


def batches_per_epoch(samples: int, batch_size: int, drop_last: bool, limit: int) -> int:
    full = samples // batch_size if drop_last else -(-samples // batch_size)
    return full if limit < 0 else min(full, limit)


class StreamLoader:
    """A torch DataLoader over a map-style dataset, with resumable epochs. `cfg`: the loader's
    node with `num_workers` and `pin_memory` decided (no "auto")."""

    def __init__(
        self,
        dataset: Dataset,
        cfg: LoaderConfig,
        to_device: DevicePipeline,
        *,
        train: bool,
        shard: Shard = Shard(),
        limit_batches: int = -1,
        collate=None,
    ):
        self.to_device = to_device
        workers = cfg.num_workers
        keyed = isinstance(dataset, SampleAugment)  # its items are asked for by (epoch, index)
        self.sampler = epoch_sampler(dataset, cfg, train=train, shard=shard, keyed=keyed)
        self.drop_last = cfg.drop_last and train
        self.generator = torch.Generator()  # seeds the workers; reseeded every epoch
        self.seed, self.draws_globally = shard.seed, cfg.order == "global"
        self.loader = DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            sampler=self.sampler,
            num_workers=workers,
            pin_memory=cfg.pin_memory,
            drop_last=self.drop_last,
            persistent_workers=cfg.persistent_workers and workers > 0,
            prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
            generator=self.generator,
            collate_fn=already_collated if getattr(dataset, "returns_batches", False) else (collate or stack),
            timeout=cfg.timeout_s if workers > 0 else 0,
        )
        self.batches_per_epoch = batches_per_epoch(
            self.sampler.num_samples, cfg.batch_size, self.drop_last, limit_batches
        )
        self.batch_size, self.num_workers, self.dataset = cfg.batch_size, workers, dataset
        self.timeout_s = cfg.timeout_s
        self.poll = getattr(dataset, "poll", None)  # e.g. names the files the workers skipped (saturate.data.base)
        self._workers_iter = None  # the epoch's worker iterator (close() ends its workers)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def close(self) -> None:
        """End the workers now: the persistent ones, and an epoch's that a failure left behind
        (DataLoader ends them only when its iterator is collected, which an error's
        traceback delays: a notebook's fit() after fit() kept every earlier run's)."""
        for workers_iter in (getattr(self.loader, "_iterator", None), self._workers_iter):
            if workers_iter is not None and hasattr(workers_iter, "_shutdown_workers"):
                workers_iter._shutdown_workers()
        self.loader._iterator = self._workers_iter = None

    def epoch(self, epoch: int, start: int = 0) -> Iterator[HostBatch]:
        self.sampler.set_epoch(epoch)
        self.sampler.start = start
        self.to_device.begin_epoch(epoch, start)
        self.generator.manual_seed(self.seed * 1_000_003 + epoch)
        # loader.order=global: the iterator draws its base seed (the workers') from torch's global generator, as a
        # plain DataLoader's does; not when the epoch resumes part-way through (that draw came before the checkpoint).
        # A persistent iterator, reused, would draw nothing: the draw is made for it, so that persistent workers change
        # nothing and a resumed run (a fresh iterator) draws what the uninterrupted one did
        draws = self.draws_globally and start == 0
        if draws and self.loader._iterator is not None:
            drawn_seed()
        self.loader.generator = None if draws else self.generator
        if self.num_workers == 0:
            batches = itertools.islice(self.loader, max(0, self.batches_per_epoch - start))
        else:
            batches = self._supervised(max(0, self.batches_per_epoch - start))
        return batches if self.poll is None else _polled(batches, self.poll)

    def _supervised(self, count: int) -> Iterator[HostBatch]:
        """Batches from the workers, each fetch bounded by the watchdog; when a fetch fails
        (stalled, timed out, a worker died), the workers are killed before the error goes
        on: a frozen (SIGSTOPped) worker ignores the SIGTERM DataLoader's shutdown sends,
        and joining it would hang the run that is trying to stop. The workers start at the
        first fetch, inside the loop's timing, as they did without supervision."""
        workers_iter = self._workers_iter = iter(self.loader)
        try:
            yield from watched(itertools.islice(workers_iter, count), self.timeout_s)
        except UserError as e:  # the data set's own words, without the worker's traceback DataLoader adds
            raise own_words(e) from None  # its healthy workers end with the run (close())
        except RuntimeError:
            from torch.utils.data._utils.signal_handling import _remove_worker_pids

            # as DataLoader's own shutdown does: unregister the workers, so that their deaths
            # do not raise again (torch's SIGCHLD check) while this error unwinds
            if getattr(workers_iter, "_worker_pids_set", False):
                _remove_worker_pids(id(workers_iter))
                workers_iter._worker_pids_set = False
            for worker in getattr(workers_iter, "_workers", []):
                if worker.is_alive():
                    os.kill(worker.pid, signal.SIGKILL)
            raise


def _polled(batches: Iterator[HostBatch], poll) -> Iterator[HostBatch]:
    """`poll()` as each batch arrives, and once more at the end."""
    with contextlib.closing(batches) if hasattr(batches, "close") else contextlib.nullcontext():
        for batch in batches:
            poll()
            yield batch
    poll()


class LoaderStalled(RuntimeError):
    """No batch within loader.timeout_s, wherever the main process was waiting."""


def _stalled(signum, frame):
    raise LoaderStalled("DataLoader timed out: no batch arrived (the watchdog on the whole fetch)")


def watched(batches: Iterator[HostBatch], timeout_s: float) -> Iterator[HostBatch]:
    """`batches`, each fetch bounded by `timeout_s` as a whole. DataLoader's own timeout
    covers only its wait on the worker queue, not the hand-over of the batch's shared memory
    that follows, where a frozen worker (SIGSTOP, a hung NFS read) blocks the main process
    forever; a real-time timer (SIGALRM) interrupts the wait wherever it is. Two system calls
    per batch; none when timeout_s is 0 or outside the main thread (no signals there)."""
    if timeout_s <= 0 or threading.current_thread() is not threading.main_thread():
        yield from batches
        return
    previous = signal.signal(signal.SIGALRM, _stalled)
    try:
        while True:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            yield batch
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def own_words(error: UserError) -> UserError:
    """A UserError re-raised by DataLoader from a worker carries "Caught X in DataLoader
    worker process N" and the worker's traceback as its message; the user gets the original
    message (the traceback's last line, after "module.X: "), as without workers."""
    text = str(error)
    marker = f"{type(error).__module__}.{type(error).__qualname__}: "
    if not text.startswith("Caught ") or marker not in text:
        return error
    message = text[text.rindex(marker) + len(marker) :].strip()
    try:
        return type(error)(message)
    except TypeError:  # a UserError built from other arguments (ConfigError): the message as a plain one
        return UserError(message)


def loader_failure(error: Exception, timeout_s: float, workers: int) -> DataError | None:
    """A DataLoader worker that hung past the timeout or died, as one clear error (None if
    `error` is something else). A worker that dies mid-send can also surface as the pipe's
    own error (ConnectionResetError, EOFError) before the DataLoader notices the death. The
    DataLoader shuts its other workers down as it unwinds, so none is left behind."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if text.startswith("Caught "):  # the dataset's own error, re-raised from a worker: it stays itself
        return None
    if workers and isinstance(error, (ConnectionError, EOFError)):
        text = f"{type(error).__name__}: {text or 'the pipe closed'}"
    elif "DataLoader" not in text or not ("timed out" in text or "worker" in text):
        return None
    what = f"no batch within loader.timeout_s={timeout_s:g} s" if "timed out" in text else "a worker process died"
    return DataError(
        f"loader: {what} ({text}); the run stopped. Look at the dataset's __getitem__, or lower loader.num_workers"
    )


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
        shard: Shard = Shard(),
        limit_batches: int = -1,
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
        self.sampler = epoch_sampler(data, cfg, train=train, shard=shard)
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
        if not self.train:
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


def build_pipeline(
    cfg: LoaderConfig, spec: DataSpec, device: torch.device, trainer: TrainerConfig, augment=None, preview=None
) -> DevicePipeline | PlainPipeline:
    """Images: normalised (uint8) and augmented on the device; anything else: unchanged."""
    if not spec.image:
        return PlainPipeline(device, non_blocking=cfg.non_blocking, keep=spec.host_keys)
    return DevicePipeline(
        device,
        spec.mean,
        spec.std,
        non_blocking=cfg.non_blocking,
        channels_last=trainer.channels_last,
        augment=augment,
        preview=preview,
        entry=spec.image_entry,
        normalise=not spec.float_image,
        mask_entry=spec.target_entry if augment is not None and spec.mask_target else None,
        keep=spec.host_keys,
    )


def device_augment(aug: AugmentationConfig, seed: int, transforms=None) -> BatchAugment | None:
    """The batched (device) placement of the augmentation policy (or the user's transforms), or None."""
    if aug.placement != "gpu":
        return None
    return BatchAugment(transforms or Schedule.from_config(aug), seed=seed)


IN_MEMORY_S = 100e-6  # a sample read faster than this is in memory already: workers would only add copies


RESIDENT_NOTE = "loader.resident=auto: the data is read, not computed: held as tensors, each batch an index slice"
READ_ONCE_S = 2.0  # the most reading a data set once may take at start-up for loader.resident=auto


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
    if any(r is None for r in reads):
        return False
    seconds = sum(len(s) * r[1] for s, r in zip(splits, reads, strict=True))  # InMemory's: 0
    nbytes = sum(len(s) * r[0] for s, r in zip(splits, reads, strict=True))
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
    numpy, python, torch_state = np.random.get_state(), random.getstate(), torch.get_rng_state()
    try:  # what it draws, put back: the DataLoader's runs must see the streams they would without the probe
        started = time.perf_counter()
        first = [dataset[i] for i in (0, len(dataset) // 2)]
        seconds = (time.perf_counter() - started) / 2
        if seconds >= IN_MEMORY_S:  # files to decode
            return None
        again = [dataset[i] for i in (0, len(dataset) // 2)]
        after = np.random.get_state()
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


def auto_workers_for(spec: DataSpec, per_sample_augment: bool) -> tuple[int, str]:
    """loader.num_workers=auto, and why: 0 for data already in memory (a sample read in
    micro-seconds: tensors, numpy arrays), else one worker per CPU this process may use, less
    one for the main process (saturate.data.loader.auto_workers)."""
    fast = spec.in_memory or (spec.sample_s is not None and spec.sample_s < IN_MEMORY_S)
    if fast and not per_sample_augment:
        read = f"{1e6 * spec.sample_s:.0f} us" if spec.sample_s is not None else "no time"
        return (
            0,
            f"num_workers=auto: a sample takes {read} to read, the data is in memory; workers would only add copies",
        )
    return auto_workers(per_sample_work=True), ""


@dataclass
class Loaders:
    """The batches of each split (val and test when the data has them)."""

    train: StreamLoader | ResidentLoader
    val: StreamLoader | ResidentLoader | None = None
    test: StreamLoader | ResidentLoader | None = None
    workers_note: str = ""  # why num_workers=auto chose what it chose
    resident: bool = False  # the data held as tensors, batches index slices (loader.resident, decided)

    def close(self) -> None:
        """Every split's worker processes ended (at the end of a run, whatever ended it). A
        worker's death that torch's SIGCHLD handler raises meanwhile changes nothing then (its
        shutdown still ends the others)."""
        for batches in (self.train, self.val, self.test):
            with contextlib.suppress(RuntimeError, ConnectionError, EOFError):
                getattr(batches, "close", lambda: None)()


def build_loaders(
    cfg: LoaderConfig,
    aug: AugmentationConfig,
    data,
    spec: DataSpec,
    *,
    device: torch.device,
    trainer: TrainerConfig,
    shard: Shard = Shard(),
    show_images=None,
    transforms=None,
    mix=None,
) -> Loaders:
    """Training, validation and test batches (those the data has). Augmentation is placed
    here, once: per sample in the training dataset (cpu), or on the device in the training
    pipeline (gpu). `show_images(tag, images, step)` records what the augmentation does
    (TensorBoard). `data`: saturate.data.Data (its splits and collate)."""
    train_set = data.train
    schedule = (transforms or Schedule.from_config(aug)) if aug.placement != "none" else None
    if aug.placement == "cpu":
        mask = spec.target_entry if spec.mask_target else None
        train_set = SampleAugment(train_set, schedule, seed=shard.seed, entry=spec.image_entry, mask_entry=mask)
    note = ""
    if cfg.num_workers == "auto":
        workers, note = auto_workers_for(spec, per_sample_augment=aug.placement == "cpu")
    else:
        workers = cfg.num_workers
    pin = device.type == "cuda" if cfg.pin_memory == "auto" else cfg.pin_memory
    resident = resident_for(cfg, data, spec, device, workers, aug.placement)
    note = RESIDENT_NOTE if resident and cfg.resident == "auto" else note
    cfg = dataclasses.replace(cfg, num_workers=workers, pin_memory=pin, resident=resident)  # the loaders are built so
    _check_loadable(cfg, spec, len(train_set), shard.world_size)

    pipeline = functools.partial(build_pipeline, cfg, spec, device, trainer)
    preview = (
        Preview(show_images, schedule, aug.preview_images)
        if aug.preview_images and spec.image and show_images
        else None
    )
    # ranks differ
    train_pipeline = pipeline(
        augment=device_augment(aug, shard.seed + 1_000_003 * shard.rank, transforms), preview=preview
    )
    if mix is not None:  # after the augmentation and normalisation, on the device
        keys = (spec.image_entry, 1) if spec.structure == "pair" else (spec.input_key, spec.target_key)
        train_pipeline = MixedPipeline(train_pipeline, mix, input_key=keys[0], target_key=keys[1])
    if cfg.resident:
        make = lambda dataset, pipe, **kw: ResidentLoader(materialize(dataset), cfg, pipe, shard=shard, **kw)  # noqa: E731
    else:
        make = lambda dataset, pipe, **kw: StreamLoader(dataset, cfg, pipe, shard=shard, collate=data.collate, **kw)  # noqa: E731
    train = make(train_set, train_pipeline, train=True, limit_batches=trainer.limit_train_batches)
    evaluation = dict(train=False, limit_batches=trainer.limit_val_batches)
    val, test = (None if s is None else make(s, pipeline(), **evaluation) for s in (data.val, data.test))
    if test is not None:  # the test set is evaluated whole, once
        test.batches_per_epoch = batches_per_epoch(test.sampler.num_samples, cfg.batch_size, False, -1)
    kind = f"resident on {train.home}" if cfg.resident else f"{workers} workers, pin_memory={pin}"
    if note:
        kind += f" ({note})"
    log.info("loader: batch %d, %s; augmentation: %s %s", cfg.batch_size, kind, aug.placement, _stages(schedule))
    return Loaders(train, val, test, note, resident=resident)


def _check_loadable(cfg: LoaderConfig, spec: DataSpec, samples: int, world_size: int) -> None:
    """A training batch that fits in the training set; a global order in one process only;
    resident data of one shape."""
    if cfg.batch_size * world_size > samples:
        ranks = f" across {world_size} ranks" if world_size > 1 else ""
        raise UserError(f"loader.batch_size={cfg.batch_size}: larger than the training set ({samples} samples{ranks})")
    if cfg.order == "global" and world_size > 1:
        raise UserError(
            f"loader.order=global: one process only ({world_size} ranks would each draw an order from their own "
            "generator, and their shares could overlap); use loader.order=seeded"
        )
    if cfg.resident and not spec.fixed:
        raise UserError(
            "loader.resident=true: the samples differ in shape (variable length, batched by the data's collate); a "
            "resident data set holds samples of one shape: use loader=default"
        )


def _stages(schedule) -> str:
    """The augmentation's stages in words, for the log."""
    if isinstance(schedule, Schedule):
        return " -> ".join(f"{p.name} from epoch {e}" for e, p in schedule.stages)
    return "your transforms" if schedule is not None else ""
