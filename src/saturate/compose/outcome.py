"""What a run leaves behind once it has trained: the final metrics (the steady state, the
test set evaluated with best.pt, the resources), the bottleneck report, the HParams entry,
the predictions asked for, and metrics.json."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from saturate.callbacks import Observers, Run
from saturate.compose.build import Parts
from saturate.config.naming import varied_keys
from saturate.config.schema import RunConfig
from saturate.data.loader import cpus_per_process
from saturate.loop.engine import Engine, TrainState
from saturate.loop.evaluate import Evaluator
from saturate.observe.monitor import device_memory_mb
from saturate.observe.report import RunFacts, diagnose, render
from saturate.observe.tracking import Tracker, swept
from saturate.parts.checkpoint import Checkpointer, load
from saturate.parts.precision import emulated
from saturate.parts.rundir import write_json
from saturate.scale.distributed import Dist

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

    cfg: RunConfig
    parts: Parts
    engine: Engine
    run: Run
    tracker: Tracker
    observers: Observers
    checkpointer: Checkpointer
    dist: Dist
    device: torch.device
    outcome: dict
    start_time: float


def write(s: Session, record: dict) -> None:
    if s.dist.is_main:
        write_json(Path(s.cfg.run_dir) / "metrics.json", record)


def finish(s: Session, last: dict) -> Metrics:
    """The final metrics (the steady state, the test set with best.pt, the resources), the
    report, the HParams entry and metrics.json."""
    d, parts, engine = s.dist, s.parts, s.engine
    for batches in (parts.loaders.train, parts.loaders.val):  # what every rank skipped, now that all are done
        if getattr(batches, "poll", None) is not None:
            batches.poll()
    gpu, cpu = engine.watch.monitor.gpu_summary(), engine.watch.monitor.cpu_summary()
    steady = d.mean(engine.timer.run_window().metrics(), sum_keys=("perf/samples_per_s",))
    metrics = {
        **last,
        **engine.counts(),
        **steady,
        **parts.spec.notes,
        **(gpu or {}),
        **cpu,
        **engine.clock.metrics(),
        **costs(s, steady),
        **tested(s),
    }
    metrics["time/wall_s"] = time.perf_counter() - s.start_time
    if d.world_size > 1:  # every rank must end with the same weights
        metrics["distributed/params_identical"] = float(d.params_identical(parts.models.raw))
    stopped = {"stopped_early": s.run.stop_reason} if s.run.stop_reason else {}
    if d.is_main:
        steps = engine.timer.run_window().steps
        verdict, facts = report(s, metrics, steps=steps, gpu=gpu)
        monitor = s.outcome["monitor"]
        tested_keys = [k for k in metrics if k.startswith("test/")]
        compared = [monitor, *(f"val/{n}" for n in parts.task.names()), "val/loss", "train/loss", *tested_keys, "perf/samples_per_s",
                    "perf/data_wait_frac", "memory/peak_mb", *(["gpu/util_mean"] if "gpu/util_mean" in metrics else [])]  # fmt: skip
        s.tracker.hparams(hparams(s), metrics, step=s.run.step, varied=varied_keys(), compared=list(dict.fromkeys(compared)))
        used = {"batch_size": s.cfg.loader.batch_size, "num_workers": parts.loaders.train.num_workers, "world_size": d.world_size}
        best_at = s.checkpointer.best_at or (None, None)
        best = {"best": {"metric": monitor, "value": s.checkpointer.best, "epoch": best_at[0], "step": best_at[1]}}
        advice = {"verdict": verdict.kind, "suggestions": [override for override, _ in verdict.suggestions], "facts": facts}
        write_json(Path(s.cfg.run_dir) / "metrics.json", {**metrics, **s.outcome, **used, **best, **stopped, "status": "completed",
                                                          **advice})  # fmt: skip
    shown = [k for k in (s.outcome["monitor"], "val/loss", "train/loss") if k in metrics]
    log.info("done in %.1fs: %s, %.0f samples/s, data wait %.0f%%, peak memory %.0f MB -> %s", metrics["time/wall_s"],
             ", ".join(f"{k} {metrics[k]:.4f}" for k in dict.fromkeys(shown)), metrics["perf/samples_per_s"],
             100 * metrics["perf/data_wait_frac"], metrics["memory/peak_mb"], s.cfg.run_dir)  # fmt: skip
    if d.is_main and (Path(s.cfg.run_dir) / "tb").is_dir():
        log.info("review: %s", review_hint(Path(s.cfg.run_dir), [s.outcome["monitor"], *(f"val/{n}" for n in parts.task.names())],
                                           metrics))  # fmt: skip
    result = Metrics({**metrics, **stopped})
    result.objective = s.outcome["monitor"]
    return result


def tested(s: Session) -> dict[str, float]:
    """The test split (when the data has one) evaluated once with best.pt's weights (the
    final ones when no best.pt was written), and trainer.predict's predictions."""
    parts, predict = s.parts, s.cfg.trainer.predict
    loaders = {"val": parts.loaders.val, "test": parts.loaders.test}
    if loaders["test"] is None and predict is None:
        return {}
    model = s.run.eval_model
    best = Path(s.cfg.run_dir) / "checkpoints" / "best.pt"
    s.dist.barrier()  # rank 0 has written best.pt
    if best.is_file():
        model = copy.deepcopy(model)
        model.load_state_dict(load(best)["model"])
    out = {}
    for split, batches in loaders.items():
        if batches is None or (split == "val" and predict != "val"):
            continue
        evaluator = Evaluator(batches, parts.precision, parts.task, interval=1, split=split, class_names=class_names(parts))
        results = evaluator.run(model, predict=predict == split)
        if split == "test":
            out.update(results)
            s.tracker.log(results, s.run.step)
            s.tracker.matrices(evaluator.matrices, s.run.step, evaluator.class_names)
        if predict == split:
            evaluator.write_predictions(Path(s.cfg.run_dir) / "predictions" / f"{split}.npz", s.dist)
    return out


def class_names(parts: Parts) -> list[str] | None:
    names = getattr(parts.data.train, "classes", None)
    return [str(n) for n in names] if isinstance(names, (list, tuple)) else None


def already_done(run: RunConfig, state: TrainState, checkpointer: Checkpointer, monitor: str) -> Metrics:
    log.warning("trainer.resume: the checkpoint is at epoch %d, step %d, already at trainer.max_epochs=%d / trainer.max_steps=%d: "
                "nothing to train (raise them to train on)",
                state.epoch, state.step, run.trainer.max_epochs, run.trainer.max_steps)  # fmt: skip
    metrics = Metrics(checkpointer.resumed_metrics)
    metrics.objective = monitor
    target = Path(run.run_dir) / "metrics.json"
    if not target.is_file() and checkpointer.enabled:  # resumed into a new run dir: say what happened there
        write_json(target, {**metrics, "status": "completed", "note": "resumed a finished run; nothing was trained"})
    return metrics


def costs(s: Session, steady: dict) -> dict:
    """FLOPs, MFU and launches of the steady-state step (saturate.observe.costs), when counted."""
    cost = s.parts.cost
    if cost is None or "perf/step_ms" not in steady:
        return {}
    name = torch.cuda.get_device_name(s.device) if s.device.type == "cuda" else None
    dtype = s.parts.precision.name
    if dtype == "fp32" and s.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    figures = cost.figures(steady["perf/step_ms"] / 1000, name, dtype, s.parts.scaling, steady.get("perf/compute_ms", 0.0) / 1000)
    return {**figures, "cost/device": s.device.type}


def report(s: Session, metrics: dict, *, steps: int, gpu) -> tuple[Any, dict]:
    """The bottleneck report: to the console, report.md and TensorBoard. Returns the
    verdict and the facts it was judged on (for metrics.json: saturate.tune reads them)."""
    run, parts, device = s.cfg, s.parts, s.device
    cpus, cores = cpus_per_process(), psutil.cpu_count() or 1
    run_cpu = metrics.get("cpu/run_util_mean")
    loop = metrics.get("time/loop_s") or 0.0
    shares = {n: metrics.get(f"time/{n}_s", 0.0) / loop for n in ("evaluation", "checkpoint", "logging")} if loop > 0 else {}
    launch = metrics.get("perf/launch_bound_frac") if device.type == "cuda" else metrics.get("cost/fixed_frac")
    facts = RunFacts(
        device=device.type, batch_size=run.loader.batch_size, num_workers=parts.loaders.train.num_workers, cpus=cpus,
        resident=run.loader.resident, in_memory=parts.spec.in_memory, image=parts.spec.image,
        cpu_util=min(100.0, run_cpu * cores / cpus) if run_cpu is not None else None, host_cpu=metrics.get("cpu/util_mean"),
        other_cpu=metrics.get("cpu/other_util_mean"), cores=cores, loop_shares=shares, launch_frac=launch,
        workers_cpu=metrics.get("cpu/workers_util_mean"),
        launches=int(metrics["cost/launches_per_step"]) if "cost/launches_per_step" in metrics else None,
        placement=run.augmentation.placement, persistent_workers=run.loader.persistent_workers,
        pin_memory=run.loader.pin_memory is True or (run.loader.pin_memory == "auto" and device.type == "cuda"),
        precision=parts.precision.name, compile=run.trainer.compile, channels_last=run.trainer.channels_last,
        memory_headroom=metrics["memory/peak_mb"] < 0.5 * device_memory_mb(device),
        emulated_precision=emulated(parts.precision.name, device),
    )  # fmt: skip
    verdict = diagnose(metrics, facts, steps=steps)
    text = render(metrics, verdict, steps=steps, gpu=gpu, facts=facts, stopped=s.run.stop_reason, notes=[parts.loaders.workers_note])
    (Path(run.run_dir) / "report.md").write_text(text)
    s.tracker.text("bottleneck_report", text)  # TensorBoard sorts text by tag: the report before the config
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:  # one line per sweep job; the report is in its dir
        log.info("verdict: %s (%s); the report: %s", verdict.kind, verdict.reason, Path(run.run_dir) / "report.md")
    else:
        log.info("\n%s", text)
    return verdict, dataclasses.asdict(facts)


def review_hint(run_dir: Path, watched: list[str], metrics: dict) -> str:
    """The TensorBoard command for this run's logdir (the `outputs` folder above it, which
    `tensorboard --logdir outputs` shows) and a link to Time Series with the learning curves
    pinned first (its groups are ordered by name: cpu/ before train/), unsmoothed for a run of
    few evaluations (the default smoothing, 0.6, draws their last value far from the real one)."""
    import urllib.parse

    parts_of = run_dir.parts
    logdir = Path(*parts_of[: len(parts_of) - parts_of[::-1].index("outputs")]) if "outputs" in parts_of else run_dir
    if logdir.is_absolute() and logdir.is_relative_to(Path.cwd()):  # as the user would type it, from where they ran
        logdir = logdir.relative_to(Path.cwd())
    pinned = [t for t in dict.fromkeys(["train/loss", "val/loss", *watched]) if t in metrics]
    query = {"pinnedCards": json.dumps([{"plugin": "scalars", "tag": t} for t in pinned], separators=(",", ":"))}
    short = metrics.get("progress/epoch", 0) < 20
    if short:
        query["smoothing"] = "0"
    return (
        f"tensorboard --logdir {logdir}, then http://localhost:6006/?{urllib.parse.urlencode(query)}#timeseries (loss and "
        f"metrics pinned first{', unsmoothed: a short run' if short else ''}; the Custom Scalars tab is the overview)"
    )


def settings_given(overrides: list[str]) -> list[str]:
    """The overrides that set the run, where it writes (hydra.*, run_dir) left out."""
    return [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "run_dir="))]


def identity(overrides: list[str], varied: set[str]) -> str:
    """A run's overrides as one line, what its sweep varies first: the HParams `overrides`
    column, a run's identity at a glance (the Trial ID is its path, which starts with a date
    and is cut there)."""
    given = settings_given(overrides)
    first = [o for o in given if o.lstrip("+~").partition("=")[0] in varied]
    return " ".join([*first, *(o for o in given if o not in first)]) or "(none)"


def settings(run) -> dict:
    """Every setting of the run as `group.key`: scalars as they are, lists as their text, so
    that each run holds a value for any key another run varies (TensorBoard's parallel
    coordinates leave out a run that lacks one; a plain run lacked the width a sweep varied)."""
    from omegaconf import OmegaConf

    out: dict = {}

    def walk(key: str, node) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                walk(f"{key}.{name}", value)
        else:
            out[key] = json.dumps(node) if isinstance(node, (list, tuple)) or node is None else node

    for group, node in OmegaConf.to_container(OmegaConf.structured(run), resolve=True).items():
        if group not in ("run_dir", "tune", "hydra"):
            walk(group, node)
    return out


def hparams(s: Session) -> dict:
    """The columns of this run in TensorBoard's HParams tab: its overrides on one line, every
    setting, and what ran where the config left a choice (workers, the preset, the optimizer)."""
    run, parts = s.cfg, s.parts
    aug = run.augmentation
    preset = "+".join(x.preset for x in aug.schedule) or aug.preset
    preset = "none" if aug.placement == "none" else ("transforms" if aug.transforms else preset)
    return {
        "overrides": identity(s.outcome["overrides"], varied_keys()), **settings(run),
        **swept(run), "model": type(parts.models.raw).__name__, "data": parts.spec.name, "task": task_name(parts.task),
        "precision": parts.precision.name, "loader.batch_size": run.loader.batch_size,
        "loader.num_workers": parts.loaders.train.num_workers, "augmentation": aug.placement, "augmentation.preset": preset,
        "optim": run.optim.optimizer["_target_"].rsplit(".", 1)[-1], "optim.lr": run.optim.optimizer.get("lr", float("nan")),
        "trainer.compile": run.trainer.compile, "trainer.channels_last": run.trainer.channels_last,
    }  # fmt: skip


def task_name(task) -> str:
    return getattr(task, "name", type(task).__name__)
