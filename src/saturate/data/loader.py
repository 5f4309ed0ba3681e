"""Batches for the loop: host batches from a DataLoader, moved to the device by `to_device`.

The engine only sees two calls: `epoch(e, start)` gives the host batches of epoch `e` from
batch `start` on (so a run resumes mid-epoch in the same order), and `to_device(batch)`
copies one batch to the device and prepares it there. Where augmentation runs is decided
when the loader is built, never in the loop.

The loaders are built here, their parts elsewhere: samplers (the order), to_device (host
batch -> device batch), streaming (DataLoader and its workers), resident (tensors held, index
slices). Their names stay importable from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from saturate.config.schema import AugmentationConfig, LoaderConfig, TrainerConfig
from saturate.data.augment import Preview, SampleAugment, Schedule
from saturate.data.in_memory import materialize
from saturate.data.mix import MixedPipeline
from saturate.data.resident import (
    IN_MEMORY_S,
    RESIDENT_NOTE,
    ResidentLoader,
    memory_budget,
    read_in_place,
    resident_bytes,
    resident_for,
    room_for_resident,
)
from saturate.data.samplers import ONE_PROCESS, EvalShard, ResumableSampler, Shard, batches_per_epoch, epoch_sampler
from saturate.data.samples import length
from saturate.data.spec import DataSpec
from saturate.data.streaming import StreamLoader, already_collated, loader_failure
from saturate.data.to_device import DevicePipeline, PlainPipeline, build_pipeline, device_augment
from saturate.errors import UserError

__all__ = [
    "DevicePipeline",
    "EvalShard",
    "Loaders",
    "PlainPipeline",
    "ResidentLoader",
    "ResumableSampler",
    "Shard",
    "StreamLoader",
    "already_collated",
    "auto_workers",
    "auto_workers_for",
    "batches_per_epoch",
    "build_loaders",
    "build_pipeline",
    "cpus_per_process",
    "device_augment",
    "epoch_sampler",
    "loader_failure",
    "memory_budget",
    "read_in_place",
    "resident_bytes",
    "resident_for",
    "room_for_resident",
]

log = logging.getLogger(__name__)


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
    train_est: StreamLoader | ResidentLoader | None = None  # trainer.train_est_batches: drawn training batches
    workers_note: str = ""  # why num_workers=auto chose what it chose
    resident: bool = False  # the data held as tensors, batches index slices (loader.resident, decided)

    def close(self) -> None:
        """Every split's worker processes ended (at the end of a run, whatever ended it). A
        worker's death that torch's SIGCHLD handler raises meanwhile changes nothing then (its
        shutdown still ends the others)."""
        for batches in (self.train, self.val, self.test, self.train_est):
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
    shard: Shard = ONE_PROCESS,
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
        assert schedule is not None  # drawn above for every placement but none
        mask = spec.target_entry if spec.mask_target else None
        train_set = SampleAugment(train_set, schedule, seed=shard.seed, entry=spec.image_entry, mask_entry=mask)
    cfg, note = _decided(cfg, aug, data, spec, device)  # the loaders are built so
    _check_loadable(cfg, spec, len(train_set), shard.world_size)
    evaluating = dataclasses.replace(cfg, batch_size=cfg.eval_batch_size or cfg.batch_size)
    _check_evaluable(evaluating, data, trainer, shard.world_size)

    pipeline = functools.partial(build_pipeline, cfg, spec, device, trainer)
    preview = (
        Preview(show_images, schedule, aug.preview_images)
        if aug.preview_images and spec.image and show_images
        else None
    )
    # ranks differ
    train_pipeline: DevicePipeline | PlainPipeline | MixedPipeline = pipeline(
        augment=device_augment(aug, shard.seed + 1_000_003 * shard.rank, transforms), preview=preview
    )
    if mix is not None:  # after the augmentation and normalisation, on the device
        keys = (spec.image_entry, 1) if spec.structure == "pair" else (spec.input_key, spec.target_key)
        train_pipeline = MixedPipeline(train_pipeline, mix, input_key=keys[0], target_key=keys[1])
    make: Callable[..., StreamLoader | ResidentLoader]
    if cfg.resident:
        make = lambda dataset, pipe, node, **kw: ResidentLoader(materialize(dataset), node, pipe, shard=shard, **kw)
    else:
        make = lambda dataset, pipe, node, **kw: StreamLoader(
            dataset, node, pipe, shard=shard, collate=data.collate, **kw
        )
    train = make(train_set, train_pipeline, cfg, train=True, limit_batches=trainer.limit_train_batches)
    val, test, estimate = _evaluation_loaders(make, pipeline, evaluating, data, trainer, shard.world_size)
    log.info(
        "loader: batch %d, %s; augmentation: %s %s",
        cfg.batch_size,
        _kind(train, cfg, note),
        aug.placement,
        _stages(schedule),
    )
    return Loaders(train, val, test, estimate, note, resident=cfg.resident)


def _evaluation_loaders(make, pipeline, cfg: LoaderConfig, data, trainer: TrainerConfig, ranks: int) -> tuple:
    """The validation, test and training-estimate batches (None where not asked for or not in the data), with
    loader.eval_batch_size: validation's first trainer.limit_val_batches, or as many drawn at random at each
    evaluation; the test set whole; trainer.train_est_batches drawn from the training samples as they are (no
    augmentation). Drawn batches: that many for every rank."""
    drawn = trainer.limit_val_batches * cfg.batch_size * ranks if trainer.limit_val_random else 0
    evaluation = dict(train=False, limit_batches=trainer.limit_val_batches)
    val = None if data.val is None else make(data.val, pipeline(), cfg, drawn=drawn, **evaluation)
    test = None if data.test is None else make(data.test, pipeline(), cfg, train=False)
    estimate = None
    if trainer.train_est_batches:
        count = trainer.train_est_batches * cfg.batch_size * ranks
        estimate = make(data.train, pipeline(), cfg, train=False, drawn=count)
    return val, test, estimate


def _decided(
    cfg: LoaderConfig, aug: AugmentationConfig, data, spec: DataSpec, device: torch.device
) -> tuple[LoaderConfig, str]:
    """The loader's node with num_workers, pin_memory and resident decided (no "auto"), and
    why num_workers=auto or resident=auto chose what they chose."""
    note = ""
    if cfg.num_workers == "auto":
        workers, note = auto_workers_for(spec, per_sample_augment=aug.placement == "cpu")
    else:
        workers = cfg.num_workers
    pin = device.type == "cuda" if cfg.pin_memory == "auto" else cfg.pin_memory
    resident = resident_for(cfg, data, spec, device, workers, aug.placement)
    note = RESIDENT_NOTE if resident and cfg.resident == "auto" else note
    return dataclasses.replace(cfg, num_workers=workers, pin_memory=pin, resident=resident), note


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


def _check_evaluable(cfg: LoaderConfig, data, trainer: TrainerConfig, world_size: int) -> None:
    """Under loader.order=sequential every split is a stream with a sample for each stream; a
    random evaluation subset fits in its split."""
    splits = {"train": data.train, "val": data.val, "test": data.test}
    if cfg.order == "sequential":
        for split, dataset in splits.items():
            if dataset is not None and not getattr(dataset, "stream", False):
                raise UserError(
                    f"loader.order=sequential: the {split} set ({type(dataset).__name__}) is not a stream; this order "
                    "reads consecutive windows of one sequence in parallel streams, for a data set that says its "
                    "sample i + 1 follows sample i (`stream = True`); use loader.order=seeded"
                )
        for split in ("val", "test"):
            dataset = splits[split]
            if dataset is not None and length(dataset) < cfg.batch_size * world_size:
                raise UserError(
                    f"loader.eval_batch_size={cfg.batch_size}: more streams than the {split} set's {len(dataset)} "
                    f"samples{f' across {world_size} ranks' if world_size > 1 else ''}; lower loader.eval_batch_size"
                )
    for split, key, batches in (
        ("val", "trainer.limit_val_batches", trainer.limit_val_batches if trainer.limit_val_random else 0),
        ("train", "trainer.train_est_batches", trainer.train_est_batches),
    ):
        dataset = splits[split]
        need = batches * cfg.batch_size * world_size
        if batches and dataset is not None and need > length(dataset):
            each = f" on each of {world_size} ranks" if world_size > 1 else ""
            raise UserError(
                f"{key}={batches}: {batches} batches of {cfg.batch_size}{each} "
                f"drawn at random need {need} samples, the {split} set has {length(dataset)}; at most "
                f"{length(dataset) // (cfg.batch_size * world_size)}"
            )


def _kind(train: StreamLoader | ResidentLoader, cfg: LoaderConfig, note: str) -> str:
    """How the batches are made, in words, for the log."""
    if isinstance(train, ResidentLoader):
        kind = f"resident on {train.home}"
    else:
        kind = f"{cfg.num_workers} workers, pin_memory={cfg.pin_memory}"
    return f"{kind} ({note})" if note else kind


def _stages(schedule) -> str:
    """The augmentation's stages in words, for the log."""
    if isinstance(schedule, Schedule):
        return " -> ".join(f"{p.name} from epoch {e}" for e, p in schedule.stages)
    return "your transforms" if schedule is not None else ""
