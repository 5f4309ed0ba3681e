"""One trial: the starting config, or the best so far with a candidate's changes on top,
trained in this process until its steady state is measured (or until the target), and what
it measured read back from its run dir."""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hydra import compose
from omegaconf import DictConfig, open_dict

from saturate import names
from saturate import record as run_record
from saturate.config.invocation import Invocation, is_setting, key_of
from saturate.config.naming import slug
from saturate.diagnostics.report import MIN_STEPS
from saturate.loop.faults import Preempted, StopSignal, TrainingDiverged
from saturate.trainer.build import UserObjects
from saturate.trainer.run import train
from saturate.tune.options import merged
from saturate.tune.outputs import write_tensorboard

log = logging.getLogger("saturate.tune")  # one logger for the whole tune, whichever module writes a line

WARMUP_STEPS = 5  # a trial's first log window: workers starting, caches, autotuning
NEVER = 10**9  # an interval no trial reaches: evaluation and checkpoints only at its end
# What every trial adds to the command line: quiet, one process, no periodic evaluation or
# checkpoints (one of 2 batches at the end), no augmentation previews, no resume.
TRIAL = (
    "trainer.max_epochs=1000",
    "trainer.max_steps=-1",
    "trainer.progress=false",
    "trainer.log_level=WARNING",
    f"trainer.log_interval={WARMUP_STEPS}",
    f"trainer.eval_interval={NEVER}",
    f"trainer.checkpoint_interval={NEVER}",
    "trainer.limit_val_batches=2",
    "trainer.devices=1",
    "trainer.resume=null",
    "trainer.profile=false",
    "checkpoint.every_n_steps=0",
    "augmentation.preview_images=0",
    "tune.enabled=false",
)
# What a run to the target adds: the user's own epochs, evaluations and checkpoints, quiet, one process,
# stopped at the target (or at the budget's end)
TO_TARGET = (
    "trainer.progress=false",
    "trainer.log_level=WARNING",
    "trainer.devices=1",
    "trainer.resume=null",
    "trainer.profile=false",
    "augmentation.preview_images=0",
    "tune.enabled=false",
    "target.stop=true",
)


@dataclass
class Measured:
    """A trial's stop rule, as a callback: once the run's timer holds `seconds` of steady
    state (every log window after the first) over at least `steps` steps, or at `deadline` (a
    perf_counter time), ask the run to stop. Checked at log steps.

    The timed window holds no compilation: a compiled model is warmed up on the training
    batches' shapes before the first step, an epoch's short last batch included
    (saturate.components.model.compiled), and the first window, which holds the first step, is
    never timed. `rates` are the timed windows' samples/s (their spread says how far one trial
    can be trusted)."""

    seconds: float
    steps: int
    deadline: float = float("inf")
    rates: list[float] = field(default_factory=list)
    windows: int = 0  # log windows seen

    def reached(self, timer) -> bool:
        enough = timer.rest.wall_s >= self.seconds and timer.rest.steps >= self.steps
        return enough or time.perf_counter() >= self.deadline

    def on_log(self, run, metrics: dict, step: int) -> None:
        if names.SAMPLES_PER_S not in metrics:
            return
        self.windows += 1
        if self.windows > 1:  # the first window is the run's timer's warm-up too
            self.rates.append(metrics[names.SAMPLES_PER_S])
        if self.reached(run.timer):
            run.request_stop("tune: the trial's steady state is measured")


@dataclass
class Result:
    """One trial: what it changed from the starting config, and what it measured."""

    number: int
    changes: list[str]  # overrides on top of the best config so far (the start for trial 0)
    status: str = "ok"  # ok | failed | diverged | interrupted
    samples_per_s: float | None = None
    data_wait: float | None = None  # share of step time waiting for data
    gpu_util: float | None = None  # mean GPU utilisation, % (NVML), when sampled
    peak_mb: float | None = None
    verdict: str = ""
    facts: dict = field(default_factory=dict)  # what the bottleneck report judged on
    batch_size: int | None = None  # the batch size trained with (what loader.batch_size=auto chose)
    to_target_s: float | None = None  # a run to the target: when it met it (time/to_target_s), None if it did not
    final: float | None = None  # a run to the target: the target metric's last value
    seed: int | None = None  # a run to the target: its trainer.seed
    outcome: str = ""  # start | kept | slower | undecided | failed: <why> | ...
    seconds: float = 0.0  # wall time, set-up included
    rates: list[float] = field(default_factory=list)  # each timed window's samples/s (Measured)
    config: list[str] = field(default_factory=list)  # every override on top of the start: the whole candidate

    def speed(self) -> float:
        """Its samples/s: a trial that trained (status ok) has them."""
        assert self.samples_per_s is not None, f"trial {self.number} measured no samples/s ({self.status})"
        return self.samples_per_s


def fresh_compile_state() -> None:
    """Forget what torch.compile compiled in earlier trials of this process: Dynamo keeps its
    caches per code object, so after its recompile limit (8) a later trial's compiled model
    would silently run eager, and a compile trial would measure nothing it claims."""
    import sys

    if "torch._dynamo" in sys.modules:  # nothing was compiled otherwise (and importing it costs a second)
        torch.compiler.reset()


BUDGET_S = 120.0  # tune.budget_s=auto without a target: the search
TARGET_BUDGET_S = 600.0  # with one: the search, then its leading candidates and the start trained to it over seeds


def budget_s(cfg: DictConfig) -> float:
    """tune.budget_s in seconds: the user's, or auto's (BUDGET_S, TARGET_BUDGET_S with a target)."""
    if cfg.tune.budget_s != "auto":
        return float(cfg.tune.budget_s)
    return TARGET_BUDGET_S if cfg.target.metric is not None else BUDGET_S


class Trials:
    """A tune's state and its trials: the budget, the results so far, the best config's
    changes; the search (saturate.tune.search.Tuner) decides what each next trial tries."""

    def __init__(self, cfg: DictConfig, invocation: Invocation, run_dir: Path):
        """`invocation`: how the tune was started: every trial composes with its whole
        command line, Hydra's own overrides first (a user's config dir included)."""
        self.tune = cfg.tune
        self.target = cfg.target.metric is not None  # the leading candidates are then run to it
        self.target_metric = cfg.target.metric
        self.budget_s = budget_s(cfg)
        self.search_budget = self.budget_s / 2 if self.target else self.budget_s
        self.invocation = invocation
        overrides = invocation.command_line()
        self.hydra_overrides = [o for o in overrides if o.lstrip("+~").startswith("hydra.")]
        self.start_overrides = [o for o in overrides if is_setting(o)]
        self.searchpath = [o for o in overrides if o.startswith("hydra.searchpath=")]  # where the preset is found
        self.run_dir = run_dir
        self.cuda = cfg.device.type != "cpu" and torch.cuda.is_available()
        self.results: list[Result] = []
        self.changes: list[str] = []  # the best config's overrides on top of the start
        self.best: Result | None = None
        self.started = time.perf_counter()
        self.interrupted = False
        # the fastest's samples/s and its ratio to the start's: from the confirmation when it ran
        self.rate, self.speedup, self.confirmed = 0.0, 1.0, False
        # the start's and each contender's median time to the target over the seeds (None: not met at the median)
        self.to_target_s: list[float | None] | None = None
        self.seed = cfg.trainer.seed  # the first seed of the runs to the target
        self.target_runs: dict | None = None  # their seeds, and each candidate's changes, times and final figures
        self.dropped: list[str] = []  # the fastest's changes, when another (or the start) met the target sooner
        self.stop: StopSignal | None = None  # SIGINT/SIGTERM between trials (a trial's own run handles them within it)

    def remaining(self) -> float:
        """What is left of the search's budget (all of tune.budget_s, or half with a target)."""
        return self.search_budget - (time.perf_counter() - self.started)

    def stopping(self) -> bool:
        """Whether a stop signal came: to tune between two trials, or to a trial once its loop
        had stopped looking (its run hands it on as it ends). No trial starts after it, not
        even the second of a pair."""
        self.interrupted = self.interrupted or (self.stop is not None and self.stop.requested is not None)
        return self.interrupted

    def affordable(self, reserve: int = 0) -> bool:
        """Whether another trial, and `reserve` more after it, fit in what is left of the
        budget (each estimated by the median of the trials so far)."""
        done = [r.seconds for r in self.results if r.status == "ok"]
        return not self.stopping() and self.remaining() > (1 + reserve) * (statistics.median(done) if done else 0.0)

    def trial(
        self, changes: list[str], base: list[str] | None = None, until: float | None = None, seed: int | None = None
    ) -> Result:
        """Measure the best config so far (or `base`) with `changes` on top; with `until` (a
        perf_counter time), train it to the target instead, stopped there at the latest, with
        `seed` (trainer.seed) when given."""
        number, explicit = len(self.results), base is not None
        base = base if base is not None else self.changes
        result = Result(number, merged(base, changes) if explicit else changes, seed=seed, config=merged(base, changes))
        overrides = merged(self.start_overrides, base, changes, [f"trainer.seed={seed}"] if seed is not None else [])
        trial_dir = self.run_dir / "trials" / f"{number:02d}{_trial_name(result.changes, until is not None, seed)}"
        started = time.perf_counter()
        log.info(
            "tune: trial %d (%.0f s %s): %s",
            number,
            until - started if until else self.remaining(),
            "to its deadline" if until else "of the budget left",
            " ".join(result.changes) or "the starting config",
        )
        saturate_log = logging.getLogger("saturate")
        level = saturate_log.level
        fresh_compile_state()
        try:
            trial = merged(overrides, TO_TARGET if until else TRIAL, [f"run_dir={trial_dir}"])
            cfg = compose("config", overrides=[*self.hydra_overrides, *trial], return_hydra_config=True)
            invocation = dataclasses.replace(
                self.invocation,
                overrides=tuple(overrides),  # what the trial's HParams entry and run name show
                choices=dict(cfg.hydra.runtime.choices),
                varied=frozenset(key_of(o) for o in overrides),
                output_dir=str(trial_dir),
            )
            with open_dict(cfg):
                del cfg["hydra"]
            settings = _settings(cfg)
            deadline = until or self.started + self.search_budget
            measured = Measured(math.inf if until else self.tune.trial_s, MIN_STEPS, deadline)
            train(cfg, invocation, UserObjects(callbacks={"tune_measured": measured}))
            self._read(result, trial_dir, settings, measured, to_target=until is not None)
        except (KeyboardInterrupt, Preempted):
            result.status, result.outcome, self.interrupted = "interrupted", "interrupted", True
        except TrainingDiverged as e:
            result.status, result.outcome = "diverged", f"diverged: {_first_line(e)}"
        except Exception as e:  # noqa: BLE001 (a failing trial is recorded and skipped)
            result.status, result.outcome = "failed", f"failed: {type(e).__name__}: {_first_line(e)}"
            if self.cuda:
                torch.cuda.empty_cache()
        finally:
            saturate_log.setLevel(level)
            shutil.rmtree(trial_dir / "checkpoints", ignore_errors=True)  # a few seconds of training: nothing to keep
        result.seconds = time.perf_counter() - started
        if result.status in ("failed", "diverged"):
            _record(trial_dir, result)
        self.results.append(result)
        if result.status == "ok":
            speed = f"{result.samples_per_s:,.0f} samples/s, data wait {result.data_wait:.0%}, {result.verdict}"
        else:
            speed = result.outcome
        log.info("tune: trial %d: %s (%.1f s)", number, speed, result.seconds)
        return result

    def _read(self, result: Result, trial_dir: Path, settings: dict, measured: Measured, to_target: bool) -> None:
        result.rates = measured.rates
        done = run_record.load(trial_dir)  # Unreadable: the trial failed, with the reason
        if done is None:
            raise FileNotFoundError(f"the trial left no {run_record.path(trial_dir)}")
        m = done.entries
        result.samples_per_s, result.data_wait = m[names.SAMPLES_PER_S], m[names.DATA_WAIT_FRAC]
        result.gpu_util, result.peak_mb = m.get(names.GPU_UTIL_MEAN), m.get(names.PEAK_MB)
        settings["threads"] = torch.get_num_threads()  # what the trial's device.threads came to
        result.verdict, result.facts, result.batch_size = m["verdict"], {**m["facts"], **settings}, m["batch_size"]
        result.to_target_s = m.get(names.TO_TARGET_S)
        final = m.get(self.target_metric) if self.target_metric else None
        result.final = final if isinstance(final, (int, float)) and math.isfinite(final) else None
        if not math.isfinite(m.get(names.TRAIN_LOSS, 0.0)):
            result.status, result.outcome = "diverged", "diverged: the training loss is not finite"
        elif not (result.rates or to_target):  # stopped by the budget before a timed window: its figure is start-up
            result.status = "failed"
            result.outcome = "failed: no steady state before the budget ran out (compilation, start-up)"

    def better(self, result: Result, than: Result) -> bool:
        return result.status == "ok" and result.speed() > than.speed() * (1 + self.tune.min_gain)


def _settings(cfg: DictConfig) -> dict:
    """What a trial's facts add to its report's: whether compile can build kernels here, and
    the settings the compute side's candidates start from."""
    return {
        "cxx": shutil.which("c++") is not None or shutil.which("g++") is not None,
        "prefetch_factor": cfg.loader.prefetch_factor,
        "tf32": cfg.device.tf32,
        "cudnn": cfg.device.cudnn_benchmark,
    }


def _trial_name(changes: list[str], to_target: bool = False, seed: int | None = None) -> str:
    name = f"_{slug(changes) or 'start'}" + ("_to_target" if to_target else "")
    return name + (f"_seed{seed}" if seed is not None else "")


def _record(trial_dir: Path, result: Result) -> None:
    """A trial that did not train to the end still gets its row in TensorBoard's HParams
    tab: its overrides and what happened (a trained trial's run logs its own)."""
    params = {"overrides": " ".join(result.changes), "tune.outcome": result.outcome}
    write_tensorboard(trial_dir, lambda tb, run: tb.on_hparams(run, params, {names.TUNE_FAILED: 1.0}, []))


def _first_line(error: BaseException, limit: int = 200) -> str:
    """The start of an error's message (its first clause), for a table cell."""
    text = str(error).strip().splitlines()[0].split("; ")[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."
