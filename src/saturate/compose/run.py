"""`train(cfg)`: check the config, build the parts of a run in order, hand them to the engine,
record the outcome. The composition root: each part is built by the module its name points
to (saturate.compose.build calls data, task, precision, model, batch search, loaders, optimizer in
order); this module wires them to the loop and writes what the run leaves behind.

`saturate.fit` (saturate.api) passes objects where train.py's config names them; the rest is
the same run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from datetime import datetime
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm.contrib.logging import logging_redirect_tqdm

from saturate.callbacks import CallbackError, Observers, Run
from saturate.callbacks.profiler import Profiler
from saturate.compose.build import Given, Parts, build_parts, make_step
from saturate.compose.outcome import Metrics, Session, already_done, class_names, finish, settings_given, task_name, write
from saturate.config.registration import UNSET_RUN_DIR, set_data_info
from saturate.config.schema import RunConfig, validate
from saturate.data.loader import loader_failure
from saturate.data.policy import PRESETS
from saturate.errors import UserError
from saturate.loop.engine import Control, Engine, Training, TrainState, Watch
from saturate.loop.evaluate import Evaluator
from saturate.loop.faults import Preempted, StopSignal, TrainingDiverged
from saturate.observe.environment import fingerprint
from saturate.observe.monitor import ResourceMonitor, peak_memory
from saturate.observe.timing import RunClock, StepTimer
from saturate.observe.tracking import Tracker
from saturate.parts.checkpoint import Checkpointer
from saturate.parts.device import seeded, setup_device
from saturate.parts.model import build
from saturate.parts.rundir import RunDirTaken, hold, record_failure
from saturate.scale.distributed import Dist, peer_failed, world_size
from saturate.scale.launch import resume_hint

log = logging.getLogger("saturate")


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
    finally:
        set_data_info({})


def _train(cfg: DictConfig, given: Given) -> Metrics:
    start_time, started_at = time.perf_counter(), datetime.now().astimezone().isoformat(timespec="seconds")
    set_data_info({})  # ${data_info:...} is a placeholder until this run's data is described
    run = validate(cfg, presets=tuple(PRESETS), given=given.nodes())
    if run.tune.enabled:  # train.py hands tune=true to saturate.tune before any training
        raise UserError("tune.enabled=true: tune through train.py (python train.py tune=true ...); saturate.fit and train() train")
    d = Dist(None if run.device.type == "cpu" else run.device.index)
    log.setLevel(run.trainer.log_level if d.is_main else "WARNING")  # one voice: rank 0's
    run_dir = _run_dir(run)
    observers = _observers(run, given, d)
    tracker = Tracker(observers, log_interval=run.trainer.log_interval, progress=run.trainer.progress, enabled=d.is_main)
    device = setup_device(run.device, local_rank=d.local_rank)
    held = hold(run_dir, resume=run.trainer.resume, restart=run.trainer.restart, enabled=d.is_main, agree=d.agree)
    with held, seeded(run.trainer, device), StopSignal() as stop:
        stop.listeners.append(observers.stop_requested)
        parts = build_parts(cfg, run, d, device, tracker.images, given)
        watched = run.checkpoint.resolved(parts.task, parts.spec.has_val)
        tracker.shown = watched.monitor if watched.monitor.startswith("val/") and watched.monitor != "val/loss" else "val/loss"
        env = fingerprint(device, precision=parts.precision.name, compile=run.trainer.compile,
                          channels_last=run.trainer.channels_last, world_size=d.world_size)  # fmt: skip
        handle = Run(run_dir=run_dir, model=parts.models.raw, optimizer=parts.optimizer, scheduler=parts.scheduler, monitor=watched.monitor,
                     mode=watched.mode, total_steps=parts.total_steps, start_step=0, rank=d.rank, world_size=d.world_size,
                     direction=lambda name: "min" if name.endswith("loss") else parts.task.better(name.split("/", 1)[-1]),
                     info={"data": parts.spec.name, "model": type(parts.models.raw).__name__, "task": task_name(parts.task)})  # fmt: skip
        checkpointer = Checkpointer(run_dir / "checkpoints", watched, interval=run.trainer.checkpoint_interval, model=parts.models.raw,
                                    evaluated=lambda: handle.eval_model, lr_scale=lambda: handle.lr_scale,
                                    config=_recorded_config(cfg, given), fingerprint=env, enabled=d.is_main,
                                    parts={"optimizer": parts.optimizer, "scheduler": parts.scheduler, "scaler": parts.precision.scaler,
                                           "observers": observers})  # fmt: skip
        state = TrainState(**checkpointer.resume(run.trainer.resume))
        handle.step = handle.start_step = state.step
        handle.lr_scale = checkpointer.lr_scale
        handle.epoch = state.epoch
        timer = StepTimer(device)
        handle.timer = timer  # the steady-state windows, for a callback that stops once measured (tune's trials)
        engine = _engine(run, parts, checkpointer, tracker, observers, handle, stop, d, device, timer, start_time)
        if engine.finished(state):  # a finished run resumed: nothing to train
            return already_done(run, state, checkpointer, watched.monitor)
        tracker.attach(handle, parts.total_steps, state.step)
        observers.call("on_run_start", handle)
        checkpointer.resume_observers()
        _start_tracking(run, parts, tracker, cfg, given, env, d)
        outcome = {"data": parts.spec.name, "synthetic": parts.spec.synthetic, "precision": parts.precision.name,
                   "task": task_name(parts.task), "monitor": watched.monitor, "started_at": started_at,
                   "overrides": _overrides(given), "fingerprint": env}  # fmt: skip
        if parts.trials is not None:  # loader.batch_size=auto: what was tried, and how long it took
            outcome["batch_search"] = {"seconds": parts.search_s, "trials": [dataclasses.asdict(t) for t in parts.trials]}
        session = Session(run, parts, engine, handle, tracker, observers, checkpointer, d, device, outcome, start_time)
        return _drive(session, state)


def _drive(s: Session, state: TrainState) -> Metrics:
    """Train, then finish; whatever stops the run leaves its record and closes the observers."""
    record, failure = None, None
    try:
        with logging_redirect_tqdm(), torch.autograd.set_detect_anomaly(s.cfg.trainer.detect_anomaly), s.engine.watch.monitor:
            last = s.engine.fit(state)
        metrics = finish(s, last)
        record = {**metrics, "status": "completed"}
        return metrics
    except (Preempted, TrainingDiverged) as stopped:
        record = {**s.tracker.latest, **s.outcome, "status": "preempted" if isinstance(stopped, Preempted) else "diverged"}
        write(s, record)
        raise
    except CallbackError as e:  # a hook raised: saved at the last completed step, one line
        s.engine.save(state, {})
        record = {**s.tracker.latest, **s.outcome, "status": "failed", "error": f"CallbackError: {e}"}
        write(s, record)
        e.recorded = True
        raise e.with_traceback(None) from None
    except (RuntimeError, ConnectionError, EOFError) as e:  # a DataLoader worker that hung or died
        failure = loader_failure(e, s.cfg.loader.timeout_s, s.parts.loaders.train.num_workers)
        if failure is None:
            raise
        s.engine.save(state, {})  # at the last completed step: the run resumes from there
        failure = type(failure)(f"{failure} The last completed step ({state.step}) is saved: {s.checkpointer.last_good()}")
        record = {**s.tracker.latest, **s.outcome, "status": "failed", "error": f"DataError: {failure}"}
        write(s, record)  # this run's progress, with the error (train() would keep an earlier attempt's record)
        failure.recorded = True
    finally:
        s.parts.loaders.close()
        s.tracker.close()
        s.observers.call("on_run_end", s.run, record or {**s.tracker.latest, **s.outcome, "status": "failed"})
        if record is not None and record["status"] == "completed":
            s.dist.barrier()  # the ranks leave together: one that tore down gloo while rank 0 still wrote aborted once in CI
    raise failure  # out here, so the frames holding the loader's workers are freed


def _engine(run: RunConfig, parts: Parts, checkpointer, tracker, observers, handle, stop, d: Dist, device, timer, start_time) -> Engine:
    """The loop and what it drives: the step (with the non-finite guard), the evaluator, the
    timer, monitor and memory reader, the limits."""
    step = make_step(run, parts.models, parts.optimizer, parts.precision, parts.task, device, d)
    evaluator = Evaluator(parts.loaders.val, parts.precision, parts.task, interval=run.trainer.eval_interval,
                          class_names=class_names(parts))  # fmt: skip
    d.check_every = run.trainer.log_interval if d.world_size > 1 else 1  # stop flags agreed at log steps across ranks
    watch = Watch(tracker, timer, ResourceMonitor(run.monitor.interval_s, device, enabled=run.monitor.enabled), peak_memory(device),
                  RunClock())  # fmt: skip
    control = Control(run.trainer.max_epochs, run.trainer.max_steps, stop, d, start_time, resume_hint(run.run_dir, d.world_size))
    return Engine(Training(parts.models.train, step, parts.scheduler, parts.loaders.train), evaluator, checkpointer, watch, observers,
                  handle, control)  # fmt: skip


def _observers(run: RunConfig, given: Given, d: Dist) -> Observers:
    """The run's callbacks (configured, given to fit, the profiler when asked) and loggers."""
    callbacks = {name: build(node, f"callbacks.{name}") for name, node in run.callbacks.items()}
    if run.trainer.profile:
        callbacks["profiler"] = Profiler(wait=run.trainer.profile_wait, steps=run.trainer.profile_steps)
    loggers = {name: build(node, f"logger.{name}") for name, node in run.logger.items()}
    return Observers({**callbacks, **given.callbacks}, {**loggers, **given.loggers}, is_main=d.is_main)


def _run_dir(run: RunConfig) -> Path:
    if run.run_dir == UNSET_RUN_DIR:
        raise UserError("run_dir: not set; outside train.py (Hydra's compose API) give run_dir=<folder>, or use saturate.fit")
    run_dir = Path(run.run_dir)
    _writable(run_dir, "run_dir")  # before any work: a read-only or full disk is found now, not at the first save
    if run.loader.batch_size == "auto" and run.batch_search.cache:
        _writable(Path(run.batch_search.cache).parent, "batch_search.cache")
    return run_dir


def _writable(folder: Path, key: str) -> None:
    """`folder` exists (made if need be) and takes a file, or a UserError naming `key`."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".saturate-write-test-{os.getpid()}"
        probe.write_bytes(b"saturate")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{key}: cannot write to {folder} ({e.strerror or e}); point it at a writable folder") from None


def _recorded_config(cfg: DictConfig, given: Given) -> dict:
    """The resolved config as checkpoints record it; objects fit was given are named."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    for key, obj in (("model", given.model), ("data", given.data), ("task", given.task)):
        if obj is not None:
            resolved[key] = {"object": f"{type(obj).__module__}.{type(obj).__qualname__}"}
    return resolved


def _overrides(given: Given) -> list[str]:
    """The command line's overrides (train.py), or the ones fit was given."""
    if HydraConfig.initialized():
        return list(HydraConfig.get().overrides.task)
    return list(given.overrides)


def _start_tracking(run: RunConfig, parts: Parts, tracker: Tracker, cfg: DictConfig, given: Given, env: dict, d: Dist) -> None:
    from saturate.parts.batch_size import table

    # Time Series orders groups by name (cpu/ before train/); this tab opens on what matters
    tracker.layout({"loss": ["train/loss", "val/loss"], "validation": [f"val/{n}" for n in parts.task.names()],
                    "samples/s": ["perf/samples_per_s"], "data wait (fraction of each step)": ["perf/data_wait_frac"],
                    "utilisation %": ["gpu/util", "cpu/util"]})  # fmt: skip
    given_overrides = settings_given(_overrides(given))
    head = f"**Overrides:** `{' '.join(given_overrides)}`" if given_overrides else "**Overrides:** none (the defaults)"
    if run.augmentation.placement == "none":  # the schema's preset default would read as if it ran
        head += "\n\nNothing is augmented (augmentation.placement=none): `augmentation.preset` below is not used."
    tracker.text("config", f"{head}\n\n```yaml\n{OmegaConf.to_yaml(_recorded_config(cfg, given))}```")
    tracker.text("fingerprint", "```yaml\n" + OmegaConf.to_yaml(env) + "```")
    if parts.trials is not None:
        tracker.text("batch_search", table(parts.trials, run.loader.batch_size))
        for t in parts.trials:
            tracker.log({"batch_search/samples_per_s": t.samples_per_s or 0.0}, step=t.size)
    ranks = f", {d.world_size} ranks: global batch {parts.global_batch}" if d.world_size > 1 else ""
    data = parts.spec.name + (" (SYNTHETIC)" if parts.spec.synthetic else "")
    log.info("training %s on %s: %d steps (%d per epoch), batch %d per device%s", type(parts.models.raw).__name__, data,
             parts.total_steps, len(parts.loaders.train), run.loader.batch_size, ranks)  # fmt: skip
