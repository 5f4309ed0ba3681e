"""What a run leaves behind once it has trained: the final metrics (the loop's summary, the
test set evaluated with best.pt, the step's costs), the bottleneck report, the HParams entry,
the predictions asked for, and metrics.json."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from omegaconf import OmegaConf

from saturate import names
from saturate import record as run_record
from saturate.callbacks import Observers, Run
from saturate.checkpoint.files import load
from saturate.components.device import untouched_rng
from saturate.components.model import first_samples, takes_advice
from saturate.components.precision import emulated
from saturate.config.invocation import Invocation
from saturate.config.schema import RunConfig
from saturate.config.secrets import masked
from saturate.data import Data
from saturate.data.loader import build_pipeline, cpus_per_process
from saturate.diagnostics.costs import (
    COST_SAMPLES,
    PROBE_FLOOR_S,
    PROBE_SHARE,
    Budget,
    batch_size,
    scaling,
    step_cost,
)
from saturate.diagnostics.monitor import device_memory_mb
from saturate.diagnostics.report import RunFacts, diagnose, render
from saturate.diagnostics.timing import Startup
from saturate.diagnostics.tracking import Tracker, hparams_columns, plain, review_hint
from saturate.files import write_text
from saturate.loop.engine import Engine, Summary, TrainState
from saturate.loop.evaluate import Evaluator
from saturate.record import RunRecord
from saturate.scale.distributed import Dist
from saturate.trainer.build import Parts, UserObjects, host_batch

log = logging.getLogger("saturate")


class Metrics(dict):
    """The final metrics. `float()` of it is the run's figure of merit (`checkpoint.monitor`:
    val/acc for classification, val/loss for regression, unless set), which is what
    sweepers that optimise one number (Optuna) read from train.py's return."""

    objective: str = "val/acc"

    def __float__(self) -> float:
        return float(self[self.objective])


@dataclass
class Session:
    """One run's built objects, for the steps that drive and record it."""

    config: RunConfig
    invocation: Invocation
    parts: Parts
    engine: Engine
    view: Run  # what the callbacks see
    tracker: Tracker
    observers: Observers
    dist: Dist
    device: torch.device
    outcome: dict  # how the run was set up, for its record
    start_time: float
    startup: Startup  # where the time to the first step went


def write(session: Session, record: dict) -> None:
    if session.dist.is_main:
        run_record.write(session.config.run_dir, RunRecord(masked(record)))


def finish(session: Session, summary: Summary) -> Metrics:
    """The final metrics (the loop's summary, the test set with best.pt, the step's costs),
    the report, the HParams entry and metrics.json."""
    metrics = {**summary.metrics(), **session.parts.spec.notes, **costs(session, summary.steady)}
    metrics.update(evaluate_test_split(session))
    metrics[names.WALL_S] = time.perf_counter() - session.start_time
    metrics.update(session.startup.metrics(session.engine.timer.first_step_at))
    if session.dist.world_size > 1:  # every rank must end with the same weights
        metrics[names.PARAMS_IDENTICAL] = float(session.dist.params_identical(session.parts.models.raw))
    stopped = {"stopped_early": session.view.stop_reason} if session.view.stop_reason else {}
    if session.dist.is_main:
        record(session, summary, metrics, stopped)
    _say_done(session, metrics)
    result = Metrics({**metrics, **stopped})
    result.objective = session.outcome["monitor"]
    return result


def record(session: Session, summary: Summary, metrics: dict, stopped: dict) -> None:
    """Rank 0: the report, the HParams entry and metrics.json."""
    parts, monitor = session.parts, session.outcome["monitor"]
    verdict, facts = report(session, metrics, steps=summary.steady_steps, gpu=summary.gpu)
    compared = [
        monitor,
        *(f"val/{n}" for n in parts.task.names()),
        names.VAL_LOSS,
        names.TRAIN_LOSS,
        *(k for k in metrics if k.startswith("test/")),
        names.SAMPLES_PER_S,
        names.DATA_WAIT_FRAC,
        names.PEAK_MB,
        *([names.GPU_UTIL_MEAN] if names.GPU_UTIL_MEAN in metrics else []),
        *([names.TO_TARGET_S] if names.TO_TARGET_S in metrics else []),
    ]
    ran = {
        "model": type(parts.models.raw).__name__,
        "data": parts.spec.name,
        "task": task_name(parts.task),
        "precision": parts.precision.name,
        "loader.batch_size": parts.batch_size,
        "loader.num_workers": parts.loaders.train.num_workers,
        "loader.resident": parts.loaders.resident,
    }
    columns = hparams_columns(session.config, session.invocation, ran)
    compared = list(dict.fromkeys(compared))
    session.tracker.hparams(
        columns, metrics, step=session.view.step, varied=session.invocation.varied, compared=compared
    )
    used = {
        "batch_size": parts.batch_size,
        "num_workers": ran["loader.num_workers"],
        "world_size": session.dist.world_size,
    }
    best_at = summary.best_at or (None, None)
    best = {"best": {"metric": monitor, "value": summary.best, "epoch": best_at[0], "step": best_at[1]}}
    advice = {"verdict": verdict.kind, "suggestions": [override for override, _ in verdict.suggestions], "facts": facts}
    record = {**metrics, **session.outcome, **used, **best, **stopped, "status": "completed", **advice}
    run_record.write(session.config.run_dir, RunRecord(masked(record)))


def _say_done(session: Session, metrics: dict) -> None:
    """The run's last lines: its figures, and how to review it in TensorBoard."""
    monitor = session.outcome["monitor"]
    shown = [k for k in (monitor, names.VAL_LOSS, names.TRAIN_LOSS) if k in metrics]
    log.info(
        "done in %.1fs: %s, %.0f samples/s, data wait %.0f%%, peak memory %.0f MB -> %s",
        metrics[names.WALL_S],
        ", ".join(f"{k} {metrics[k]:.4f}" for k in dict.fromkeys(shown)),
        metrics[names.SAMPLES_PER_S],
        100 * metrics[names.DATA_WAIT_FRAC],
        metrics[names.PEAK_MB],
        session.config.run_dir,
    )
    run_dir = Path(session.config.run_dir)
    if session.dist.is_main and any(p for d in (run_dir, run_dir / "tb") for p in d.glob("events.out.tfevents.*")):
        watched = [monitor, *(f"val/{n}" for n in session.parts.task.names())]
        log.info("review: %s", review_hint(run_dir, watched, metrics, session.invocation.sweep_dir))


def evaluate_test_split(session: Session) -> dict[str, float]:
    """The test split (when the data has one) evaluated once with best.pt's weights (the
    final ones when no best.pt was written), and trainer.predict's predictions."""
    parts, predict = session.parts, session.config.trainer.predict
    loaders = {"val": parts.loaders.val, "test": parts.loaders.test}
    if loaders["test"] is None and predict is None:
        return {}
    model = session.view.eval_model
    best = Path(session.config.run_dir) / "checkpoints" / "best.pt"
    session.dist.barrier()  # rank 0 has written best.pt
    if best.is_file():
        model = copy.deepcopy(model)
        model.load_state_dict(load(best)["model"])
    out: dict[str, float] = {}
    for split, batches in loaders.items():
        if batches is None or (split == "val" and predict != "val"):
            continue
        evaluator = Evaluator(
            batches, parts.precision, parts.task, interval=1, split=split, class_names=class_names(parts.data)
        )
        results = evaluator.run(model, predict=predict == split)
        assert results is not None  # None only where an interrupt is watched
        if split == "test":
            out.update(results)
            session.tracker.log(results, session.view.step)
            session.tracker.matrices(evaluator.matrices, session.view.step, evaluator.class_names)
        if predict == split:
            evaluator.write_predictions(Path(session.config.run_dir) / "predictions" / f"{split}.npz", session.dist)
    return out


def class_names(data: Data) -> list[str] | None:
    """The training split's class names, where it has them (an image folder's)."""
    names = getattr(data.train, "classes", None)
    return [str(n) for n in names] if isinstance(names, (list, tuple)) else None


def already_done(run: RunConfig, state: TrainState, saved: dict, writes: bool, monitor: str) -> Metrics:
    """A finished run resumed: nothing to train; the metrics saved with its checkpoint."""
    log.warning(
        "trainer.resume: the checkpoint is at epoch %d, step %d, already at trainer.max_epochs=%d / "
        "trainer.max_steps=%d: "
        "nothing to train (raise them to train on)",
        state.epoch,
        state.step,
        run.trainer.max_epochs,
        run.trainer.max_steps,
    )
    metrics = Metrics(saved)
    metrics.objective = monitor
    if not run_record.path(run.run_dir).is_file() and writes:  # resumed into a new run dir: say what happened there
        note = "resumed a finished run; nothing was trained"
        run_record.write(run.run_dir, RunRecord({**metrics, "status": "completed", "note": note}))
    return metrics


def _target_note(session: Session, metrics: dict) -> str | None:
    """When the run met target.metric's value, beside when its first step ended; or that it did not."""
    target = session.engine.limits.target
    if target is None:
        return None
    if target.reached_s is None:
        last = metrics.get(target.metric)
        return f"target {target}: not met" + (f" (last {last:.4f})" if last is not None else "")
    first = metrics.get(names.FIRST_STEP_S)
    since = f"; the first step ended at {first:.1f} s" if first is not None else ""
    return f"target {target}: met {target.reached_s:.1f} s after the start (step {target.reached_step}{since})"


def costs(session: Session, steady: dict) -> dict:
    """FLOPs, MFU and launches of the steady-state step (saturate.diagnostics.costs), when counted
    within PROBE_SHARE of the training loop's time, PROBE_FLOOR_S at least (what did not fit:
    cost/probes_skipped)."""
    if names.STEP_MS not in steady:
        return {}
    started = time.perf_counter()
    budget = Budget(max(PROBE_SHARE * session.engine.clock.metrics().get(names.LOOP_S, 0.0), PROBE_FLOOR_S))
    try:
        cost, fixed = step_costs(session.config, session.parts, session.device, budget, steady.get(names.COMPUTE_MS))
    except Exception as e:  # noqa: BLE001 (after training, for the report only: a run that trained is not lost to it)
        log.warning("costs: not counted after training (%s: %s)", type(e).__name__, str(e)[:200])
        return {}
    skipped = {names.PROBES_SKIPPED: ", ".join(budget.skipped)} if budget.skipped else {}
    if cost is None:
        return {**skipped, names.COST_PROBE_S: time.perf_counter() - started} if skipped else {}
    name = torch.cuda.get_device_name(session.device) if session.device.type == "cuda" else None
    dtype = session.parts.precision.name
    if dtype == "fp32" and session.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    figures = cost.figures(steady[names.STEP_MS] / 1000, name, dtype, fixed, steady.get(names.COMPUTE_MS, 0.0) / 1000)
    probes = {names.COST_DEVICE: session.device.type, names.COST_PROBE_S: time.perf_counter() - started}
    return {**figures, **probes, **skipped}


def _advice(run, parts: Parts, device: torch.device) -> tuple[bool, bool]:
    """Whether the model takes channels_last and autocast (the report's and tune's advice)."""
    try:
        return advice_checks(run, parts, device)
    except Exception as e:  # noqa: BLE001 (advice only: without the check, none that could break the model)
        log.warning("report: the model's layout and autocast not checked (%s: %s)", type(e).__name__, str(e)[:200])
        return False, False


def _cpu_facts(metrics: dict, cpus: int, cores: int) -> dict:
    """The report's CPU facts over the steady state: the run's processes' share of its CPUs, the
    host's and other processes' load, torch's threads and the main process's CPU seconds per second
    of wall time (the run's share of the host's cores less its workers', each % of one core)."""
    run = metrics.get(names.RUN_UTIL_MEAN)
    workers = metrics.get(names.WORKERS_UTIL_MEAN)
    return {
        "cpu_util": min(100.0, run * cores / cpus) if run is not None else None,
        "host_cpu": metrics.get(names.CPU_UTIL_MEAN),
        "other_cpu": metrics.get(names.OTHER_UTIL_MEAN),
        "cores": cores,
        "workers_cpu": workers,
        "threads": torch.get_num_threads(),
        "run_cores": max(0.0, run * cores / 100 - (workers or 0.0) / 100) if run is not None else None,
    }


def report(session: Session, metrics: dict, *, steps: int, gpu) -> tuple[Any, dict]:
    """The bottleneck report: to the console, report.md and TensorBoard. Returns the
    verdict and the facts it was judged on (for metrics.json: saturate.tune reads them)."""
    run, parts, device = session.config, session.parts, session.device
    cpus, cores = cpus_per_process(), psutil.cpu_count() or 1
    loop = metrics.get(names.LOOP_S) or 0.0
    shares = (
        {n: metrics.get(f"time/{n}_s", 0.0) / loop for n in ("evaluation", "checkpoint", "logging")} if loop > 0 else {}
    )
    launch = metrics.get(names.LAUNCH_BOUND_FRAC) if device.type == "cuda" else metrics.get(names.FIXED_FRAC)
    layout_ok, amp_ok = _advice(run, parts, device)
    facts = RunFacts(
        device=device.type,
        batch_size=parts.batch_size,
        num_workers=parts.loaders.train.num_workers,
        cpus=cpus,
        resident=parts.loaders.resident,
        in_memory=parts.spec.in_memory,
        image=parts.spec.image,
        **_cpu_facts(metrics, cpus, cores),
        loop_shares=shares,
        launch_frac=launch,
        launches=int(metrics[names.LAUNCHES_PER_STEP]) if names.LAUNCHES_PER_STEP in metrics else None,
        placement=run.augmentation.placement,
        persistent_workers=run.loader.persistent_workers,
        pin_memory=run.loader.pin_memory is True or (run.loader.pin_memory == "auto" and device.type == "cuda"),
        precision=parts.precision.name,
        compile=run.trainer.compile,
        channels_last=run.trainer.channels_last,
        channels_last_ok=layout_ok,
        amp_ok=amp_ok,
        memory_headroom=metrics[names.PEAK_MB] < 0.5 * device_memory_mb(device),
        emulated_precision=emulated(parts.precision.name, device),
        cpu_bf16=device.type == "cpu" and not emulated("bf16", device),
    )
    verdict = diagnose(metrics, facts, steps=steps)
    text = render(
        metrics,
        verdict,
        steps=steps,
        gpu=gpu,
        facts=facts,
        stopped=session.view.stop_reason,
        notes=[parts.loaders.workers_note, _target_note(session, metrics)],
    )
    text = masked(text)
    write_text(Path(run.run_dir) / "report.md", text)  # a link planted there is replaced, never written through
    session.tracker.text("bottleneck_report", text)  # TensorBoard sorts text by tag: the report before the config
    # one line per sweep job; the report is in its dir
    if session.invocation.multirun:
        log.info("verdict: %s (%s); the report: %s", verdict.kind, verdict.reason, Path(run.run_dir) / "report.md")
    else:
        log.info("\n%s", text)
    return verdict, dataclasses.asdict(facts)


def task_name(task) -> str:
    return getattr(task, "name", type(task).__name__)


def recorded_config(run: RunConfig, parts: Parts, objects: UserObjects) -> dict:
    """The config as checkpoints record it: resolved, the model and task nodes as built
    (the data's values bound); objects fit was given are named."""
    resolved = plain(run)
    resolved.update(parts.nodes)
    for key, obj in (("model", objects.model), ("data", objects.data), ("task", objects.task)):
        if obj is not None:
            resolved[key] = {"object": f"{type(obj).__module__}.{type(obj).__qualname__}"}
    return masked(resolved)  # a value read from the environment is recorded as the ${oc.env:...} that read it


def start_records(
    run: RunConfig, invocation: Invocation, parts: Parts, tracker: Tracker, config: dict, env: dict, dist: Dist
) -> None:
    """What TensorBoard shows from the start: the overview charts, the config as run, the
    fingerprint, the batch-size search's trials."""
    from saturate.components.batch_size import table

    # Time Series orders groups by name (cpu/ before train/); this tab opens on what matters
    tracker.layout(
        {
            "loss": [names.TRAIN_LOSS, names.VAL_LOSS],
            "validation": [f"val/{n}" for n in parts.task.names()],
            "samples/s": [names.SAMPLES_PER_S],
            "data wait (fraction of each step)": [names.DATA_WAIT_FRAC],
            "utilisation %": [names.GPU_UTIL, names.CPU_UTIL],
        }
    )
    settings = invocation.settings()
    head = f"**Overrides:** `{' '.join(settings)}`" if settings else "**Overrides:** none (the defaults)"
    if run.augmentation.placement == "none":  # the schema's preset default would read as if it ran
        head += "\n\nNothing is augmented (augmentation.placement=none): `augmentation.preset` below is not used."
    tracker.text("config", f"{head}\n\n```yaml\n{OmegaConf.to_yaml(config)}```")
    tracker.text("fingerprint", "```yaml\n" + OmegaConf.to_yaml(env) + "```")
    if parts.trials is not None:
        tracker.text("batch_search", table(parts.trials, parts.batch_size))
        for t in parts.trials:
            tracker.log({names.BATCH_SEARCH_SAMPLES_PER_S: t.samples_per_s or 0.0}, step=t.size)
    ranks = ""
    if dist.world_size > 1:
        ranks = f", {dist.world_size} ranks: global batch {parts.batch_size * dist.world_size}"
    data = parts.spec.name + (" (SYNTHETIC)" if parts.spec.synthetic else "")
    log.info(
        "training %s on %s: %d steps (%d per epoch), batch %d per device%s",
        type(parts.models.raw).__name__,
        data,
        parts.total_steps,
        len(parts.loaders.train),
        parts.batch_size,
        ranks,
    )


def abandon(session: Session, state: TrainState, signum: int) -> None:
    """A hook swallowed the interrupt that abandons it after a stop signal: the loop will not
    get control back, so save at the last completed step and record the stop from here, then
    end the process with the signal's status."""
    try:
        session.engine.checkpointer.save(state, {}, session.engine.run)
        hint = session.engine.limits.resume_hint
        log.warning("saved %s; resume with: %s", session.engine.checkpointer.last_path, hint)
        stopped = {"status": "preempted", "stopped_by": signal.Signals(signum).name, "resume_with": hint}
        write(session, {**session.tracker.latest, **session.outcome, **stopped})
    finally:
        logging.shutdown()
        os._exit(128 + signum)


def setup_record(parts: Parts, monitor: str, started_at: str, overrides: list[str], env: dict) -> dict:
    """What metrics.json records of how the run was set up."""
    outcome = {
        "data": parts.spec.name,
        "synthetic": parts.spec.synthetic,
        "precision": parts.precision.name,
        "task": task_name(parts.task),
        "monitor": monitor,
        "started_at": started_at,
        "overrides": overrides,
        "fingerprint": env,
    }
    if parts.trials is not None:  # loader.batch_size=auto: what was tried, and how long it took
        outcome["batch_search"] = {"seconds": parts.search_s, "trials": [dataclasses.asdict(t) for t in parts.trials]}
    return outcome


def step_costs(
    run: RunConfig, parts: Parts, device: torch.device, budget: Budget | None = None, compute_ms: float | None = None
):
    """A step's FLOPs and launches, and its batch scaling (saturate.diagnostics.costs), or (None,
    None). Counted after training, for the report: off the way to the first step (the count
    needs no trained weights, and the timings are steadier with warm caches). Within `budget`:
    the count is skipped when the step's measured compute (`compute_ms`), scaled to the probe's
    samples, does not fit; the scaling's passes are estimated from the count's time."""
    if not run.monitor.costs:
        return None, None
    task, precision, model = parts.task, parts.precision, parts.models.raw
    # counted on up to COST_SAMPLES real samples, scaled to the step's samples (conv and matmul FLOPs
    # are linear in it); the probes run the user's model and task: they draw nothing the run sees
    with untouched_rng(task):
        counted = probe_batch(run, parts, device, COST_SAMPLES)
        per_step = parts.batch_size * batch_size(host_batch(parts.data, range(1)))  # an item may be a whole batch
        guess = (compute_ms or 0.0) / 1000 * min(1.0, batch_size(counted) / per_step)
        if budget is not None and not budget.fits(guess, "the FLOP count"):
            return None, None
        start = budget.clock() if budget is not None else 0.0
        cost = step_cost(model, counted, task, precision, batch=per_step)
        guess = budget.clock() - start if budget is not None else 0.0
        return cost, scaling(model, counted, task, precision, device, budget, guess)


def probe_batch(run: RunConfig, parts: Parts, device: torch.device, size: int):
    """Up to `size` real training samples on the device, as a step gets them (for the probes
    after training). Counted in samples: no more data-set items than a step's batch holds (an
    item may be a whole batch), the result cut to `size` samples along the batch dimension."""
    with untouched_rng():
        items = min(len(parts.data.train), size, parts.batch_size)
        samples = first_samples(host_batch(parts.data, range(items)), size)
        return build_pipeline(run.loader, parts.spec, device, run.trainer)(samples)


def advice_checks(run: RunConfig, parts: Parts, device: torch.device) -> tuple[bool, bool]:
    """(channels_last_ok, amp_ok) of the trained model, for the report and tune
    (saturate.components.model.takes_advice)."""
    batch = probe_batch(run, parts, device, 2)
    image = parts.spec.image
    return takes_advice(
        parts.models.raw, batch, parts.task, parts.precision, image=image, trainer=run.trainer, device=device
    )
