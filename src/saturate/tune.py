"""`saturate train tune=true [overrides]` (python train.py in the checkout): saturate applies its own advice.

Starting from the user's config, short trials are measured one after another in this
process: each is a real run (`saturate.train`) in `<run dir>/trials/`, stopped once it has
`tune.trial_s` seconds of steady state (every log window after the first) over at least
report.MIN_STEPS steps. The best trial's verdict picks what is tried next, one setting
(a "dimension") at a time, greedily:

- input-bound (or CPU-saturated), balanced, not judged: the input side first (augmentation
  on the device, the data resident, loader workers, persistent workers, prefetch, pinned
  memory), then the compute side;
- compute-bound: the compute side only (channels_last, and on CUDA compile, TF32/cuDNN
  autotuning; precision and batch size when `tune.allow` names them).

A candidate is kept when its samples/s beat the best so far by more than `tune.min_gain`
(the batch search's rule); an ordered dimension (worker counts) stops at the first value
that does not pay. A trial that fails, diverges or runs out of memory is recorded and
skipped. At the end the start and the winner are measured again back to back, and the
speed-up claimed is the median of the pairs' ratios (a winner that does not hold up is
dropped). With a target (`target.metric`, `target.value`), the start and the winner are then
each trained to it, with the user's own epochs and evaluations, once per seed of
`tune.target_seeds` (alternating), and a winner whose median time to it is longer than the
start's is dropped: more samples/s (a larger batch, bf16) can take longer to a figure, and the
time to a figure moves with the seed. The search then has half the budget, the runs to the
target the other half. The whole
tune stays within `tune.budget_s`; an interrupt (Ctrl-C, SIGTERM) keeps
the best so far. The result: a table (console, tune.md, TensorBoard text; each trial's run
has its HParams entry), and a preset `experiment/tuned_<name>.yaml` holding the user's
overrides and the winner's, so that `python train.py experiment=tuned_<name>` reproduces
it. Tunes are cached per (config, hardware) in `tune.cache`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch
from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from saturate import names
from saturate.compose.build import UserObjects
from saturate.compose.run import Metrics, train
from saturate.config.dirs import CONF
from saturate.config.invocation import SCRIPT, TRAIN_COMMAND, Invocation, is_setting, key_of
from saturate.config.naming import slug
from saturate.data.loader import cpus_per_process
from saturate.errors import UserError
from saturate.loop.faults import Preempted, StopSignal, TrainingDiverged
from saturate.observe.environment import cpu_name
from saturate.observe.report import MIN_STEPS
from saturate.parts.batch_size import Cache
from saturate.parts.rundir import write_json

log = logging.getLogger(__name__)

INPUT = ("augmentation", "resident", "num_workers", "persistent_workers", "prefetch_factor", "pin_memory")
COMPUTE = ("channels_last", "compile", "cudnn", "precision", "batch_size")
CACHE_VERSION = 3  # of the cached entries' layout (Result's fields; 2: the dropped changes; 3: seeds to the target)
CONFIRM_ROUNDS = 2  # the start and the fastest measured again, back to back, at most this many times
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
    perf_counter time), ask the run to stop. Checked at log steps."""

    seconds: float
    steps: int
    deadline: float = float("inf")

    def reached(self, timer) -> bool:
        enough = timer.rest.wall_s >= self.seconds and timer.rest.steps >= self.steps
        return enough or time.perf_counter() >= self.deadline

    def on_log(self, run, metrics: dict, step: int) -> None:
        if names.SAMPLES_PER_S in metrics and self.reached(run.timer):
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
    seed: int | None = None  # a run to the target: its trainer.seed
    outcome: str = ""  # start | kept | slower | failed: <why> | ...
    seconds: float = 0.0  # wall time, set-up included


def side_order(verdict: str) -> tuple[str, ...]:
    """The dimensions to try next, in order, for the best trial's verdict."""
    if verdict == "compute-bound":
        return COMPUTE  # the loader is not what limits this run: its knobs would waste the budget
    return INPUT + COMPUTE


def candidates(dimension: str, facts: dict, *, allow: list[str], cuda: bool) -> list[list[str]]:
    """The override sets to try for `dimension`, given the facts of the best run so far
    (saturate.observe.report.RunFacts as a dict); [] when it does not apply. Ordered: a
    dimension with several values stops at the first that does not pay."""
    f = facts
    workers, resident, placement = f["num_workers"], f["resident"], f["placement"]
    if dimension == "augmentation":
        return [["augmentation.placement=gpu"]] if placement == "cpu" else []
    if dimension == "resident":
        fits = f["in_memory"] and not resident and placement != "cpu"  # a resident loader has no workers to augment in
        return [["loader.resident=true", "loader.num_workers=0", "loader.pin_memory=false"]] if fits else []
    if dimension == "num_workers":
        if resident:
            return []
        cpus = f["cpus"]
        counts = sorted({1, 2, 4, 8, max(1, cpus - 1), cpus})
        more = [n for n in counts if workers < n <= cpus]
        if f.get("cpu_util") is not None and f["cpu_util"] >= 90 and workers > 0:  # CPU-saturated: fewer first
            more = [n for n in reversed(counts) if n < workers] + [0]
        if cuda:
            return [[f"loader.num_workers={n}"] for n in more]
        # on a CPU the workers and torch's intra-op threads share the cores: each worker count
        # is tried with the threads that leave it its core (2 cores: 1 worker beside 2 threads
        # measured 0.81x; issue 35)
        return [[f"loader.num_workers={n}", f"device.threads={max(1, cpus - n) if n else 'auto'}"] for n in more]
    if dimension == "persistent_workers":
        return [["loader.persistent_workers=true"]] if workers > 0 and not f["persistent_workers"] else []
    if dimension == "prefetch_factor":
        return [["loader.prefetch_factor=4"]] if workers > 0 and f.get("prefetch_factor", 2) < 4 else []
    if dimension == "pin_memory":
        return [["loader.pin_memory=true"]] if cuda and not resident and not f["pin_memory"] else []
    if dimension == "channels_last":
        fits = f["image"] and not f["channels_last"] and f.get("channels_last_ok", True)
        return [["trainer.channels_last=true"]] if fits else []
    if dimension == "compile":  # on a CPU inductor writes C++: only with a compiler (tens of seconds to compile)
        return [["trainer.compile=true"]] if (cuda or f.get("cxx", False)) and not f["compile"] else []
    if dimension == "cudnn":
        return (
            [["device.tf32=true", "device.cudnn_benchmark=true"]]
            if cuda and not (f.get("tf32", True) and f.get("cudnn", True))
            else []
        )
    if dimension == "precision" and "precision" in allow:
        if f["emulated_precision"]:
            return [["precision.mode=fp32"]]
        native = cuda or f.get("cpu_bf16", False)  # CPU autocast computes in bf16: worth it only with native kernels
        return [["precision.mode=amp"]] if native and f["precision"] == "fp32" and f.get("amp_ok", True) else []
    if dimension == "batch_size" and "batch_size" in allow:
        # the batch-size search, inside the trial; lr scaled as optim.lr_scaling says
        return [["loader.batch_size=auto"]]
    return []


# What a tune can change, key by key (the values candidates() writes; a batch size the search
# chose): a tune cache's `changes` are checked against it before they reach a preset, with
# the user's own tune.extra (part of the cache's key) allowed as given.
TUNED = {
    "augmentation.placement": r"gpu",
    "loader.resident": r"true",
    "loader.num_workers": r"\d{1,3}",
    "device.threads": r"[1-9]\d{0,2}|auto",
    "loader.pin_memory": r"true|false",
    "loader.persistent_workers": r"true",
    "loader.prefetch_factor": r"4",
    "loader.batch_size": r"[1-9]\d{0,6}|auto",
    "trainer.channels_last": r"true",
    "trainer.compile": r"true",
    "device.tf32": r"true",
    "device.cudnn_benchmark": r"true",
    "precision.mode": r"amp|fp32",
}


def tunable(change: str, extra: list[str]) -> bool:
    """Whether `change` is an override a tune may write: one of TUNED's, or a part of the
    user's tune.extra."""
    key, eq, value = change.partition("=")
    pattern = TUNED.get(key)
    return bool(eq) and (pattern is not None and re.fullmatch(pattern, value) is not None or change in extra)


def valid_entry(entry: dict, extra: list[str]) -> bool:
    """A tune cache entry holds together: trial results of Result's shape, a best among them
    that trained, changes a tune can make, and figures that match its confirmation (at least
    one measured pair behind `confirmed`)."""
    fields = {f.name for f in dataclasses.fields(Result)}
    tunable_list = lambda x: isinstance(x, list) and all(isinstance(c, str) and tunable(c, extra) for c in x)  # noqa: E731
    results = entry.get("results")
    if not (isinstance(results, list) and results and all(isinstance(r, dict) and set(r) == fields for r in results)):
        return False
    rows = [Result(**r) for r in results]
    if not all(tunable_list(r.changes) for r in rows):
        return False
    ok = {
        r.number for r in rows if r.status == "ok" and isinstance(r.samples_per_s, (int, float)) and r.samples_per_s > 0
    }
    changes, best = entry.get("changes"), entry.get("best")
    if not tunable_list(changes):
        return False
    if isinstance(best, bool) or best not in ok or 0 not in ok:
        return False
    if not tunable_list(entry.get("dropped")):
        return False
    if "target_runs" not in entry or not _target_runs_valid(entry["target_runs"], entry.get("to_target_s")):
        return False
    figures = [entry.get("rate"), entry.get("speedup")]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in figures):
        return False
    pairs = sum(r.outcome == "again" for r in rows) // 2
    return entry.get("confirmed") is (pairs >= 1)


def _target_runs_valid(runs, medians) -> bool:
    """None (and no medians), or the seeds and each side's time per seed (a number of seconds,
    or None), of which `medians` are the medians."""
    if runs is None:
        return medians is None
    if not (isinstance(runs, dict) and set(runs) == {"seeds", "start", "fastest"}):
        return False
    seeds = runs["seeds"]
    if not (isinstance(seeds, list) and seeds and all(isinstance(x, int) and not isinstance(x, bool) for x in seeds)):
        return False
    time_ok = lambda t: t is None or isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0  # noqa: E731
    sides = (runs["start"], runs["fastest"])
    if not all(isinstance(t, list) and len(t) == len(seeds) and all(map(time_ok, t)) for t in sides):
        return False
    return isinstance(medians, list) and medians == [median_time(t) for t in sides]


def fresh_compile_state() -> None:
    """Forget what torch.compile compiled in earlier trials of this process: Dynamo keeps its
    caches per code object, so after its recompile limit (8) a later trial's compiled model
    would silently run eager, and a compile trial would measure nothing it claims."""
    import sys

    if "torch._dynamo" in sys.modules:  # nothing was compiled otherwise (and importing it costs a second)
        torch.compiler.reset()


def median_time(times: list[float | None]) -> float | None:
    """The median of times to a target, a run that never met it (None) counting as longer than
    any that did; None when the median is such a run."""
    middle = statistics.median(math.inf if t is None else t for t in times)
    return middle if math.isfinite(middle) else None


def merged(*override_lists: list[str]) -> list[str]:
    """Override lists applied in order, one entry per key (a later value replaces an
    earlier one in place), so Hydra never sees a key twice."""
    out: dict[str, str] = {}
    for overrides in override_lists:
        for o in overrides:
            out[o.lstrip("+~").partition("=")[0]] = o
    return list(out.values())


class Tuner:
    def __init__(self, cfg: DictConfig, invocation: Invocation, run_dir: Path):
        """`invocation`: how the tune was started: every trial composes with its whole
        command line, Hydra's own overrides first (a user's config dir included)."""
        self.tune = cfg.tune
        self.target = cfg.target.metric is not None  # the start and the winner are then run to it
        self.search_budget = self.tune.budget_s / 2 if self.target else self.tune.budget_s
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
        # the start's and the fastest's median time to the target over the seeds (None: not met at the median)
        self.to_target_s: tuple[float | None, float | None] | None = None
        self.seed = cfg.trainer.seed  # the first seed of the runs to the target
        self.target_runs: dict | None = None  # their seeds, and the start's and the fastest's time per seed
        self.dropped: list[str] = []  # the fastest's changes, when its run to the target did not beat the start's
        self.stop: StopSignal | None = None  # SIGINT/SIGTERM between trials (a trial's own run handles them within it)

    # -- trials

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
        base = base if explicit else self.changes
        result = Result(number, merged(base, changes) if explicit else changes, seed=seed)
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
            self._read(result, trial_dir, settings)
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

    def _read(self, result: Result, trial_dir: Path, settings: dict) -> None:
        m = json.loads((trial_dir / "metrics.json").read_text())
        result.samples_per_s, result.data_wait = m[names.SAMPLES_PER_S], m[names.DATA_WAIT_FRAC]
        result.gpu_util, result.peak_mb = m.get(names.GPU_UTIL_MEAN), m.get(names.PEAK_MB)
        result.verdict, result.facts, result.batch_size = m["verdict"], {**m["facts"], **settings}, m["batch_size"]
        result.to_target_s = m.get(names.TO_TARGET_S)
        if not math.isfinite(m.get(names.TRAIN_LOSS, 0.0)):
            result.status, result.outcome = "diverged", "diverged: the training loss is not finite"

    def better(self, result: Result, than: Result) -> bool:
        return result.status == "ok" and result.samples_per_s > than.samples_per_s * (1 + self.tune.min_gain)

    # -- the search

    def run(self) -> None:
        start = self.trial([])
        start.outcome = start.outcome or "start"
        if start.status == "interrupted":
            return
        if start.status != "ok":
            raise UserError(f"tune: the starting config does not train: {start.outcome}; fix it, then tune")
        self.best = start
        tried: set[str] = set()
        while self.affordable(reserve=2):  # two trials kept for the confirmation
            dimension = next((d for d in side_order(self.best.verdict) if d not in tried), None)
            if dimension is None:
                break
            tried.add(dimension)
            self.try_dimension(
                dimension, candidates(dimension, self.best.facts, allow=list(self.tune.allow), cuda=self.cuda)
            )
        for i, text in enumerate(self.tune.extra):
            if not self.affordable(reserve=2):
                log.warning(
                    "tune.extra: %d of %d not tried (%s ...): tune.budget_s=%g ran out first; raise it to try them",
                    len(self.tune.extra) - i,
                    len(self.tune.extra),
                    text,
                    self.tune.budget_s,
                )
                break
            self.try_dimension("extra", [text.split()])
        self.confirm()
        if self.target and self.best is not self.results[0]:
            self.to_target()

    def confirm(self) -> None:
        """The starting config and the fastest measured again, back to back, up to
        CONFIRM_ROUNDS times as the budget allows (one trial each is at the mercy of a noisy
        machine, and the first ran in a cold process): the speed-up is the median of the
        rounds' ratios (paired: a machine that slows down slows both sides of a round), and a
        winner that does not keep more than `min_gain` of it is dropped."""
        start = self.results[0]
        self.rate, self.speedup = self.best.samples_per_s, self.best.samples_per_s / start.samples_per_s
        if self.best is start:
            return
        starts, bests = [start.samples_per_s], [self.best.samples_per_s]
        for _ in range(CONFIRM_ROUNDS):
            if not self.affordable(reserve=1):
                break
            again = []
            for base in ([], self.changes):  # one after the other; an interrupt in the first stops at once
                if again and self.stopping():  # the pair's second: none after a stop
                    break
                again.append(self.trial([], base=base))
                if again[-1].status != "ok":
                    break
            if len(again) < 2 or again[-1].status != "ok":
                for r in again:  # a pair cut short (a stop, a failure): its measured trial counts for nothing
                    if r.status == "ok":
                        r.outcome = r.outcome or "again, unpaired"
                break
            for r, rates in zip(again, (starts, bests), strict=True):
                r.outcome = "again"
                rates.append(r.samples_per_s)
        if len(starts) == 1:
            return
        ratios = [b / s for s, b in zip(starts, bests, strict=True)]
        start_rate, best_rate = statistics.median(starts), statistics.median(bests)
        self.speedup, self.confirmed, self.rate = statistics.median(ratios), True, best_rate
        if self.speedup <= 1 + self.tune.min_gain:
            log.info("tune: measured again, the fastest is %.2fx the starting config: not kept", self.speedup)
            self.best.outcome, self.best, self.changes, self.speedup, self.rate = (
                "not confirmed",
                start,
                [],
                1.0,
                start_rate,
            )

    def to_target(self) -> None:
        """The start and the fastest, each trained to the target (the user's own epochs and
        evaluations) once per seed of tune.target_seeds (trainer.seed, +1, ...), alternating,
        within the rest of tune.budget_s (both runs of a seed the same cap: an equal share of
        what is left as the pair starts; a run stopped by it counts as never). One run each
        cannot rank them: the time to a figure moves with the seed (the segmentation example met
        Dice 0.7 between 24.9 and 52.2 s over five seeds). The fastest is dropped when its median
        time over the seeds is longer than the start's, a seed that did not meet the target (or
        failed) counting as never; when neither met it at the median, samples/s decide."""
        left = lambda: self.tune.budget_s - (time.perf_counter() - self.started)  # noqa: E731
        seeds = [self.seed + i for i in range(self.tune.target_seeds)]
        times: tuple[list, list] = ([], [])  # the start's and the fastest's, per seed
        for i, seed in enumerate(seeds):
            pair, cap = [], left() / (2 * (len(seeds) - i))
            for base in ([], self.changes):  # an interrupt stops at once; a pair left half done is not counted
                if self.stopping() or left() <= 0:
                    break
                run = self.trial([], base=base, until=time.perf_counter() + min(cap, left()), seed=seed)
                if run.status == "interrupted":
                    break
                reached = run.to_target_s if run.status == "ok" else None  # failed or diverged: never
                said = f"{reached:.1f} s" if reached is not None else "not met" if run.status == "ok" else run.outcome
                run.outcome = f"to target: {said} (seed {seed})"
                pair.append(reached)
            if len(pair) < 2:
                break
            for side, reached in zip(times, pair, strict=True):
                side.append(reached)
        if not times[0]:
            return
        self.target_runs = {"seeds": seeds[: len(times[0])], "start": times[0], "fastest": times[1]}
        self.to_target_s = start_s, best_s = median_time(times[0]), median_time(times[1])
        if best_s is None and start_s is None:
            return
        if best_s is None or (start_s is not None and best_s > start_s):
            log.info("tune: the fastest met the target later than the starting config, or not at all: not kept")
            self.dropped = self.changes
            self.best.outcome = "later to the target" if best_s is not None else "target not met"
            self.best, self.changes = self.results[0], []
            self.speedup, self.rate = 1.0, self.results[0].samples_per_s

    def holds(self, result: Result, rival: Result | None) -> bool:
        """A candidate that measured faster than `rival` (None: the best config so far) is
        measured again, back to back with it, when the budget allows: one trial can be an
        outlier on a shared machine (a batch of 128 once measured 3,609 samples/s between
        sizes at 50 and 341). Kept when the second pair agrees; the rows say "recheck"."""
        if not self.affordable(reserve=3):
            return True  # no room: one trial decides, as the table's single figures say
        rival_changes = merged(self.changes, rival.changes) if rival is not None else self.changes
        again = []
        for base in (rival_changes, merged(self.changes, result.changes)):  # an interrupt in the first stops at once
            if again and self.stopping():  # the pair's second: none after a stop
                return False
            again.append(self.trial([], base=base))
            again[-1].outcome = again[-1].outcome or "recheck"
            if again[-1].status != "ok":
                return False
        return again[1].samples_per_s > again[0].samples_per_s * (1 + self.tune.min_gain)

    def try_dimension(self, dimension: str, options: list[list[str]]) -> None:
        """Try each option in order on top of the best config; keep the best that pays. An
        ordered dimension stops at the first option that does not beat the one before."""
        best_here = None
        for changes in options:
            if not self.affordable():
                return
            result = self.trial(changes)
            if result.status != "ok":
                continue
            faster = self.better(result, best_here or self.best)
            if faster and self.holds(result, best_here):
                best_here = result
                result.outcome = "faster"
            else:
                slower = result.samples_per_s < self.best.samples_per_s
                result.outcome = "not held when measured again" if faster else "slower" if slower else "no gain"
                if faster and self.interrupted:  # its recheck was cut short by a stop
                    result.outcome = "faster once; stopped before measured again"
                if dimension == "num_workers":
                    break
        if best_here is not None:
            best_here.outcome = "kept"
            for r in self.results:  # an earlier option of this dimension that a later one beat
                if r.outcome == "faster":
                    r.outcome = "beaten"
            changes = list(best_here.changes)
            if "loader.batch_size=auto" in changes:  # the size the search chose, so the preset reproduces it
                changes[changes.index("loader.batch_size=auto")] = f"loader.batch_size={best_here.batch_size}"
            self.changes, self.best = merged(self.changes, changes), best_here


def tune(cfg: DictConfig, invocation: Invocation | None) -> Metrics:
    """`tune=true` on `cfg`, checked already (train.py's task checks every composed config
    once): measure, choose, write the preset and the table; returns the winner's figures
    (`float()` of it: its samples/s)."""
    if invocation is None or not invocation.app:
        raise UserError("tune.enabled=true: run it through the command (saturate train tune=true ...)")
    if invocation.multirun:
        raise UserError("tune.enabled=true: tune runs its own trials; run it without -m (saturate train tune=true ...)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("tune.enabled=true: run it as one process (saturate train tune=true), not under torchrun")
    run_dir = Path(invocation.output_dir)
    tuner = Tuner(cfg, invocation, run_dir)
    preset = preset_path(cfg, invocation)
    ours(preset)  # before the trials: a preset that cannot be written is found now, not after the budget
    key = _cache_key(cfg, tuner)
    extra = [part for text in cfg.tune.extra for part in str(text).split()]
    cache = Cache(cfg.tune.cache, what="tune.cache", valid=lambda entry: valid_entry(entry, extra))
    _measure_or_reuse(tuner, cache, key, cfg.tune)
    _record_tune(tuner, preset, run_dir)
    metrics = Metrics(
        {
            names.SAMPLES_PER_S: tuner.rate,
            names.TUNE_SPEEDUP: tuner.speedup,
            names.TUNE_CONFIRMED: float(tuner.confirmed),
            names.TUNE_TRIALS: len(tuner.results),
        }
    )
    metrics.objective = names.SAMPLES_PER_S
    return metrics


def _measure_or_reuse(tuner: Tuner, cache: Cache, key: dict, cfg) -> None:
    """The trials, or the cached tune of the same config on the same hardware."""
    hit = cache.get(key)
    if hit is not None:
        tuner.results = [Result(**r) for r in hit["results"]]
        tuner.changes = hit["changes"]
        tuner.best = next(r for r in tuner.results if r.number == hit["best"])
        tuner.rate, tuner.speedup, tuner.confirmed = hit["rate"], hit["speedup"], hit["confirmed"]
        tuner.to_target_s = tuple(hit["to_target_s"]) if hit.get("to_target_s") else None
        tuner.target_runs = hit["target_runs"]
        tuner.dropped = hit["dropped"]
        log.info(
            "tune: reused the tune of this config on this hardware from %s (tune.cache= to measure again)",
            cfg.cache,
        )
    else:
        log.info(
            "tune: trials of %.0f s of steady state each, within tune.budget_s=%.0f",
            cfg.trial_s,
            cfg.budget_s,
        )
        try:
            with StopSignal() as tuner.stop:
                tuner.run()
        except KeyboardInterrupt:
            tuner.interrupted = True
            if tuner.best is not None:
                tuner.rate, tuner.speedup = (
                    tuner.best.samples_per_s,
                    tuner.best.samples_per_s / tuner.results[0].samples_per_s,
                )
        if tuner.best is None:
            raise UserError("tune: interrupted before the starting config was measured; nothing to write")
        if not tuner.interrupted:
            cache.put(
                key,
                {
                    "results": [dataclasses.asdict(r) for r in tuner.results],
                    "changes": tuner.changes,
                    "best": tuner.best.number,
                    "rate": tuner.rate,
                    "speedup": tuner.speedup,
                    "confirmed": tuner.confirmed,
                    "to_target_s": tuner.to_target_s,
                    "target_runs": tuner.target_runs,
                    "dropped": tuner.dropped,
                },
            )


def _record_tune(tuner: Tuner, preset: Path, run_dir: Path) -> None:
    """The preset, tune.md, tune.json and the TensorBoard text."""
    speedup = tuner.speedup
    write_preset(
        preset,
        tuner.start_overrides,
        tuner.changes,
        groups={k for k in tuner.invocation.choices if not k.startswith("hydra")},
        searchpath=tuner.searchpath,
        speedup=speedup,
        rate=tuner.rate,
        confirmed=tuner.confirmed,
    )
    text = render(tuner, preset=preset)
    (run_dir / "tune.md").write_text(text)
    write_json(
        run_dir / "tune.json",
        {
            "results": [dataclasses.asdict(r) for r in tuner.results],
            "changes": tuner.changes,
            "speedup": speedup,
            "confirmed": tuner.confirmed,
            "to_target_s": tuner.to_target_s,  # the start's and the fastest's median time to the target
            "target_runs": tuner.target_runs,  # the seeds, and each side's time per seed (null: not met)
            "dropped": tuner.dropped,  # the fastest's changes, dropped for its time to the target
            "preset": str(preset),
            "interrupted": tuner.interrupted,
        },
    )
    _tensorboard(run_dir, lambda tb, run: tb.on_text(run, "tune", text, 0))
    log.info("\n%s", text)


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
    _tensorboard(trial_dir, lambda tb, run: tb.on_hparams(run, params, {names.TUNE_FAILED: 1.0}, []))


def _tensorboard(run_dir: Path, write) -> None:
    """Write into `run_dir`'s TensorBoard events with the built-in logger (a tune's own table,
    a failed trial's HParams row)."""
    from types import SimpleNamespace

    from saturate.loggers import TensorBoardLogger

    tb, run = TensorBoardLogger(), SimpleNamespace(run_dir=run_dir, start_step=0, step=0, metrics={})
    tb.on_run_start(run)
    try:
        write(tb, run)
    finally:
        tb.on_run_end(run, {})


def _first_line(error: BaseException, limit: int = 200) -> str:
    """The start of an error's message (its first clause), for a table cell."""
    text = str(error).strip().splitlines()[0].split("; ")[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _cache_key(cfg: DictConfig, tuner: Tuner) -> dict:
    config = OmegaConf.to_container(cfg, resolve=True)
    for key in ("run_dir", "name"):
        config.pop(key, None)
    config["tune"] = {k: v for k, v in config["tune"].items() if k not in ("enabled", "preset", "cache")}
    device = torch.cuda.get_device_name(cfg.device.index) if tuner.cuda else f"cpu: {cpu_name()}"
    return {
        "version": CACHE_VERSION,
        "config": config,
        "hardware": {"device": device, "cpus": cpus_per_process(), "torch": torch.__version__},
    }


def preset_name(cfg: DictConfig, choices: dict) -> str:
    """`tuned_<name>`: the run's `name`, else its data and model options."""
    name = cfg.name if cfg.name else f"{choices.get('data', 'data')}_{choices.get('model', 'model')}"
    return "tuned_" + re.sub(r"[^A-Za-z0-9_-]+", "_", str(name)).strip("_")


def preset_path(cfg: DictConfig, invocation: Invocation) -> Path:
    """Where the preset goes: tune.preset, or experiment/ in the user's first config dir (the
    project's ./conf, or one added with hydra.searchpath), else in ./conf/experiment/ (made:
    the project config dir of the next command run here). Never into the installed package."""
    if cfg.tune.preset != "auto":
        path = Path(cfg.tune.preset)
        return path if path.suffix == ".yaml" else path.with_suffix(".yaml")
    users = [Path(d) for d in invocation.config_dirs if Path(d).resolve() != CONF]
    folder = users[0] if users else Path.cwd() / "conf"
    return folder / "experiment" / f"{preset_name(cfg, invocation.choices)}.yaml"


def preset_text(start: list[str], changes: list[str], groups: set[str], header: str) -> str:
    """A `# @package _global_` experiment holding `start` and then `changes` (overrides):
    group choices as defaults-list overrides, keys as values."""
    defaults, values = [], OmegaConf.create({})
    parser = OverridesParser.create()
    for o in parser.parse_overrides(merged(start, changes)):
        key = o.key_or_group
        if o.is_delete():
            raise UserError(f"tune: ~{key} cannot be written into a preset; remove it from the command line")
        if key == "experiment":
            defaults.append(f"/experiment/{o.value()}")
        elif key in groups and "." not in key:
            defaults.append({f"override /{key}": o.value()})
        else:
            OmegaConf.update(values, key, o.value(), force_add=True)
    body = {"defaults": [*sorted(defaults, key=lambda d: isinstance(d, dict)), "_self_"]} if defaults else {}
    text = OmegaConf.to_yaml(body) if body else ""
    if values:
        text += OmegaConf.to_yaml(values)
    return f"# @package _global_\n{header}{text}"


PRESET_MARK = "# @package _global_\n# Written by saturate's tune"  # how a preset this module wrote begins


def ours(path: Path) -> None:
    """`path` is new, or a preset an earlier tune wrote; anything else (saturate's own
    config.yaml, a user's file) is refused, never overwritten."""
    if not path.exists():
        return
    head = ""
    if path.is_file():
        try:
            with open(path, "rb") as f:
                head = f.read(len(PRESET_MARK)).decode("utf-8", "replace")
        except OSError as e:
            raise UserError(f"tune.preset: cannot read {path} ({e.strerror or e}); give another path") from None
    if head != PRESET_MARK:
        raise UserError(
            f"tune.preset: {path} exists and is not a preset saturate's tune wrote; it is never overwritten: give "
            "tune.preset=<a new .yaml path>, or remove that file yourself"
        )


def write_preset(
    path: Path,
    start: list[str],
    changes: list[str],
    *,
    groups: set[str],
    searchpath: list[str],
    speedup: float,
    rate: float,
    confirmed: bool,
) -> None:
    """The preset `path`: `start` then `changes` (`groups`: the config groups, whose
    overrides become defaults-list entries)."""
    ours(path)
    how = "" if confirmed or not changes else " (one trial each, not confirmed)"
    header = (
        f"# Written by saturate's tune on {datetime.now():%Y-%m-%d %H:%M}: {rate:,.0f} samples/s, {speedup:.2f}x the "
        f"starting config{how}:\n#   saturate train tune=true {' '.join(searchpath + start)}\n# Reproduce it: "
        f"{reproduce(path, searchpath)}\n"
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(preset_text(start, changes, groups, header))
    except OSError as e:
        raise UserError(
            f"tune.preset: cannot write {path} ({e.strerror or e}); set tune.preset=<a writable .yaml path>"
        ) from None


def _rows(results: list[Result], start: Result) -> Iterator[str]:
    for r in results:
        ok = r.status == "ok"
        cells = [
            str(r.number),
            "`" + (" ".join(r.changes) or "(start)") + "`",
            f"{r.samples_per_s:,.0f}" if ok else "-",
            f"{r.samples_per_s / start.samples_per_s:.2f}x" if ok else "-",
            f"{r.data_wait:.0%}" if ok else "-",
            f"{r.gpu_util:.0f}%" if r.gpu_util is not None else "-",
            f"{r.peak_mb:,.0f}" if r.peak_mb is not None else "-",
            r.verdict or "-",
            r.outcome,
        ]
        yield "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def _to_target_lines(tuner: Tuner) -> list[str]:
    """What the runs to the target measured (with a target set)."""
    if tuner.to_target_s is None:
        return []
    start_s, best_s = tuner.to_target_s
    said = lambda seconds: f"{seconds:.1f} s" if seconds is not None else "not met"  # noqa: E731
    runs = tuner.target_runs
    seeds = ", ".join(map(str, runs["seeds"]))
    each = lambda times: ", ".join(said(t) for t in times)  # noqa: E731
    figures = (
        f"the starting config {each(runs['start'])} (median {said(start_s)}), "
        f"the fastest {each(runs['fastest'])} (median {said(best_s)})"
    )
    if start_s is not None and best_s is not None:
        figures += f", {start_s / best_s:.2f}x"
    kept = "kept" if tuner.changes else "not kept"
    if start_s is None and best_s is None:
        kept = "neither met it at the median: samples/s decided"
    how = f"with seed{'s' if len(runs['seeds']) > 1 else ''} {seeds} (trainer.seed)"
    return ["", f"To the target, each trained to it {how} within the budget: {figures}; {kept}."]


def reproduce(preset: Path, searchpath: list[str]) -> str:
    """The command that trains with the preset, from the folder the tune ran in: with the
    config dirs the tune was given (`searchpath`: its hydra.searchpath override) and the one
    the preset is in, unless that is found there by convention (./conf)."""
    command = "saturate train" if os.environ.get(SCRIPT) == TRAIN_COMMAND else "python train.py"
    if preset.parent.name != "experiment":
        return f"copy it to <a config dir>/experiment/, then {command} experiment={preset.stem}"
    dirs = [str(d) for o in OverridesParser.create().parse_overrides(searchpath) for d in (o.value() or [])]
    root = preset.parent.parent.resolve()
    found = (CONF, (Path.cwd() / "conf").resolve())  # saturate's own groups, the project's by convention
    if root not in found and not any(
        d.removeprefix("file://") and Path(d.removeprefix("file://")).resolve() == root for d in dirs
    ):
        dirs.append(f"file://{root}")
    where = [f"hydra.searchpath=[{','.join(dirs)}]"] if dirs else []
    return " ".join([command, *where, f"experiment={preset.stem}"])


def render(tuner: Tuner, *, preset: Path) -> str:
    """The tune as Markdown (console, tune.md, TensorBoard text)."""
    start = tuner.results[0]
    lines = [
        "## Tune",
        "",
        "| trial | overrides | samples/s | vs start | data wait | GPU util | peak MB | verdict | result |",
        "|---:|---|---:|---:|---:|---:|---:|---|---|",
        *_rows(tuner.results, start),
        "",
    ]
    if tuner.interrupted:
        lines += ["Interrupted: the best so far is kept.", ""]
    rounds = sum(r.outcome == "again" for r in tuner.results) // 2 + 1
    how = (
        f"the median of {rounds} paired measurements of the start and the fastest"
        if tuner.confirmed
        else "one trial each"
    )
    if tuner.changes and tuner.confirmed:
        lines.append(
            f"**Fastest: {tuner.rate:,.0f} samples/s, {tuner.speedup:.2f}x the starting config** ({how}) with "
            f"`{' '.join(tuner.changes)}`."
        )
    elif tuner.changes:
        lines.append(
            f"**Fastest: {tuner.rate:,.0f} samples/s, {tuner.speedup:.2f}x the starting config in one trial each, not "
            f"confirmed** with `{' '.join(tuner.changes)}`: the budget (or an interrupt) left no room to measure the "
            "start and the fastest again side by side; a single trial is at the mercy of a noisy machine. Tune again "
            "with a larger tune.budget_s to confirm it."
        )
    elif tuner.dropped:
        met = tuner.to_target_s is not None and tuner.to_target_s[1] is not None
        lines.append(
            f"**Keep the starting config** ({tuner.rate:,.0f} samples/s): the fastest in samples/s, "
            f"`{' '.join(tuner.dropped)}`, {'met the target later' if met else 'did not meet the target'} "
            "(the median over the seeds)."
        )
    else:
        lines.append(
            f"**Nothing measured faster than the starting config** ({tuner.rate:,.0f} samples/s): keep it as it is."
        )
    lines += _to_target_lines(tuner)
    lines += ["", f"Preset: `{preset}`; run it with `{reproduce(preset, tuner.searchpath)}`."]
    return "\n".join(lines) + "\n"
