"""`train(cfg)` and `fit(model, data, ...)`: build the parts of a run in order, hand them to
the engine, write the results.

Each `_setup_*` step receives only its own config node and the objects it depends on.
`fit` passes objects (a model, datasets, a loss) where `train` builds them from nodes; the
rest is the same run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import os
import random
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import Dataset
from tqdm.contrib.logging import logging_redirect_tqdm

from saturate.augment import PRESETS
from saturate.batch_size import Cache, Trial, measure_with, restoring, search, table, valid_choice
from saturate.callbacks import Callbacks
from saturate.checkpoint import Checkpointer
from saturate.config import DATA_ARGUMENTS, RunConfig, TrainerConfig, validate
from saturate.data import DataSpec, build_datasets, describe
from saturate.data.base import as_tensor, stack
from saturate.device import setup_device
from saturate.distributed import Dist, alone, peer_failed, world_size, wrap
from saturate.engine import Engine, Measured, TrainState
from saturate.environment import cpu_name, fingerprint
from saturate.errors import ConfigError, Problem, UserError
from saturate.evaluate import Evaluator
from saturate.faults import NonFiniteGuard, Preempted, StopSignal, TrainingDiverged
from saturate.launch import LAUNCHED, command_line
from saturate.loader import (
    ResidentLoader,
    StreamLoader,
    build_loaders,
    build_pipeline,
    cpus_per_process,
    device_augment,
    loader_failure,
    room_for_resident,
)
from saturate.monitor import ResourceMonitor, device_memory_mb, peak_memory
from saturate.naming import override_value, run_name, varied_keys
from saturate.optim import prime_state, setup_optimizer
from saturate.precision import Precision, emulated, setup_precision
from saturate.profiling import NoProfiler, StepProfiler
from saturate.registration import UNSET_RUN_DIR, register
from saturate.report import RunFacts, Verdict, diagnose, render
from saturate.rundir import RunDirTaken, hold, record_failure, write_json
from saturate.step import TrainStep
from saturate.task import Task, build_task
from saturate.timing import StepTimer
from saturate.tracking import Tracker

log = logging.getLogger("saturate")


class Metrics(dict):
    """The final metrics. `float()` of it is the run's figure of merit (`checkpoint.monitor`:
    val/acc for classification, val/loss for regression, unless set), which is what
    sweepers that optimise one number (Optuna) read from train.py's return."""

    objective: str = "val/acc"

    def __float__(self) -> float:
        return float(self[self.objective])


@dataclass
class Given:
    """Objects `fit` passes in, where `train` builds them from the config's nodes."""

    model: nn.Module | None = None
    datasets: tuple[Dataset, Dataset | None] | None = None
    loss: Callable | None = None
    callbacks: Sequence[Any] = ()
    loggers: Sequence[Any] = ()
    overrides: Sequence[str] = ()  # as fit was given them, for the record
    measured: Measured | None = None  # saturate.tune's trials: stop once the steady state is measured

    def nodes(self) -> tuple[str, ...]:
        """The config nodes these objects stand in for (not validated, not built)."""
        return tuple(name for name, obj in (("model", self.model), ("data", self.datasets)) if obj is not None)


def train(cfg: DictConfig, given: Given | None = None) -> Metrics:
    """Train with the composed config `cfg`; return the final metrics (also in metrics.json).
    A run that fails still leaves a metrics.json saying so and why (for sweep reports)."""
    try:
        return _train(cfg, given or Given())
    except (Preempted, TrainingDiverged, RunDirTaken):
        raise  # they record their own status, or the run dir is another run's
    except Exception as e:
        broke = peer_failed(e) if world_size() > 1 else None
        if broke:  # not this rank's error: one line, not gloo's traceback
            e = UserError(f"rank {os.environ.get('RANK', '?')}: stopped because another rank failed (a collective broke off: {broke}); "
                          "that rank's own message and log say why")  # fmt: skip
            record_failure(cfg.run_dir, e)
            raise e from None
        if not getattr(e, "recorded", False):
            record_failure(cfg.run_dir, e)
        raise


def config_dir() -> Path:
    """saturate's conf/ (beside src/ in the checkout saturate is installed from)."""
    found = Path(__file__).resolve().parents[2] / "conf"
    if not (found / "config.yaml").is_file():
        raise UserError(f"saturate.fit: no conf/config.yaml at {found}; install saturate from its checkout (pip install -e .)")
    return found


def fit(model: nn.Module, train_data: Dataset, val_data: Dataset | None = None, *, task: str = "classification",
        loss: Callable | None = None, overrides: Sequence[str] = (), run_dir: str | Path | None = None,
        callbacks: Sequence[Any] = (), loggers: Sequence[Any] = ()) -> Metrics:  # fmt: skip
    """Train `model` on `train_data` (validated on `val_data`, if given) with saturate's engine
    and config groups: `overrides` as on the command line (`["precision=amp", "loader.batch_size=64",
    "trainer.max_epochs=5"]`). Datasets are map-style, samples `(input, target)`; `task` is
    "classification" or "regression"; `loss(outputs, targets)` replaces the task's own.
    `callbacks` and `loggers` are objects as in saturate.callbacks. Writes the same run dir as
    train.py (default: outputs/runs/<date>/<time>) and returns the final metrics."""
    register()
    overrides, loss = _fit_arguments(overrides, loss, task)
    if run_dir is not None:
        overrides.append(f"run_dir={Path(run_dir).absolute()}")
    elif not any(o.startswith("run_dir=") for o in overrides):  # as train.py names its runs
        named = next((o.partition("=")[2] for o in overrides if o.startswith("name=")), None)
        stamp = datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f") + run_name(named, overrides)
        overrides.append(f"run_dir={Path('outputs/runs').absolute() / stamp}")
    with outside_hydra_app():
        cfg = _compose([f"task={task}", *overrides])
        devices = cfg.trainer.devices
        if devices not in ("auto", 1) and int(os.environ.get("WORLD_SIZE", "1")) != devices:
            raise UserError(f"trainer.devices={devices}: saturate.fit trains in the process that calls it; for {devices} processes "
                            f"start your script with torchrun --nproc_per_node={devices} (fit then joins their process group)")  # fmt: skip
        given = Given(model=model, datasets=(train_data, val_data), loss=loss, callbacks=callbacks, loggers=loggers, overrides=overrides)
        return train(cfg, given)


def _fit_arguments(overrides, loss, task: str) -> tuple[list[str], Callable | None]:
    """fit's overrides as a list (a string is a mistake, not a list of characters) and its
    loss as a callable (a regression loss's name becomes task.loss)."""
    if isinstance(overrides, (str, bytes)) or not all(isinstance(o, str) for o in overrides):
        given = repr(overrides) if len(repr(overrides)) < 80 else repr(overrides)[:77] + "..."
        raise UserError(f"saturate.fit: overrides={given}: expected a list of 'key=value' strings, e.g. "
                        "overrides=['precision=amp', 'trainer.max_epochs=5']")  # fmt: skip
    overrides = list(overrides)
    if isinstance(loss, str):
        if task != "regression":
            raise UserError(f"saturate.fit: loss={loss!r}: task={task} takes a callable loss(outputs, targets), or None for its own; "
                            "named losses (mse, l1, huber) are regression's")  # fmt: skip
        return [f"task.loss={loss}", *overrides], None
    return overrides, loss


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        return compose("config", overrides=overrides)


@contextlib.contextmanager
def outside_hydra_app():
    """For the block, no Hydra app is running: `saturate.fit` called from inside a user's
    `@hydra.main` function composes saturate's own config and names, logs and records its run
    as its own (not with the outer app's overrides); the outer app's Hydra is put back after."""
    from hydra.core.global_hydra import GlobalHydra

    outer_hydra = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    outer_cfg = HydraConfig.instance().cfg
    GlobalHydra.instance().clear()
    HydraConfig.instance().cfg = None
    try:
        yield
    finally:
        GlobalHydra.instance().clear()
        if outer_hydra is not None:
            GlobalHydra.instance().initialize(outer_hydra)
        HydraConfig.instance().cfg = outer_cfg


def _overrides(given: Given) -> list[str]:
    """The command line's overrides (train.py), or the ones fit was given."""
    if HydraConfig.initialized():
        return list(HydraConfig.get().overrides.task)
    return list(given.overrides)


def _writable(folder: Path, key: str) -> None:
    """`folder` exists (made if need be) and takes a file, or a UserError naming `key`."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".saturate-write-test-{os.getpid()}"
        probe.write_bytes(b"saturate")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{key}: cannot write to {folder} ({e.strerror or e}); point it at a writable folder") from None


def _build(node: Any, what: str) -> Any:
    """instantiate() a user's `_target_` node; their mistake (a UserError) keeps its message."""
    try:
        return instantiate(node)
    except InstantiationException as e:
        cause = e.__cause__ or e
        if isinstance(cause, UserError):
            raise cause.with_traceback(None) from None
        raise UserError(f"{what}: cannot build {node['_target_']}: {cause}") from None


def _described(node: Any, obj: Any) -> Any:
    """What the saved config says of a node: the node itself, or the object passed in."""
    return node if obj is None else {"object": f"{type(obj).__module__}.{type(obj).__qualname__}"}


def _train(cfg: DictConfig, given: Given) -> Metrics:
    start_time, started_at = time.perf_counter(), datetime.now().astimezone().isoformat(timespec="seconds")
    run = validate(cfg, presets=tuple(PRESETS), given=given.nodes())
    if run.tune.enabled:  # train.py hands tune=true to saturate.tune before any training
        raise UserError("tune.enabled=true: tune through train.py (python train.py tune=true ...); saturate.fit and train() train")
    d = Dist()
    log.setLevel(run.trainer.log_level if d.is_main else "WARNING")  # one voice: rank 0's
    if run.run_dir == UNSET_RUN_DIR:
        raise UserError("run_dir: not set; outside train.py (Hydra's compose API) give run_dir=<folder>, or use saturate.fit")
    run_dir = Path(run.run_dir)
    _writable(run_dir, "run_dir")  # before any work: a read-only or full disk is found now, not at the first save
    if run.loader.batch_size == "auto" and run.batch_search.cache:
        _writable(Path(run.batch_search.cache).parent, "batch_search.cache")

    loggers = [_build(x, "logger") if isinstance(x, dict) else x for x in run.logger] + list(given.loggers)
    tracker = Tracker(run_dir, log_interval=run.trainer.log_interval, progress=run.trainer.progress, enabled=d.is_main, loggers=loggers)
    callbacks = Callbacks([_build(c, "callbacks") for c in run.callbacks] + list(given.callbacks), enabled=d.is_main)
    device = setup_device(run.device, local_rank=d.local_rank)
    held = hold(run_dir, resume=run.trainer.resume, restart=run.trainer.restart, enabled=d.is_main, agree=d.agree)
    with held, seeded(run.trainer, device), StopSignal() as stop:
        stop.listeners.append(callbacks.stop_requested)
        parts = _setup_training(run, d, device, tracker, given)
        watched = run.checkpoint.resolved(parts.task.kind, parts.spec.has_val)
        tracker.shown = watched.monitor if watched.monitor.startswith("val/") and watched.monitor != "val/loss" else parts.task.names[0]
        resolved = OmegaConf.to_container(cfg, resolve=True)
        resolved["model"], resolved["data"] = _described(resolved["model"], given.model), _described(resolved["data"], given.datasets)
        env = fingerprint(device, precision=parts.precision.name, compile=run.trainer.compile,
                          channels_last=run.trainer.channels_last, world_size=d.world_size)  # fmt: skip
        checkpointer = Checkpointer(
            run_dir / "checkpoints",
            watched,
            interval=run.trainer.checkpoint_interval,
            parts={"model": parts.models.raw, "optimizer": parts.optimizer, "scheduler": parts.scheduler, "scaler": parts.precision.scaler},
            config=resolved,
            fingerprint=env,
            enabled=d.is_main,
        )
        state = TrainState(**checkpointer.resume(run.trainer.resume))
        engine = _setup_engine(run, parts, checkpointer, tracker, callbacks, stop, d, device, start_time, given.measured)
        if engine.finished(state):  # a finished run resumed: nothing to train
            return _already_done(run, state, checkpointer, tracker, watched.monitor)
        _start_tracking(run, parts, tracker, state.step, resolved, env, d)
        callbacks.on_run_start({"run_dir": str(run_dir), "total_steps": parts.total_steps, "start_step": state.step,
                                "data": parts.spec.name, "model": type(parts.models.raw).__name__, "task": parts.task.kind})  # fmt: skip

        outcome = {"data": parts.spec.name, "synthetic": parts.spec.synthetic, "precision": parts.precision.name, "task": parts.task.kind,
                   "monitor": watched.monitor, "started_at": started_at, "overrides": _overrides(given), "fingerprint": env}  # fmt: skip
        if parts.trials is not None:  # loader.batch_size=auto: what was tried, and how long it took
            outcome["batch_search"] = {"seconds": parts.search_s, "trials": [dataclasses.asdict(t) for t in parts.trials]}
        failure = None
        try:
            with logging_redirect_tqdm(), torch.autograd.set_detect_anomaly(run.trainer.detect_anomaly), engine.monitor:
                last = engine.fit(state)
            for batches in (parts.train_batches, parts.val_batches):  # what every rank skipped, now that all are done
                if getattr(batches, "poll", None) is not None:
                    batches.poll()
            gpu, cpu_util = engine.monitor.gpu_summary(), engine.monitor.cpu_mean()
            steady = d.mean(engine.timer.run_window().metrics(), sum_keys=("perf/samples_per_s",))
            cpu = {"cpu/util_mean": cpu_util} if cpu_util is not None else {}
            metrics = {**last, **steady, **parts.spec.notes, **(gpu or {}), **cpu, "time/wall_s": time.perf_counter() - start_time}
            if d.world_size > 1:  # every rank must end with the same weights
                metrics["distributed/params_identical"] = float(d.params_identical(parts.models.raw))
            if d.is_main:
                steps = engine.timer.run_window().steps
                verdict, facts = _report(run, metrics, steps=steps, device=device, parts=parts, tracker=tracker, gpu=gpu, cpu_util=cpu_util)
                first = [watched.monitor, *parts.task.names, "val/loss", "train/loss", "perf/samples_per_s", "perf/data_wait_frac"]
                ordered = {**{k: metrics[k] for k in first if k in metrics}, **metrics}  # the ones HParams shows by default first
                tracker.hparams(_hparams(run, parts), ordered, step=state.step, varied=varied_keys())
        except (Preempted, TrainingDiverged) as stopped:
            if d.is_main:
                status = "preempted" if isinstance(stopped, Preempted) else "diverged"
                write_json(run_dir / "metrics.json", {**tracker.latest, **outcome, "status": status})
                callbacks.on_run_end({**tracker.latest, **outcome, "status": status})
            raise
        except (RuntimeError, ConnectionError, EOFError) as e:  # a DataLoader worker that hung or died
            failure = loader_failure(e, run.loader.timeout_s, parts.train_batches.num_workers)
            if failure is None:
                raise
            engine.save(state, {})  # at the last completed step: the run resumes from there
            failure = type(failure)(f"{failure} The last completed step ({state.step}) is saved: {checkpointer.last_good()}")
            if d.is_main:  # this run's progress, with the error (train() would keep an earlier attempt's record)
                write_json(run_dir / "metrics.json", {**tracker.latest, **outcome, "status": "failed", "error": f"DataError: {failure}"})
            failure.recorded = True
        finally:
            engine.profiler.close()
            tracker.close()
        if failure is not None:  # raised out here, so the frames holding the loader's workers are freed
            raise failure

    if d.is_main:
        used = {"batch_size": run.loader.batch_size, "num_workers": parts.train_batches.num_workers, "world_size": d.world_size}
        best = {"best": {"metric": watched.monitor, "value": checkpointer.best, "epoch": (checkpointer.best_at or (None, None))[0],
                         "step": (checkpointer.best_at or (None, None))[1]}}  # fmt: skip
        advice = {"verdict": verdict.kind, "suggestions": [override for override, _ in verdict.suggestions], "facts": facts}
        final = {**metrics, **outcome, **used, **best, "status": "completed", **advice}
        write_json(run_dir / "metrics.json", final)
        callbacks.on_run_end(final)
    shown = [k for k in (watched.monitor, *parts.task.names[:1], "val/loss", "train/loss") if k in metrics]
    log.info("done in %.1fs: %s, %.0f samples/s, data wait %.0f%%, peak memory %.0f MB -> %s", metrics["time/wall_s"],
             ", ".join(f"{k} {metrics[k]:.4f}" for k in dict.fromkeys(shown)), metrics["perf/samples_per_s"],
             100 * metrics["perf/data_wait_frac"], metrics["memory/peak_mb"], run_dir)  # fmt: skip
    result = Metrics(metrics)
    result.objective = watched.monitor
    return result


def resume_hint(run_dir: str, world_size: int) -> str:
    """The command that continues this run in its own directory: the same command line,
    with the run dir pinned and trainer.resume=auto (from Python: the same fit call)."""
    if not HydraConfig.initialized():
        return f"saturate.fit(..., run_dir={str(run_dir)!r}, overrides=[..., 'trainer.resume=auto'])"
    kept = [o for o in command_line() if not o.lstrip("+~").startswith(("hydra.run.dir=", "trainer.resume=", "run_dir="))]
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "train.py"
    per_node = os.environ.get("LOCAL_WORLD_SIZE", world_size)
    launched = os.environ.get(LAUNCHED) == "1"  # started by trainer.devices: the same command starts them again
    launcher = f"torchrun --nproc_per_node={per_node} {script}" if world_size > 1 and not launched else f"python {script}"
    pinned = shlex.quote(f"hydra.run.dir={override_value(str(run_dir))}")
    return " ".join([launcher, *map(shlex.quote, kept), pinned, "trainer.resume=auto"])


def _already_done(run: RunConfig, state: TrainState, checkpointer: Checkpointer, tracker: Tracker, monitor: str) -> Metrics:
    log.warning("trainer.resume: the checkpoint is at epoch %d, step %d, already at trainer.max_epochs=%d / trainer.max_steps=%d: "
                "nothing to train (raise them to train on)",
                state.epoch, state.step, run.trainer.max_epochs, run.trainer.max_steps)  # fmt: skip
    tracker.close()
    metrics = Metrics(checkpointer.resumed_metrics)
    metrics.objective = monitor
    target = Path(run.run_dir) / "metrics.json"
    if not target.is_file() and checkpointer.enabled:  # resumed into a new run dir: say what happened there
        write_json(target, {**metrics, "status": "completed", "note": "resumed a finished run; nothing was trained"})
    return metrics


@dataclass
class Models:
    train: nn.Module  # what the loop calls: DDP-wrapped and/or compiled
    eval: nn.Module  # what the evaluator calls: never DDP (ranks evaluate different numbers of batches), never compiled
    raw: nn.Module  # the plain module: optimizer, checkpoints


@dataclass
class Parts:
    """What a run trains: data, task, precision, model, batches, optimizer and schedule."""

    spec: DataSpec
    task: Task
    precision: Precision
    models: Models
    train_batches: StreamLoader | ResidentLoader
    val_batches: StreamLoader | ResidentLoader | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    global_batch: int
    trials: list[Trial] | None  # batch-size search, when loader.batch_size=auto searched
    search_s: float = 0.0  # how long it took (0 when the cache had the answer)


def _data_name(run: RunConfig, given: Given) -> str:
    if given.datasets is not None:
        return type(given.datasets[0]).__name__
    if HydraConfig.initialized() and HydraConfig.get().runtime.choices.get("data"):
        return HydraConfig.get().runtime.choices["data"]
    return run.data["_target_"].rsplit(".", 1)[-1].removeprefix("load_").removeprefix("make_")


def _setup_training(run: RunConfig, d: Dist, device: torch.device, tracker: Tracker, given: Given) -> Parts:
    """datasets -> task -> precision -> model -> (batch-size search) -> loaders -> optimizer and schedule."""
    train_set, val_set = given.datasets if given.datasets is not None else build_datasets(run.data)
    spec = describe(train_set, val_set, name=_data_name(run, given), classes=run.task.kind == "classification")
    log.info("data: %s: %s; %d train / %s val samples", spec.name, spec.describe(), len(train_set),
             len(val_set) if val_set is not None else "no")  # fmt: skip
    _check_fits_data(run, spec)
    task = _setup_task(run, spec, given)
    precision = setup_precision(run.precision, device)
    # real samples for the start-up check (2) and the compile warm-up (the size the run, or the search, starts with)
    batch = (run.loader.batch_size if run.loader.batch_size != "auto" else run.batch_search.min) if run.trainer.compile else 2
    example = build_pipeline(run.loader, spec, task.target_dtype, device, run.trainer)(
        _host_batch(train_set, range(min(len(train_set), batch)))
    )
    models = _setup_model(run.model, spec, task, device, run.trainer, precision, d, example, given.model)
    del example  # not held on the device through the batch-size search
    trials, started = None, time.perf_counter()
    if run.loader.batch_size == "auto":
        samples = len(train_set) + (len(val_set) if val_set is not None else 0)
        with room_for_resident(run.loader, spec, samples, device):  # resident data is placed after the search: its room is kept
            chosen, trials = _auto_batch_size(run, models, precision, task, train_set, spec, device, d)
        run.loader = dataclasses.replace(run.loader, batch_size=chosen)
    train_batches, val_batches = build_loaders(
        run.loader, run.augmentation, train_set, val_set, spec, target_dtype=task.target_dtype, device=device, trainer=run.trainer,
        show_images=tracker.images, rank=d.rank, world_size=d.world_size,
    )  # fmt: skip
    _check_last_batch(run, models.raw, train_batches, d)
    total_steps = len(train_batches) * run.trainer.max_epochs
    if run.trainer.max_steps > 0:
        total_steps = min(total_steps, run.trainer.max_steps)
    global_batch = run.loader.batch_size * d.world_size
    optimizer, scheduler = setup_optimizer(
        run.optim, models.raw, steps_per_epoch=len(train_batches), total_steps=total_steps, global_batch=global_batch
    )
    search_s = time.perf_counter() - started if trials is not None else 0.0
    return Parts(spec, task, precision, models, train_batches, val_batches, optimizer, scheduler, total_steps, global_batch, trials,
                 search_s)  # fmt: skip


def _check_fits_data(run: RunConfig, spec: DataSpec) -> None:
    """Options that only make sense for uint8 images, and monitors the data cannot give."""
    problems = []
    if not spec.image:
        what = f"uint8 image inputs (C, H, W); the data gives {spec.describe()}"
        if run.augmentation.placement != "none":
            problems.append(Problem("augmentation.placement", run.augmentation.placement, f"none: augmentation works on {what}"))
        if run.trainer.channels_last:
            problems.append(Problem("trainer.channels_last", True, f"false: channels_last is a layout of {what}"))
    monitor = run.checkpoint.monitor
    if monitor.startswith("val/") and not spec.has_val:
        problems.append(Problem("checkpoint.monitor", monitor, "train/loss or auto: there is no validation set"))
    if monitor == "val/top5" and spec.classes and spec.num_classes <= 5:
        problems.append(Problem("checkpoint.monitor", monitor, f"val/acc or val/loss: val/top5 is logged with more than 5 classes, "
                                                               f"the data has {spec.num_classes}"))  # fmt: skip
    if problems:
        raise ConfigError(problems)


def _check_last_batch(run: RunConfig, model: nn.Module, batches, d: Dist) -> None:
    """BatchNorm cannot train on one sample: a last training batch of one (drop_last=false)
    would fail at the end of the first epoch, after minutes of training. Say so now."""
    per_rank = len(batches.dataset) // d.world_size if d.world_size > 1 else len(batches.dataset)
    one_left = not run.loader.drop_last and per_rank % run.loader.batch_size == 1 and run.trainer.limit_train_batches < 0
    if one_left and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        why = f"the last training batch would hold 1 sample ({per_rank} samples, batch {run.loader.batch_size})"
        allowed = f"true: {why}, which BatchNorm cannot train on; or another loader.batch_size"
        raise ConfigError([Problem("loader.drop_last", False, allowed)])


def _setup_task(run: RunConfig, spec: DataSpec, given: Given) -> Task:
    loss = given.loss if given.loss is not None else run.task.loss
    if isinstance(loss, dict):
        loss = _build(loss, "task.loss")
    if loss is not None and not isinstance(loss, str) and not callable(loss):
        raise UserError(f"task.loss: {type(loss).__name__} is not callable; expected a loss called as loss(outputs, targets)")
    return build_task(run.task.kind, loss=loss, label_smoothing=run.task.label_smoothing, huber_delta=run.task.huber_delta,
                      num_classes=spec.num_classes, num_outputs=spec.num_outputs)  # fmt: skip


def _host_batch(dataset: Dataset, indices) -> tuple[torch.Tensor, torch.Tensor]:
    """A host batch of the samples at `indices`, as the DataLoader would collate it."""
    indices = list(indices)
    if getattr(dataset, "returns_batches", False):
        return dataset.__getitems__(indices)
    return stack([(as_tensor(dataset[i][0]), as_tensor(dataset[i][1])) for i in indices])


def _setup_engine(run: RunConfig, parts: Parts, checkpointer: Checkpointer, tracker: Tracker, callbacks: Callbacks, stop: StopSignal,
                  d: Dist, device: torch.device, start_time: float, measured: Measured | None = None) -> Engine:  # fmt: skip
    """The loop and what it drives: the step (with the non-finite guard), evaluator, timer,
    monitor and profiler."""
    guard = NonFiniteGuard(
        skip=run.trainer.skip_nonfinite,
        check_grads=not parts.precision.scaler.is_enabled(),
        max_consecutive=run.trainer.max_nonfinite_steps,
        device=device,
        agree=d.agree,
    )
    step = TrainStep(parts.models.train, parts.optimizer, parts.precision, guard, loss=parts.task.loss, grad_clip=run.trainer.grad_clip,
                     micro_batches=run.trainer.accumulate, dist=d)  # fmt: skip
    profiler = NoProfiler()
    if run.trainer.profile:
        profiler = StepProfiler(Path(run.run_dir) / "profile", device, wait=run.trainer.profile_wait, steps=run.trainer.profile_steps)
    d.check_every = run.trainer.log_interval if d.world_size > 1 else 1  # stop flags agreed at log steps across ranks
    return Engine(
        model=parts.models.train, step=step, scheduler=parts.scheduler, train_batches=parts.train_batches,
        evaluator=Evaluator(parts.models.eval, parts.val_batches, parts.precision, parts.task, interval=run.trainer.eval_interval),
        checkpointer=checkpointer, tracker=tracker, callbacks=callbacks, timer=StepTimer(device), stop=stop,
        monitor=ResourceMonitor(run.monitor.interval_s, device, enabled=run.monitor.enabled), profiler=profiler,
        memory=peak_memory(device), dist=d, max_epochs=run.trainer.max_epochs, max_steps=run.trainer.max_steps, start_time=start_time,
        resume_hint=resume_hint(run.run_dir, d.world_size), measured=measured,
    )  # fmt: skip


def _start_tracking(run: RunConfig, parts: Parts, tracker: Tracker, step: int, resolved: dict, env: dict, d: Dist) -> None:
    tracker.start(parts.total_steps, done=step)
    # Time Series orders groups by name (cpu/ before train/); this tab opens on what matters
    tracker.layout({"loss": ["train/loss", "val/loss"], "validation": list(parts.task.names), "samples/s": ["perf/samples_per_s"],
                    "data wait (fraction of each step)": ["perf/data_wait_frac"], "utilisation %": ["gpu/util", "cpu/util"]})  # fmt: skip
    tracker.text("config", "```yaml\n" + OmegaConf.to_yaml(resolved) + "```")
    tracker.text("fingerprint", "```yaml\n" + OmegaConf.to_yaml(env) + "```")
    if parts.trials is not None:
        tracker.text("batch_search", table(parts.trials, run.loader.batch_size))
        for t in parts.trials:
            tracker.log({"batch_search/samples_per_s": t.samples_per_s or 0.0}, step=t.size)
    ranks = f", {d.world_size} ranks: global batch {parts.global_batch}" if d.world_size > 1 else ""
    data = parts.spec.name + (" (SYNTHETIC)" if parts.spec.synthetic else "")
    log.info("training %s on %s: %d steps (%d per epoch), batch %d per device%s", type(parts.models.raw).__name__, data,
             parts.total_steps, len(parts.train_batches), run.loader.batch_size, ranks)  # fmt: skip


def _report(run: RunConfig, metrics: dict, *, steps: int, device, parts: Parts, tracker: Tracker, gpu, cpu_util) -> tuple[Verdict, dict]:
    """The bottleneck report: to the console, report.md and TensorBoard. Returns the
    verdict and the facts it was judged on (for metrics.json: saturate.tune reads them)."""
    train_batches, precision = parts.train_batches, parts.precision
    facts = RunFacts(
        device=device.type,
        batch_size=run.loader.batch_size,
        num_workers=train_batches.num_workers,
        cpus=cpus_per_process(),
        resident=run.loader.resident,
        in_memory=parts.spec.in_memory,
        image=parts.spec.image,
        cpu_util=cpu_util,
        placement=run.augmentation.placement,
        persistent_workers=run.loader.persistent_workers,
        pin_memory=run.loader.pin_memory is True or (run.loader.pin_memory == "auto" and device.type == "cuda"),
        precision=precision.name,
        compile=run.trainer.compile,
        channels_last=run.trainer.channels_last,
        memory_headroom=metrics["memory/peak_mb"] < 0.5 * device_memory_mb(device),
        emulated_precision=emulated(precision.name, device),
    )
    verdict = diagnose(metrics, facts, steps=steps)
    text = render(metrics, verdict, steps=steps, gpu=gpu, cpu_util=cpu_util)
    (Path(run.run_dir) / "report.md").write_text(text)
    tracker.text("bottleneck_report", text)  # TensorBoard sorts text by tag: the report before the config
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:  # one line per sweep job; the report is in its dir
        log.info("verdict: %s (%s); the report: %s", verdict.kind, verdict.reason, Path(run.run_dir) / "report.md")
    else:
        log.info("\n%s", text)
    return verdict, dataclasses.asdict(facts)


@contextlib.contextmanager
def seeded(cfg: TrainerConfig, device: torch.device):
    """Seed every generator; with `deterministic`, deterministic kernels for the run (the
    process-wide switches are put back afterwards, for callers that train twice).

    On CUDA some backward kernels have no deterministic version (adaptive pooling, NLLLoss,
    scatter-add among them): torch then warns when one runs instead of stopping the run, and
    the run is reproducible up to those ops. On the CPU every op used is deterministic and
    resumed runs equal uninterrupted ones bit for bit."""
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        cuda = device.type == "cuda"
        torch.use_deterministic_algorithms(True, warn_only=cuda)
        torch.backends.cudnn.benchmark = False
        if cuda:
            log.warning("trainer.deterministic=true on CUDA: ops without a deterministic CUDA kernel (adaptive pooling and "
                        "NLLLoss backward, scatter-add, ...) run anyway, each with a torch warning; bit-exact results are "
                        "promised on the CPU only")  # fmt: skip
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


def _auto_batch_size(run: RunConfig, models: Models, precision: Precision, task: Task, train_set, spec: DataSpec, device: torch.device,
                     d: Dist):  # fmt: skip
    """loader.batch_size=auto: the cached choice for this key, or a search (saturate.batch_size).
    Under DDP each rank searches on its own device with the plain model (no collectives in
    the trials: not DDP's, and SyncBatchNorm's only within the rank itself) and the smallest
    choice wins, so it fits everywhere."""
    cfg = run.batch_search
    key = {
        # the model node and what it built (fit's own model: its class and size)
        "model": {
            "node": run.model,
            "class": _described(None, models.raw)["object"],
            "parameters": sum(p.numel() for p in models.raw.parameters()),
        },  # fmt: skip
        "input": [*spec.input_shape, str(spec.input_dtype)],
        "task": task.kind,
        "precision": precision.name,
        "compile": run.trainer.compile,
        "channels_last": run.trainer.channels_last,
        "augmentation": run.augmentation.placement,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu: {cpu_name()}",
        "world_size": d.world_size,
        "memory_fraction": run.device.memory_fraction,  # what memory the sizes had to fit in
        "resident": run.loader.resident,  # resident data takes device memory beside the batch
    }
    high = min(cfg.max, len(train_set) // d.world_size)
    cache = Cache(cfg.cache, valid=valid_choice)
    hit = cache.get(key)
    if hit is not None and cfg.min <= hit["batch_size"] <= high:
        log.info("loader.batch_size=auto: %d, reused from %s (same model, input, precision, compile, device)", hit["batch_size"], cfg.cache)
        return hit["batch_size"], [Trial(**t) for t in hit["trials"]]

    start = time.perf_counter()
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(run.trainer.seed))
    optimizer = instantiate(run.optim.optimizer)(models.raw.parameters())  # the run's kind, thrown away afterwards
    prime_state(optimizer)  # fp16's first trial step may overflow: fused SGD's momentum must not read garbage
    augment = device_augment(run.augmentation, run.trainer.seed)
    pipeline = build_pipeline(run.loader, spec, task.target_dtype, device, run.trainer, augment=augment)
    model = models.train if d.world_size == 1 else models.eval
    guard = NonFiniteGuard(skip=False, check_grads=False, max_consecutive=1, device=device)  # reads nothing per step
    step = TrainStep(model, optimizer, precision, guard, loss=task.loss, grad_clip=0.0, recover_oom=False)
    fetch = lambda size: _host_batch(train_set, order[:size].tolist())  # a host batch of `size` real training samples
    measure = measure_with(step, optimizer, pipeline, fetch, steps=cfg.steps, device=device)
    with alone(model, d):  # SyncBatchNorm: each rank's trials are its own
        chosen, trials = restoring(models.raw, lambda: search(measure, low=cfg.min, high=high, min_gain=cfg.min_gain, safety=cfg.safety))
    chosen = d.minimum(chosen)
    if run.trainer.compile:  # each trial's size was a new shape: from the second on, a graph with a dynamic batch dimension
        torch._dynamo.reset()  # dropped, so the run compiles once for the size it trains with (in its warm-up window)
    if d.is_main:
        cache.put(key, {"batch_size": chosen, "trials": [dataclasses.asdict(t) for t in trials]})
    log.info("loader.batch_size=auto: %d after %d trials in %.1fs%s\n%s", chosen, len(trials), time.perf_counter() - start,
             f" (cached in {cfg.cache})" if cfg.cache else "", table(trials, chosen))  # fmt: skip
    return chosen, trials


def model_arguments(target: Callable, node: dict, spec: DataSpec) -> dict[str, Any]:
    """The data-derived arguments `target`'s signature names (and the node does not set):
    in_channels (the input's first dimension: C of (C, H, W)), in_features (its last: F of
    (T, F) or (F,)), input_shape, num_classes (classification), num_outputs (classes, or
    values per target)."""
    try:
        names = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return {}
    shape = spec.input_shape or (1,)
    values = {"in_channels": shape[0], "in_features": shape[-1], "input_shape": tuple(spec.input_shape), "num_outputs": spec.num_outputs}
    if spec.classes:
        values["num_classes"] = spec.num_classes
    return {k: v for k, v in values.items() if k in names and k not in node and k in DATA_ARGUMENTS}


def _check_outputs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, spec: DataSpec, task: Task, precision: Precision) -> None:
    """One forward pass on two real samples (eval mode, no gradients: nothing moves), so a
    model that does not fit the data fails now, with the shapes, not in the first step."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), precision.autocast():
            out = model(x)
    except RuntimeError as e:  # torch's shape and dtype mismatches; anything else is a bug in the model, with its traceback
        raise UserError(
            f"model: {type(model).__name__} cannot take the data's inputs ({spec.describe()}; a batch of "
            f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}): {type(e).__name__}: {str(e).splitlines()[0]}",
        ) from None
    finally:
        model.train(was_training)
    n = len(x)
    if not isinstance(out, torch.Tensor):
        raise UserError(f"model: {type(model).__name__} returns a {type(out).__name__}; saturate needs one tensor of outputs")
    want = (n, task.num_classes) if task.kind == "classification" else None
    if want is not None and tuple(out.shape) != want:
        raise UserError(f"model: {type(model).__name__} returns outputs of shape {tuple(out.shape)} for a batch of {n}; task=classification"
                        f" with {task.num_classes} classes needs {want} (the model's num_classes/num_outputs argument)")  # fmt: skip
    if want is None and out.numel() != n * task.num_outputs:
        raise UserError(f"model: {type(model).__name__} returns outputs of shape {tuple(out.shape)} for a batch of {n}; task=regression "
                        f"with targets of shape {spec.target_shape} needs {task.num_outputs} value(s) per sample")  # fmt: skip
    _check_loss(model, x, y, task, precision)


def _check_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: Task, precision: Precision) -> None:
    """The loss on two real samples is one number with a gradient: a loss that returns a
    vector, a Python float or a detached value would fail (or silently not train) at step 1."""
    was_training = model.training
    model.eval()  # nothing moves: no BatchNorm statistics, no dropout; the graph is dropped
    try:
        with precision.autocast():
            loss = task.loss(model(x), y)
    finally:
        model.train(was_training)
    what = f"task.loss: {getattr(task.loss, '__name__', type(task.loss).__name__)}"
    if not isinstance(loss, torch.Tensor):
        raise UserError(f"{what} returns a {type(loss).__name__}, not a tensor; compute it from the model's outputs with torch "
                        "operations, so that it has a gradient")  # fmt: skip
    if loss.numel() != 1 or not loss.is_floating_point():
        raise UserError(f"{what} returns a {str(loss.dtype).removeprefix('torch.')} tensor of shape {tuple(loss.shape)} for a batch of "
                        f"{len(y)}; a loss is one number: reduce it (.mean() or .sum())")  # fmt: skip
    if not loss.requires_grad:
        raise UserError(f"{what} returns a value with no gradient (detached, or not computed from the model's outputs); nothing "
                        "would train")  # fmt: skip


def _setup_model(node: dict, spec: DataSpec, task: Task, device: torch.device, trainer: TrainerConfig, precision: Precision, d: Dist,
                 example: tuple[torch.Tensor, torch.Tensor], given: nn.Module | None) -> Models:  # fmt: skip
    """The model, built from its node with the data-derived arguments it names (or the one
    passed in), checked on two samples, on the device, maybe SyncBN, DDP and compiled.
    `example`: a device batch of real samples (at least 2)."""
    if given is not None:
        raw = given
    else:
        raw = _build({**node, **model_arguments(get_method(node["_target_"]), node, spec)}, "model")
    if not isinstance(raw, nn.Module):
        raise UserError(f"model: {type(raw).__name__} is not a torch.nn.Module")
    memory_format = torch.channels_last if trainer.channels_last else torch.preserve_format
    raw = raw.to(device=device, memory_format=memory_format)
    trainable = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    if not trainable:
        count = sum(p.numel() for p in raw.parameters())
        why = f"none of its {count} parameters requires a gradient (all frozen)" if count else "it has no parameters"
        raise UserError(f"model: {type(raw).__name__} cannot be trained: {why}")
    _check_outputs(raw, example[0][:2], example[1][:2], spec, task, precision)
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
    compiled = _compile(wrapped, raw, example, precision, task)
    # evaluated uncompiled: the compiled graph is for training steps of one batch shape;
    # eval mode, no gradients and a short last batch would each compile it again
    return Models(compiled, raw, raw)


def _compile(model: nn.Module, raw: nn.Module, example: tuple[torch.Tensor, torch.Tensor], precision: Precision, task: Task) -> nn.Module:
    """torch.compile, warmed up on one forward/backward so that a failure shows now (and the
    run goes on in eager mode with one warning) and the compile time is reported apart."""
    saved = copy.deepcopy(raw.state_dict())  # the warm-up must not move BatchNorm statistics
    compiled = torch.compile(model)
    log.info("torch.compile: compiling the model (one forward and backward; tens of seconds, minutes for large models) ...")
    start = time.perf_counter()
    try:
        with precision.autocast():
            loss = task.loss(compiled(example[0]), example[1])
        loss.backward()
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


def _hparams(run: RunConfig, parts: Parts) -> dict:
    """The columns of this run in TensorBoard's HParams tab: the overrides it was given
    (every job of a sweep has the same keys), then its main settings."""
    return {
        **_swept(run),
        "model": type(parts.models.raw).__name__,
        "data": parts.spec.name,
        "task": parts.task.kind,
        "precision": parts.precision.name,
        "loader.batch_size": run.loader.batch_size,
        "loader.num_workers": parts.train_batches.num_workers,  # the number used, not "auto"
        "augmentation": run.augmentation.placement,
        "augmentation.preset": "none"
        if run.augmentation.placement == "none"
        else ("+".join(s.preset for s in run.augmentation.schedule) or run.augmentation.preset),  # fmt: skip
        "optim": run.optim.optimizer["_target_"].rsplit(".", 1)[-1],
        "optim.lr": run.optim.optimizer.get("lr", float("nan")),
        "trainer.compile": run.trainer.compile,
        "trainer.channels_last": run.trainer.channels_last,
    }
