"""`train(cfg)`: check the config, build the parts of a run in order, hand them to the engine,
record the outcome. The composition root: each part is built by the module its name points
to (saturate.trainer.build calls data, task, precision, model, batch search, loaders, optimizer in
order); this module wires them to the loop and writes what the run leaves behind.

`saturate.fit` (saturate.api) passes objects where train.py's config names them; the rest is
the same run.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.contrib.logging import logging_redirect_tqdm

from saturate import names
from saturate.callbacks import CallbackError, Observers, Plan, Run
from saturate.callbacks.profiler import Profiler
from saturate.checkpoint.rundir import RunDirTaken, hold, prepare, record_failure
from saturate.components.device import seeded, setup_device
from saturate.config.instantiate import build
from saturate.config.invocation import Invocation, from_hydra
from saturate.config.naming import identity
from saturate.config.schema import CheckpointConfig, RunConfig, validate
from saturate.data.loader import loader_failure
from saturate.diagnostics.environment import fingerprint
from saturate.diagnostics.monitor import ResourceMonitor, peak_memory
from saturate.diagnostics.timing import RunClock, Startup, StepTimer
from saturate.diagnostics.tracking import Tracker
from saturate.errors import UserError
from saturate.loop.engine import Engine, Instruments, Limits, Training, TrainState
from saturate.loop.evaluate import EvaluationError, Evaluator
from saturate.loop.faults import NotRequeued, Preempted, StopSignal, TrainingDiverged
from saturate.scale.distributed import Dist, peer_failed, stopped_by_peer, world_size
from saturate.scale.launch import resume_hint
from saturate.started import StoppedEarly
from saturate.trainer.build import Parts, UserObjects, build_checkpointer, build_parts, build_target
from saturate.trainer.outcome import (
    Metrics,
    Session,
    abandon,
    already_done,
    class_names,
    finish,
    recorded_config,
    setup_record,
    start_records,
    task_name,
    write,
)
from saturate.trainer.steps import train_step

log = logging.getLogger("saturate")


def train(
    cfg: DictConfig | RunConfig, invocation: Invocation | None = None, objects: UserObjects | None = None
) -> Metrics:
    """Train with the composed config `cfg` (checked here, or already checked: the RunConfig
    saturate.config.schema.validate returned); return the final metrics (also in metrics.json).
    `invocation`: how the run was started (default: the running Hydra app's, read here once);
    `objects`: what a caller passes where the config names it (saturate.fit). A run that fails
    still leaves a metrics.json saying so and why (for sweep reports)."""
    invocation = invocation or from_hydra() or Invocation()
    attempt = Attempt()
    try:
        return _train(cfg, invocation, objects or UserObjects(), attempt)
    except (Preempted, TrainingDiverged, RunDirTaken, NotRequeued):
        raise  # they record their own status (NotRequeued: preempted), or the run dir is another run's
    except StoppedEarly as stopped:  # before the loop: the process ends at once, its line said
        record_failure(cfg.run_dir, UserError(stopped.line))
        raise
    except KeyboardInterrupt:  # a second Ctrl-C: at once, as asked; the record says so
        why = "interrupted: a second Ctrl-C stopped the run at once, without a final save"
        record_failure(cfg.run_dir, UserError(why))
        raise
    except Exception as e:
        broke = peer_failed(e) if not isinstance(e, UserError) and world_size() > 1 else None
        if broke:  # not this rank's error: one line, not gloo's traceback
            e = stopped_by_peer(broke)
            record_failure(cfg.run_dir, e)
            raise e from None
        if attempt.recorded is not e:
            record_failure(cfg.run_dir, e, trained=attempt.trained)
        raise


@dataclass
class Attempt:
    """How far this attempt got, for the record of its failure: whether it trained (its own
    failure then replaces an earlier attempt's record), and the failure recorded already with
    the run's progress where it was caught (another raised after it is recorded as usual)."""

    trained: bool = False
    recorded: BaseException | None = None


TUNE_BY_COMMAND = (
    "tune.enabled=true: tune through the command (saturate train tune=true ...); saturate.fit and train() train"
)


def _train(cfg: DictConfig | RunConfig, invocation: Invocation, objects: UserObjects, attempt: Attempt) -> Metrics:
    """Until the loop starts a stop signal ends the process at once, naming the phase (nothing
    is trained, nothing to save); from then on the loop stops at its next step and saves."""
    with StopSignal(phase="checking the config") as stop:
        return _start(cfg, invocation, objects, attempt, stop)


def _start(cfg, invocation: Invocation, objects: UserObjects, attempt: Attempt, stop: StopSignal) -> Metrics:
    start_time, started_at = time.perf_counter(), datetime.now().astimezone().isoformat(timespec="seconds")
    startup = Startup(from_process=bool(invocation.app))  # train.py's process (not saturate.fit's call)
    run = cfg if isinstance(cfg, RunConfig) else validate(cfg, given=objects.nodes())
    if run.tune.enabled:  # the command hands tune=true to saturate.tune before any training
        raise UserError(TUNE_BY_COMMAND)
    dist = Dist(None if run.device.type == "cpu" else run.device.index)
    log.setLevel(run.trainer.log_level if dist.is_main else "WARNING")  # one voice: rank 0's
    run_dir = prepare(run)
    observers = _observers(run, objects, dist)
    tracker = Tracker(
        observers, log_interval=run.trainer.log_interval, progress=run.trainer.progress, enabled=dist.is_main
    )
    device = setup_device(run.device, local_rank=dist.local_rank)
    lock = hold(run_dir, resume=run.trainer.resume, restart=run.trainer.restart, enabled=dist.is_main, agree=dist.agree)
    with lock as held, seeded(run.trainer, device):
        stop.listeners.append(observers.stop_requested)
        startup.mark("config and run dir")
        stop.phase = "building the data, the model and the other parts of the run"
        parts = build_parts(run, invocation, objects, dist, device, tracker.images, startup=startup)
        checkpointing = parts.checkpointing
        tracker.shown = (
            checkpointing.monitor if checkpointing.monitor not in (names.TRAIN_LOSS, names.VAL_LOSS) else names.VAL_LOSS
        )
        flags = {"compile": run.trainer.compile, "channels_last": run.trainer.channels_last}
        env = fingerprint(device, precision=parts.precision.name, world_size=dist.world_size, **flags)
        config = recorded_config(run, parts, objects)
        checkpointer = build_checkpointer(run, checkpointing, parts, observers, config, env, dist)
        held.start_over()  # trainer.restart: only now, with the config checked and every part built
        stop.phase = "loading the checkpoint of trainer.resume"
        resumed = checkpointer.resume(run.trainer.resume)
        state = TrainState(resumed.epoch, resumed.step, resumed.batch_in_epoch)
        timer = StepTimer(device)
        view = _callback_view(run_dir, parts, checkpointing, dist, state, timer, resumed.lr_scale, invocation)
        monitor = ResourceMonitor(run.monitor.interval_s, device, enabled=run.monitor.enabled)
        instruments = Instruments(tracker, timer, monitor, peak_memory(device), RunClock())
        hint = resume_hint(run.run_dir, dist.world_size, invocation)
        target = build_target(run, parts)
        limits = (run.trainer.max_epochs, run.trainer.max_steps)
        ends = Limits(*limits, stop, dist, start_time, hint, target, origin=startup.origin)
        training, evaluator = _training(run, parts, device, dist), _evaluator(run, parts)
        engine = Engine(training, evaluator, checkpointer, instruments, observers, view, ends)
        if engine.finished(state):  # a finished run resumed: nothing to train
            return already_done(run, state, resumed.metrics, checkpointer.enabled, checkpointing.monitor)
        stop.phase = None  # from the loggers' start on, a stop signal stops the loop at its first step, which saves
        tracker.attach(view, parts.total_steps, state.step)
        observers.call("on_run_start", view)
        checkpointer.restore_run(view)
        observers.check_state()  # a callback state a checkpoint cannot hold: one line now, not at the first save
        start_records(run, invocation, parts, tracker, config, env, dist)
        startup.mark("loggers and records")
        outcome = setup_record(parts, checkpointing.monitor, started_at, list(invocation.overrides), env)
        session = Session(
            run, invocation, parts, engine, view, tracker, observers, dist, device, outcome, start_time, startup
        )
        attempt.trained = True  # a failure from here on is this attempt's, after it trained
        return _fit(session, state, attempt)


def _callback_view(
    run_dir: Path,
    parts: Parts,
    checkpointing: CheckpointConfig,
    dist: Dist,
    state: TrainState,
    timer,
    lr_scale: float,
    invocation: Invocation,
) -> Run:
    """What the callbacks see of the run (saturate.callbacks.Run)."""
    info = {"data": parts.spec.name, "model": type(parts.models.raw).__name__, "task": task_name(parts.task)}
    info.update(identity(invocation, run_dir))
    plan = Plan(run_dir, checkpointing.monitor, checkpointing.mode, parts.total_steps, dist.rank, dist.world_size, info)
    return Run(
        plan,
        model=parts.models.raw,
        optimizer=parts.optimizer,
        scheduler=parts.scheduler,
        position=state,
        timer=timer,
        lr_scale=lr_scale,
        direction=lambda name: "min" if name.endswith("loss") else parts.task.better(name.split("/", 1)[-1]),
    )


def _fit(session: Session, state: TrainState, attempt: Attempt) -> Metrics:
    """Train, then finish; whatever stops the run leaves its record and closes the observers."""
    record, failure = None, None
    session.observers.abandon = lambda signum: abandon(session, state, signum)
    try:
        with (
            logging_redirect_tqdm(),
            torch.autograd.set_detect_anomaly(session.config.trainer.detect_anomaly),
            session.engine.instruments.monitor,
        ):
            summary = session.engine.fit(state)
        metrics = finish(session, summary)
        record = {**metrics, "status": "completed"}
        return metrics
    except (Preempted, TrainingDiverged) as stopped:
        record = {**session.tracker.latest, **session.outcome, "status": "diverged"}
        if isinstance(stopped, Preempted):  # what stopped it and how it goes on (a sweep's report names them)
            name, hint = signal.Signals(stopped.signum).name, session.engine.limits.resume_hint
            record.update(status="preempted", stopped_by=name, resume_with=hint)
        write(session, record)
        raise
    except (CallbackError, EvaluationError) as e:  # a hook or a metric raised: saved at the last completed step
        session.engine.save(state, {})
        record = {**session.tracker.latest, **session.outcome, "status": "failed", "error": f"{type(e).__name__}: {e}"}
        write(session, record)
        attempt.recorded = e
        raise e.with_traceback(None) from None
    except (RuntimeError, ConnectionError, EOFError) as e:  # a DataLoader worker that hung or died
        failure = loader_failure(e, session.config.loader.timeout_s, session.parts.loaders.train.num_workers)
        if failure is None:
            raise
        session.parts.loaders.close()  # first: another worker's death (torch's SIGCHLD) then breaks no save
        session.engine.save(state, {})  # at the last completed step: the run resumes from there
        failure = type(failure)(
            f"{failure} The last completed step ({state.step}) is saved: {session.engine.checkpointer.last_good()}"
        )
        record = {**session.tracker.latest, **session.outcome, "status": "failed", "error": f"DataError: {failure}"}
        write(session, record)  # this run's progress, with the error (train() would keep an earlier attempt's record)
        attempt.recorded = failure
    finally:
        session.engine.checkpointer.close()  # a save in flight, on disk before the process can end
        session.parts.loaders.close()
        session.tracker.close()
        try:
            session.observers.call(
                "on_run_end", session.view, record or {**session.tracker.latest, **session.outcome, "status": "failed"}
            )
        except CallbackError as e:  # the run's own record stands, with the hook's failure after it
            if record is not None:
                why = f"CallbackError: {e} (after the run {record['status']}: its checkpoints and metrics are whole)"
                write(session, {**record, "status": "failed", "error": why})
                attempt.recorded = e
            raise
        if record is not None and record["status"] == "completed":
            session.dist.barrier()  # the ranks leave together: one tearing gloo down as another writes can abort
    raise failure  # out here, so the frames holding the loader's workers are freed


def _training(run: RunConfig, parts: Parts, device: torch.device, dist: Dist) -> Training:
    """What the loop trains: the model, the step (with the non-finite guard), the schedule, the batches."""
    dist.check_every = run.trainer.log_interval if dist.world_size > 1 else 1  # stop flags agreed at log steps
    step = train_step(run, parts, device, dist)  # one optimizer's, or a task's own steps (optim.optimizers)
    reset = getattr(parts.task, "reset", None)  # optional: a task that carries a state starts each epoch afresh
    return Training(parts.models.train, step, parts.scheduler, parts.loaders.train, reset if callable(reset) else None)


def _evaluator(run: RunConfig, parts: Parts) -> Evaluator:
    """The validation split's evaluator and its cadence (and the test split's, when it is
    evaluated at every evaluation)."""
    every, classes = run.trainer.eval_every, class_names(parts.data)
    if 0 < every < 1:  # a fraction of an epoch
        every = max(1, round(every * len(parts.loaders.train)))
    test = estimate = None
    if run.trainer.eval_test and parts.loaders.test is not None:
        test = Evaluator(parts.loaders.test, parts.precision, parts.task, interval=1, split="test", class_names=classes)
    if parts.loaders.train_est is not None:
        estimate = Evaluator(parts.loaders.train_est, parts.precision, parts.task, interval=1, split=names.TRAIN_EST)
    return Evaluator(
        parts.loaders.val,
        parts.precision,
        parts.task,
        interval=run.trainer.eval_interval,
        every=int(every),
        class_names=classes,
        test_evaluator=test,
        estimate_evaluator=estimate,
    )


def _observers(run: RunConfig, objects: UserObjects, dist: Dist) -> Observers:
    """The run's callbacks (configured, given to fit, the profiler when asked) and loggers."""
    callbacks = {name: build(node, f"callbacks.{name}") for name, node in run.callbacks.items()}
    if run.trainer.profile:
        callbacks["profiler"] = Profiler(wait=run.trainer.profile_wait, steps=run.trainer.profile_steps)
    loggers = {name: build(node, f"logger.{name}") for name, node in run.logger.items()}
    return Observers({**callbacks, **objects.callbacks}, {**loggers, **objects.loggers}, is_main=dist.is_main)
