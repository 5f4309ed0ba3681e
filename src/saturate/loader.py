"""Batches for the loop: host batches from a DataLoader, moved to the device by `to_device`.

The engine only sees two calls: `epoch(e, start)` gives the host batches of epoch `e` from
batch `start` on (so a run resumes mid-epoch in the same order), and `to_device(batch)`
copies one batch to the device and prepares it there. Where augmentation runs is decided
when the loader is built, never in the loop.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from saturate.config import LoaderConfig

log = logging.getLogger(__name__)

HostBatch = tuple[torch.Tensor, torch.Tensor]  # uint8 images (B, C, H, W), int64 labels (B,)


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


class ToDevice:
    """Host uint8 batch -> normalised float batch on the device (optionally channels_last)."""

    def __init__(self, device: torch.device, mean, std, *, non_blocking: bool, channels_last: bool):
        self.device, self.non_blocking = device, non_blocking
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, batch: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        x = x.to(self.device, non_blocking=self.non_blocking)
        y = y.to(self.device, non_blocking=self.non_blocking)
        x = x.float().div_(255).sub_(self.mean).div_(self.std)
        return x.contiguous(memory_format=self.memory_format), y


class ResumableSampler(DistributedSampler):
    """DistributedSampler (seeded by seed + epoch, sharded by rank) that can start an epoch
    part-way through, at the first sample of batch `start`."""

    def __init__(self, dataset: Dataset, *, batch_size: int, shuffle: bool, seed: int, rank: int, world_size: int):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
        self.batch_size, self.start = batch_size, 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.start * self.batch_size, None)

    def __len__(self) -> int:
        return self.num_samples - self.start * self.batch_size


class StreamLoader:
    """A torch DataLoader over a map-style dataset, with resumable epochs."""

    def __init__(
        self,
        dataset: Dataset,
        cfg: LoaderConfig,
        to_device: ToDevice,
        *,
        train: bool,
        seed: int,
        num_workers: int,
        pin_memory: bool,
        limit_batches: int = -1,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.to_device = to_device
        self.sampler = ResumableSampler(dataset, batch_size=cfg.batch_size, shuffle=train, seed=seed, rank=rank, world_size=world_size)
        self.drop_last = cfg.drop_last and train
        self.generator = torch.Generator()  # seeds the workers; reseeded every epoch
        self.seed = seed
        self.loader = DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            sampler=self.sampler,
            num_workers=num_workers,
            pin_memory=pin_memory,
            drop_last=self.drop_last,
            persistent_workers=cfg.persistent_workers and num_workers > 0,
            prefetch_factor=cfg.prefetch_factor if num_workers > 0 else None,
            generator=self.generator,
        )
        full = self.sampler.num_samples // cfg.batch_size if self.drop_last else -(-self.sampler.num_samples // cfg.batch_size)
        self.batches_per_epoch = full if limit_batches < 0 else min(full, limit_batches)
        self.batch_size = cfg.batch_size
        self.num_workers = num_workers

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch(self, epoch: int, start: int = 0) -> Iterator[HostBatch]:
        self.sampler.set_epoch(epoch)
        self.sampler.start = start
        self.generator.manual_seed(self.seed * 1_000_003 + epoch)
        return itertools.islice(self.loader, max(0, self.batches_per_epoch - start))
