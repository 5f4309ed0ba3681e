"""The search: one dimension at a time, greedily, from the best trial's verdict; a
candidate faster once measured again before it is kept; the start and the fastest
confirmed back to back, then (with a target) each trained to it over several seeds.
`tune()` runs it, or reuses a cached tune, and writes what it found."""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path

from omegaconf import DictConfig

from saturate import names
from saturate.components.batch_size import Cache
from saturate.config.invocation import Invocation
from saturate.errors import UserError
from saturate.trainer.run import Metrics
from saturate.tune.cache import cache_key, measure_or_reuse, valid_entry
from saturate.tune.options import candidates, merged, side_order
from saturate.tune.outputs import record_tune
from saturate.tune.preset import check_overwritable, preset_path
from saturate.tune.trials import Result, Trials, median_time

log = logging.getLogger("saturate.tune")  # one logger for the whole tune, whichever module writes a line

CONFIRM_ROUNDS = 2  # the start and the fastest measured again, back to back, at most this many times


class Tuner(Trials):
    """The search over the dimensions, its confirmation, and the runs to the target."""

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
        start, best = self.results[0], self.best
        assert best is not None, "the confirmation follows the search, which measured the start"
        self.rate, self.speedup = best.speed(), best.speed() / start.speed()
        if best is start:
            return
        starts, bests = [start.speed()], [best.speed()]
        for _ in range(CONFIRM_ROUNDS):
            if not self.affordable(reserve=1):
                break
            again: list[Result] = []
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
                rates.append(r.speed())
        if len(starts) == 1:
            return
        ratios = [b / s for s, b in zip(starts, bests, strict=True)]
        start_rate, best_rate = statistics.median(starts), statistics.median(bests)
        self.speedup, self.confirmed, self.rate = statistics.median(ratios), True, best_rate
        if self.speedup <= 1 + self.tune.min_gain:
            log.info("tune: measured again, the fastest is %.2fx the starting config: not kept", self.speedup)
            best.outcome = "not confirmed"
            self.best, self.changes, self.speedup, self.rate = start, [], 1.0, start_rate

    def to_target(self) -> None:
        """The start and the fastest, each trained to the target (the user's own epochs and
        evaluations) once per seed of tune.target_seeds (trainer.seed, +1, ...), alternating,
        within the rest of tune.budget_s (both runs of a seed the same cap: an equal share of
        what is left as the pair starts; a run stopped by it counts as never). One run each
        cannot rank them: the time to a figure moves with the seed (twice as long from one seed to
        another is not rare). The fastest is dropped when its median time over the seeds is
        longer than the start's, a seed that did not meet the target (or failed) counting as
        never; when neither met it at the median, samples/s decide."""
        left = lambda: self.tune.budget_s - (time.perf_counter() - self.started)
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
            assert self.best is not None, "the runs to the target follow the search, which measured the start"
            self.dropped = self.changes
            self.best.outcome = "later to the target" if best_s is not None else "target not met"
            self.best, self.changes = self.results[0], []
            self.speedup, self.rate = 1.0, self.results[0].speed()

    def holds(self, result: Result, rival: Result | None) -> bool:
        """A candidate that measured faster than `rival` (None: the best config so far) is
        measured again, back to back with it, when the budget allows: one trial can be an
        outlier on a shared machine, many times the figures of its neighbours. Kept when the
        second pair agrees; the rows say "recheck"."""
        if not self.affordable(reserve=3):
            return True  # no room: one trial decides, as the table's single figures say
        rival_changes = merged(self.changes, rival.changes) if rival is not None else self.changes
        again: list[Result] = []
        for base in (rival_changes, merged(self.changes, result.changes)):  # an interrupt in the first stops at once
            if again and self.stopping():  # the pair's second: none after a stop
                return False
            again.append(self.trial([], base=base))
            again[-1].outcome = again[-1].outcome or "recheck"
            if again[-1].status != "ok":
                return False
        return again[1].speed() > again[0].speed() * (1 + self.tune.min_gain)

    def try_dimension(self, dimension: str, options: list[list[str]]) -> None:
        """Try each option in order on top of the best config; keep the best that pays. An
        ordered dimension stops at the first option that does not beat the one before."""
        assert self.best is not None, "a dimension is tried on top of the best trial so far"
        best_here: Result | None = None
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
                slower = result.speed() < self.best.speed()
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
    assert invocation.output_dir is not None, "a command's invocation names its run dir"
    run_dir = Path(invocation.output_dir)
    tuner = Tuner(cfg, invocation, run_dir)
    preset = preset_path(cfg, invocation)
    check_overwritable(preset)  # before the trials: a preset that cannot be written is found now, not after the budget
    key = cache_key(cfg, tuner)
    extra = [part for text in cfg.tune.extra for part in str(text).split()]
    cache = Cache(cfg.tune.cache, what="tune.cache", valid=lambda entry: valid_entry(entry, extra))
    measure_or_reuse(tuner, cache, key, cfg.tune)
    record_tune(tuner, preset, run_dir)
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
