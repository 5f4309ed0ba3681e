"""`train(cfg)`: build the parts of a run in order, hand them to the engine, write the results.

Each `_setup_*` step receives only its own config node and the objects it depends on.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import default_collate
from tqdm.contrib.logging import logging_redirect_tqdm

from saturate.augment import BatchAugment, Preview, SampleAugment, Schedule
from saturate.batch_size import Cache, Trial, measure_with, restoring, search, table
from saturate.checkpoint import Checkpointer
from saturate.config import AugmentationConfig, LoaderConfig, RunConfig, TrainerConfig, validate
from saturate.data import DataInfo, ImageTensors, build_datasets
from saturate.device import setup_device
from saturate.distributed import Dist, wrap
from saturate.engine import Engine
from saturate.environment import cpu_name, fingerprint
from saturate.errors import UserError
from saturate.evaluate import Evaluator
from saturate.faults import NonFiniteGuard, Preempted, StopSignal, TrainingDiverged
from saturate.loader import DevicePipeline, ResidentLoader, StreamLoader, auto_workers, cpus_per_process, loader_failure
from saturate.monitor import ResourceMonitor, device_memory_mb, peak_memory
from saturate.optim import setup_optimizer
from saturate.precision import Precision, emulated, setup_precision
from saturate.profiling import NoProfiler, StepProfiler
from saturate.report import RunFacts, Verdict, diagnose, render
from saturate.step import TrainStep
from saturate.timing import StepTimer
from saturate.tracking import Tracker, write_json

log = logging.getLogger("saturate")


class Metrics(dict):
    """The final metrics. `float()` of it is the run's figure of merit (`checkpoint.monitor`),
    which is what sweepers that optimise one number (Optuna) read from train.py's return."""

    objective: str = "val/acc"

    def __float__(self) -> float:
        return float(self[self.objective])


def train(cfg: DictConfig) -> Metrics:
    """Train with the composed config `cfg`; return the final metrics (also in metrics.json).
    A run that fails still leaves a metrics.json saying so and why (for sweep reports)."""
    try:
        return _train(cfg)
    except (Preempted, TrainingDiverged):
        raise  # they record their own status
    except Exception as e:
        _record_failure(cfg, e)
        raise


def _record_failure(cfg: DictConfig, error: Exception) -> None:
    try:
        run_dir = Path(cfg.run_dir)
    except Exception:  # no run dir to write to (an unresolvable config)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    write_json(run_dir / "metrics.json", {"status": "failed", "error": f"{type(error).__name__}: {first}"})


def _train(cfg: DictConfig) -> Metrics:
    start_time = time.perf_counter()
    run = validate(cfg)
    d = Dist()
    log.setLevel(run.trainer.log_level if d.is_main else "WARNING")  # one voice: rank 0's
    run_dir = Path(run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    tracker = Tracker(run_dir, log_interval=run.trainer.log_interval, progress=run.trainer.progress, enabled=d.is_main)
    device = setup_device(run.device, local_rank=d.local_rank)
    with _seeded(run.trainer), StopSignal() as stop:
        parts = _setup_training(run, d, device, tracker)
        resolved = OmegaConf.to_container(cfg, resolve=True)
        env = fingerprint(device, precision=parts.precision.name, compile=run.trainer.compile,
                          channels_last=run.trainer.channels_last, world_size=d.world_size)  # fmt: skip
        checkpointer = Checkpointer(
            run_dir / "checkpoints",
            run.checkpoint,
            interval=run.trainer.checkpoint_interval,
            parts={"model": parts.models.raw, "optimizer": parts.optimizer, "scheduler": parts.scheduler, "scaler": parts.precision.scaler},
            config=resolved,
            fingerprint=env,
            enabled=d.is_main,
        )
        state = checkpointer.resume(run.trainer.resume)
        engine = _setup_engine(run, parts, checkpointer, tracker, stop, d, device, start_time)
        _start_tracking(run, parts, tracker, state.step, resolved, env, d)

        outcome = {"data": parts.info.name, "synthetic": parts.info.synthetic, "precision": parts.precision.name, "fingerprint": env}
        failure = None
        try:
            with logging_redirect_tqdm(), torch.autograd.set_detect_anomaly(run.trainer.detect_anomaly), engine.monitor:
                last = engine.fit(state)
            gpu = engine.monitor.gpu_summary()
            steady = d.mean(engine.timer.run_window().metrics(), sum_keys=("perf/samples_per_s",))
            metrics = {**last, **steady, **parts.info.notes, **(gpu or {}), "time/wall_s": time.perf_counter() - start_time}
            if d.world_size > 1:  # every rank must end with the same weights
                metrics["distributed/params_identical"] = float(d.params_identical(parts.models.raw))
            if d.is_main:
                verdict = _report(run, metrics, steps=engine.timer.run_window().steps, device=device, train_batches=parts.train_batches,
                                  precision=parts.precision, tracker=tracker, gpu=gpu)  # fmt: skip
                tracker.hparams(_hparams(run, parts.precision, parts.info), metrics, step=state.step)
        except (Preempted, TrainingDiverged) as stopped:
            if d.is_main:
                status = "preempted" if isinstance(stopped, Preempted) else "diverged"
                write_json(run_dir / "metrics.json", {**tracker.latest, **outcome, "status": status})
            raise
        except RuntimeError as e:  # a DataLoader worker that hung or died
            failure = loader_failure(e, run.loader.timeout_s)
            if failure is None:
                raise
        finally:
            engine.profiler.close()
            tracker.close()
        if failure is not None:  # raised out here, so the frames holding the loader's workers are freed
            raise failure

    if d.is_main:
        used = {"batch_size": run.loader.batch_size, "num_workers": parts.train_batches.num_workers, "world_size": d.world_size}
        write_json(run_dir / "metrics.json", {**metrics, **outcome, **used, "status": "completed", "verdict": verdict.kind})
    log.info("done in %.1fs: val/acc %.4f, val/loss %.4f, %.0f samples/s, data wait %.0f%%, peak memory %.0f MB -> %s",
             metrics["time/wall_s"], metrics["val/acc"], metrics["val/loss"], metrics["perf/samples_per_s"],
             100 * metrics["perf/data_wait_frac"], metrics["memory/peak_mb"], run_dir)  # fmt: skip
    result = Metrics(metrics)
    result.objective = run.checkpoint.monitor
    return result


@dataclass
class Models:
    train: nn.Module  # what the loop calls: DDP-wrapped and/or compiled
    eval: nn.Module  # what the evaluator calls: never DDP (ranks evaluate different numbers of batches)
    raw: nn.Module  # the plain module: optimizer, checkpoints


@dataclass
class Parts:
    """What a run trains: data, precision, model, batches, optimizer and schedule."""

    info: DataInfo
    precision: Precision
    models: Models
    train_batches: StreamLoader | ResidentLoader
    val_batches: StreamLoader | ResidentLoader
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    global_batch: int
    trials: list[Trial] | None  # batch-size search, when loader.batch_size=auto searched


def _setup_training(run: RunConfig, d: Dist, device: torch.device, tracker: Tracker) -> Parts:
    """datasets -> precision -> model -> (batch-size search) -> loaders -> optimizer and schedule."""
    train_set, val_set, info = build_datasets(run.data)
    precision = setup_precision(run.precision, device)
    example = run.loader.batch_size if run.loader.batch_size != "auto" else run.batch_search.min
    models = _setup_model(run.model, info, device, run.trainer, precision, d, batch_size=example)
    trials = None
    if run.loader.batch_size == "auto":
        chosen, trials = _auto_batch_size(run, models, precision, train_set, info, device, d)
        run.loader = dataclasses.replace(run.loader, batch_size=chosen)
    train_batches, val_batches = _setup_loaders(run.loader, run.augmentation, train_set, val_set, info, device, run.trainer, tracker, d)
    total_steps = len(train_batches) * run.trainer.max_epochs
    if run.trainer.max_steps > 0:
        total_steps = min(total_steps, run.trainer.max_steps)
    global_batch = run.loader.batch_size * d.world_size
    optimizer, scheduler = setup_optimizer(
        run.optim, models.raw, steps_per_epoch=len(train_batches), total_steps=total_steps, global_batch=global_batch
    )
    return Parts(info, precision, models, train_batches, val_batches, optimizer, scheduler, total_steps, global_batch, trials)


def _setup_engine(run: RunConfig, parts: Parts, checkpointer: Checkpointer, tracker: Tracker, stop: StopSignal, d: Dist,
                  device: torch.device, start_time: float) -> Engine:  # fmt: skip
    """The loop and what it drives: the step (with the non-finite guard), evaluator, timer,
    monitor and profiler."""
    guard = NonFiniteGuard(
        skip=run.trainer.skip_nonfinite,
        check_grads=not parts.precision.scaler.is_enabled(),
        max_consecutive=run.trainer.max_nonfinite_steps,
        device=device,
        agree=d.agree,
    )
    step = TrainStep(parts.models.train, parts.optimizer, parts.precision, guard, grad_clip=run.trainer.grad_clip,
                     micro_batches=run.trainer.accumulate, dist=d)  # fmt: skip
    profiler = NoProfiler()
    if run.trainer.profile:
        profiler = StepProfiler(Path(run.run_dir) / "profile", device, wait=run.trainer.profile_wait, steps=run.trainer.profile_steps)
    d.check_every = run.trainer.log_interval if d.world_size > 1 else 1  # stop flags agreed at log steps across ranks
    return Engine(
        model=parts.models.train, step=step, scheduler=parts.scheduler, train_batches=parts.train_batches,
        evaluator=Evaluator(parts.models.eval, parts.val_batches, parts.precision, interval=run.trainer.eval_interval, dist=d),
        checkpointer=checkpointer, tracker=tracker, timer=StepTimer(device), stop=stop,
        monitor=ResourceMonitor(run.monitor.interval_s, device, enabled=run.monitor.enabled), profiler=profiler,
        memory=peak_memory(device), dist=d, max_epochs=run.trainer.max_epochs, max_steps=run.trainer.max_steps, start_time=start_time,
    )  # fmt: skip


def _start_tracking(run: RunConfig, parts: Parts, tracker: Tracker, step: int, resolved: dict, env: dict, d: Dist) -> None:
    tracker.start(parts.total_steps, done=step)
    tracker.text("config", "```yaml\n" + OmegaConf.to_yaml(resolved) + "```")
    tracker.text("fingerprint", "```yaml\n" + OmegaConf.to_yaml(env) + "```")
    if parts.trials is not None:
        tracker.text("batch_search", table(parts.trials, run.loader.batch_size))
        for t in parts.trials:
            tracker.log({"batch_search/samples_per_s": t.samples_per_s or 0.0}, step=t.size)
    ranks = f", {d.world_size} ranks: global batch {parts.global_batch}" if d.world_size > 1 else ""
    data = parts.info.name + (" (SYNTHETIC)" if parts.info.synthetic else "")
    log.info("training %s on %s: %d steps (%d per epoch), batch %d per device%s", type(parts.models.raw).__name__, data,
             parts.total_steps, len(parts.train_batches), run.loader.batch_size, ranks)  # fmt: skip


def _report(run: RunConfig, metrics: dict, *, steps: int, device, train_batches, precision: Precision, tracker: Tracker, gpu) -> Verdict:
    """The bottleneck report: to the console, report.md and TensorBoard."""
    facts = RunFacts(
        device=device.type,
        batch_size=run.loader.batch_size,
        num_workers=train_batches.num_workers,
        cpus=cpus_per_process(),
        resident=run.loader.resident,
        in_memory=isinstance(getattr(train_batches.dataset, "base", train_batches.dataset), ImageTensors),  # base: under SampleAugment
        placement=run.augmentation.placement,
        persistent_workers=run.loader.persistent_workers,
        pin_memory=run.loader.pin_memory is True or (run.loader.pin_memory == "auto" and device.type == "cuda"),
        precision=precision.name,
        compile=run.trainer.compile,
        channels_last=run.trainer.channels_last,
        memory_headroom=metrics["memory/peak_mb"] < 0.5 * device_memory_mb(device),
        emulated_precision=emulated(precision.name, device),
    )
    verdict = diagnose(metrics, facts)
    text = render(metrics, verdict, steps=steps, gpu=gpu)
    (Path(run.run_dir) / "report.md").write_text(text)
    tracker.text("report", text)
    log.info("\n%s", text)
    return verdict


@contextlib.contextmanager
def _seeded(cfg: TrainerConfig):
    """Seed every generator; with `deterministic`, deterministic kernels for the run (the
    process-wide switches are put back afterwards, for callers that train twice)."""
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


def _setup_loaders(
    cfg: LoaderConfig,
    aug: AugmentationConfig,
    train_set,
    val_set,
    info: DataInfo,
    device: torch.device,
    trainer: TrainerConfig,
    tracker: Tracker,
    d: Dist,
):
    """Training and validation batches. Augmentation is placed here, once: per sample in the
    training dataset (cpu), or on the device in the training pipeline (gpu)."""
    if cfg.batch_size * d.world_size > len(train_set):
        ranks = f" across {d.world_size} ranks" if d.world_size > 1 else ""
        raise UserError(f"loader.batch_size={cfg.batch_size}: larger than the training set ({len(train_set)} samples{ranks})")
    schedule = Schedule.from_config(aug) if aug.placement != "none" else None
    if aug.placement == "cpu":
        train_set = SampleAugment(train_set, schedule, seed=trainer.seed)
    workers = auto_workers(per_sample_work=aug.placement == "cpu") if cfg.num_workers == "auto" else cfg.num_workers
    pin = device.type == "cuda" if cfg.pin_memory == "auto" else cfg.pin_memory

    pipeline = functools.partial(_pipeline, cfg, info, device, trainer)
    train_pipeline = pipeline(
        augment=_device_augment(aug, trainer.seed + 1_000_003 * d.rank),  # ranks draw differently
        preview=Preview(tracker.images, schedule, aug.preview_images) if aug.preview_images else None,
    )
    if cfg.resident:
        train_set, val_set = (d.materialize() if hasattr(d, "materialize") else d for d in (train_set, val_set))
        ranks = dict(seed=trainer.seed, rank=d.rank, world_size=d.world_size)
        train = ResidentLoader(train_set, cfg, train_pipeline, train=True, limit_batches=trainer.limit_train_batches, **ranks)
        val = ResidentLoader(val_set, cfg, pipeline(), train=False, limit_batches=trainer.limit_val_batches, **ranks)
    else:
        common = dict(seed=trainer.seed, num_workers=workers, pin_memory=pin, rank=d.rank, world_size=d.world_size)
        train = StreamLoader(train_set, cfg, train_pipeline, train=True, limit_batches=trainer.limit_train_batches, **common)
        val = StreamLoader(val_set, cfg, pipeline(), train=False, limit_batches=trainer.limit_val_batches, **common)
    stages = " -> ".join(f"{p.name} from epoch {e}" for e, p in schedule.stages) if schedule else ""
    kind = f"resident on {train.home}" if cfg.resident else f"{workers} workers, pin_memory={pin}"
    log.info("loader: batch %d, %s; augmentation: %s %s", cfg.batch_size, kind, aug.placement, stages)
    return train, val


def _pipeline(cfg: LoaderConfig, info: DataInfo, device: torch.device, trainer: TrainerConfig, **kwargs) -> DevicePipeline:
    return DevicePipeline(device, info.mean, info.std, non_blocking=cfg.non_blocking, channels_last=trainer.channels_last, **kwargs)


def _device_augment(aug: AugmentationConfig, seed: int) -> BatchAugment | None:
    return BatchAugment(Schedule.from_config(aug), seed=seed) if aug.placement == "gpu" else None


def _auto_batch_size(run: RunConfig, models: Models, precision: Precision, train_set, info: DataInfo, device: torch.device, d: Dist):
    """loader.batch_size=auto: the cached choice for this key, or a search (saturate.batch_size).
    Under DDP each rank searches on its own device with the plain model (no collectives in
    the trials) and the smallest choice wins, so it fits everywhere."""
    cfg = run.batch_search
    key = {
        "model": run.model,
        "input": [info.channels, info.height, info.width],
        "precision": precision.name,
        "compile": run.trainer.compile,
        "channels_last": run.trainer.channels_last,
        "augmentation": run.augmentation.placement,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu: {cpu_name()}",
        "world_size": d.world_size,
    }
    high = min(cfg.max, len(train_set) // d.world_size)
    cache = Cache(cfg.cache)
    hit = cache.get(key)
    if hit is not None and cfg.min <= hit["batch_size"] <= high:
        log.info("loader.batch_size=auto: %d, reused from %s (same model, input, precision, compile, device)", hit["batch_size"], cfg.cache)
        return hit["batch_size"], [Trial(**t) for t in hit["trials"]]

    start = time.perf_counter()
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(run.trainer.seed))

    def fetch(size: int):  # a host batch of `size` real training samples
        index = order[:size].tolist()
        return train_set.__getitems__(index) if hasattr(train_set, "__getitems__") else default_collate([train_set[i] for i in index])

    optimizer = instantiate(run.optim.optimizer)(models.raw.parameters())  # the run's kind, thrown away afterwards
    pipeline = _pipeline(run.loader, info, device, run.trainer, augment=_device_augment(run.augmentation, run.trainer.seed))
    model = models.train if d.world_size == 1 else models.eval
    measure = measure_with(model, optimizer, precision, pipeline, fetch, steps=cfg.steps, device=device)
    chosen, trials = restoring(models.raw, lambda: search(measure, low=cfg.min, high=high, min_gain=cfg.min_gain, safety=cfg.safety))
    chosen = d.minimum(chosen)
    if d.is_main:
        cache.put(key, chosen, trials)
    log.info("loader.batch_size=auto: %d after %d trials in %.1fs%s\n%s", chosen, len(trials), time.perf_counter() - start,
             f" (cached in {cfg.cache})" if cfg.cache else "", table(trials, chosen))  # fmt: skip
    return chosen, trials


def _setup_model(node: dict, info: DataInfo, device: torch.device, trainer: TrainerConfig, precision: Precision, d: Dist,
                 batch_size: int) -> Models:  # fmt: skip
    try:
        raw = instantiate(node, in_channels=info.channels, num_classes=info.num_classes)
    except Exception as e:  # a bad value in the model node, e.g. model.norm=foo
        cause = e.__cause__ or e
        raise UserError(f"model: cannot build {node['_target_']}: {cause}") from None
    memory_format = torch.channels_last if trainer.channels_last else torch.preserve_format
    raw = raw.to(device=device, memory_format=memory_format)
    n_params = sum(p.numel() for p in raw.parameters())
    log.info("model: %s, %.2fM parameters%s", type(raw).__name__, n_params / 1e6, ", channels_last" if trainer.channels_last else "")
    if trainer.sync_batchnorm:
        if d.world_size == 1:
            log.warning("trainer.sync_batchnorm=true in a single process: nothing to synchronise, ignored")
        elif device.type != "cuda":
            raise UserError("trainer.sync_batchnorm=true: SyncBatchNorm works only on CUDA devices; leave it false on the CPU")
        else:
            raw = nn.SyncBatchNorm.convert_sync_batchnorm(raw)
    wrapped = wrap(raw, d, device)
    if not trainer.compile:
        return Models(wrapped, raw, raw)
    example = torch.randn(batch_size, info.channels, info.height, info.width, device=device).contiguous(memory_format=memory_format)
    compiled = _compile(wrapped, raw, example, precision)
    return Models(compiled, compiled if d.world_size == 1 else raw, raw)


def _compile(model: nn.Module, raw: nn.Module, example: torch.Tensor, precision: Precision) -> nn.Module:
    """torch.compile, warmed up on one forward/backward so that a failure shows now (and the
    run goes on in eager mode with one warning) and the compile time is reported apart."""
    saved = copy.deepcopy(raw.state_dict())  # the warm-up must not move BatchNorm statistics
    compiled = torch.compile(model)
    start = time.perf_counter()
    try:
        with precision.autocast():
            out = compiled(example)
        out.float().sum().backward()
        log.info("torch.compile: compiled in %.1fs", time.perf_counter() - start)
    except Exception as e:
        log.warning("torch.compile failed (%s: %s); training in eager mode", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        compiled = model
    finally:
        raw.zero_grad(set_to_none=True)
        raw.load_state_dict(saved)
    return compiled


def _swept(run: RunConfig) -> dict:
    """The command line's overrides (a multirun's swept values among them) as {key: value},
    values as the config resolved them; group choices (`precision=amp`) as the option."""
    if not HydraConfig.initialized():
        return {}
    resolved = OmegaConf.structured(run)
    columns = {}
    for override in HydraConfig.get().overrides.task:
        key, _, text = override.lstrip("+~").partition("=")
        if key.startswith("hydra") or key in ("run_dir", "sweep"):
            continue
        value = OmegaConf.select(resolved, key, default=text)
        columns[key] = text if isinstance(value, (dict, list, DictConfig)) or OmegaConf.is_config(value) else value
    return columns


def _hparams(run: RunConfig, precision: Precision, info: DataInfo) -> dict:
    """The columns of this run in TensorBoard's HParams tab: the overrides it was given
    (every job of a sweep has the same keys), then its main settings."""
    return {
        **_swept(run),
        "model": run.model["_target_"].rsplit(".", 1)[-1],
        "data": info.name,
        "precision": precision.name,
        "loader.batch_size": run.loader.batch_size,
        "loader.num_workers": run.loader.num_workers,
        "augmentation": run.augmentation.placement,
        "augmentation.preset": "+".join(s.preset for s in run.augmentation.schedule) or run.augmentation.preset,
        "optim": run.optim.optimizer["_target_"].rsplit(".", 1)[-1],
        "optim.lr": run.optim.optimizer.get("lr", float("nan")),
        "trainer.compile": run.trainer.compile,
        "trainer.channels_last": run.trainer.channels_last,
    }
