"""The streaming loader: a torch DataLoader over a map-style data set, its worker processes
supervised (a stalled or dead worker stops the run with one clear error, never a hang)."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from saturate.config.schema import LoaderConfig
from saturate.data.augment import SampleAugment
from saturate.data.samplers import ONE_PROCESS, Shard, batches_per_epoch, drawn_seed, epoch_sampler
from saturate.data.samples import stack
from saturate.data.to_device import DevicePipeline, HostBatch
from saturate.errors import DataError, UserError


def already_collated(batch: HostBatch) -> HostBatch:
    """collate_fn for datasets whose __getitems__ returns a whole batch."""
    return batch


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
        shard: Shard = ONE_PROCESS,
        limit_batches: int = -1,
        collate=None,
        drawn: int = 0,
    ):
        self.to_device = to_device
        workers = cfg.num_workers
        keyed = isinstance(dataset, SampleAugment)  # its items are asked for by (epoch, index)
        self.sampler = epoch_sampler(dataset, cfg, train=train, shard=shard, keyed=keyed, drawn=drawn)
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
        self._workers_iter: Iterator[HostBatch] | None = None  # the epoch's worker iterator (close() ends its workers)

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
        batches: Iterator[HostBatch]
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
        workers_iter: Any = iter(self.loader)  # the workers' iterator: its private state is reached below
        self._workers_iter = workers_iter
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
    with contextlib.ExitStack() as closing:
        if hasattr(batches, "close"):
            closing.callback(batches.close)
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
