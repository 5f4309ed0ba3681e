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
from saturate.tune.rules import changes_numerics, choose_by_target, judge, median_time, paired_noise, spread
from saturate.tune.trials import Result, Trials

log = logging.getLogger("saturate.tune")  # one logger for the whole tune, whichever module writes a line

CONFIRM_ROUNDS = 2  # the start and the fastest measured again, back to back, at most this many times
CONTENDERS = 3  # with a target: at most this many candidates trained to it beside the start


class Tuner(Trials):
    """The search over the dimensions, its confirmation, and the runs to the target."""

    def run(self) -> None:
        start = self.trial([])
        start.outcome = start.outcome or "start"
        if start.status == "interrupted":
            return
        if start.status != "ok":
            fix = "raise tune.budget_s" if "budget ran out" in start.outcome else "fix it"
            raise UserError(f"tune: the starting config was not measured: {start.outcome}; {fix}, then tune")
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
                    self.budget_s,
                )
                break
            self.try_dimension("extra", [text.split()])
        self.confirm()
        if self.target:
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
        said = judge(self.speedup, paired_noise(ratios), self.tune.min_gain)
        if said != "faster":
            log.info("tune: measured again, the fastest is %.2fx the start (%s): not kept", self.speedup, said)
            best.outcome = "undecided when measured again" if said == "undecided" else "not confirmed"
            self.best, self.changes, self.speedup, self.rate = start, [], 1.0, start_rate

    def contenders(self) -> list[Result]:
        """The candidates trained to the target beside the start: the fastest kept, the next
        distinct configs by samples/s that beat the start, and the fastest that changes the
        numerics (batch size, precision, compile) if none of those does, whatever its
        samples/s (a smaller batch can reach a figure sooner at fewer samples/s); CONTENDERS at
        most. Each is its trial's row, its `config` the whole candidate."""
        start = self.results[0]
        rows: dict[tuple[str, ...], Result] = {}
        for r in sorted(self.results, key=lambda r: -r.speed() if r.status == "ok" else 0.0):
            if r.status == "ok" and r.config and r.seed is None:
                r.config = [_sized(o, r.batch_size) for o in r.config]
                rows.setdefault(tuple(sorted(r.config)), r)
        kept = rows.pop(tuple(sorted(self.changes)), None) if self.changes else None
        chosen = [kept] if kept is not None else []
        faster = [r for r in rows.values() if r.speed() > start.speed() and r not in chosen]
        chosen += faster[: CONTENDERS - len(chosen)]
        if not any(changes_numerics(r.config) for r in chosen):
            numerics = [r for r in rows.values() if changes_numerics(r.config) and r not in chosen]
            chosen = (chosen[: CONTENDERS - 1] + numerics[:1]) if numerics else chosen
        return chosen

    def to_target(self) -> None:
        """The start and the contenders, each trained to the target (the user's own epochs and
        evaluations) once per seed of tune.target_seeds (trainer.seed, +1, ...), one after the
        other within a seed, within the rest of the budget (every run of a seed the same cap: an
        equal share of what is left as the seed starts; a run stopped by it counts as never).
        One run each cannot rank them: the time to a figure moves with the seed. A contender is
        kept only when its median time over the seeds is shorter than the start's (a seed that
        did not meet the target, or failed, counting as never); of several, the soonest."""
        rivals = self.contenders()
        if not rivals:
            return
        left = lambda: self.budget_s - (time.perf_counter() - self.started)
        seeds = [self.seed + i for i in range(self.tune.target_seeds)]
        sides = [[], *(r.config for r in rivals)]
        runs: list[list[Result]] = [[] for _ in sides]  # per side, its run of each seed
        for i, seed in enumerate(seeds):
            done, cap = [], left() / (len(sides) * (len(seeds) - i))
            for base in sides:  # an interrupt stops at once; a seed left part done is not counted
                if self.stopping() or left() <= 0:
                    break
                run = self.trial([], base=base, until=time.perf_counter() + min(cap, left()), seed=seed)
                if run.status == "interrupted":
                    break
                if run.status != "ok":  # failed or diverged: never
                    run.to_target_s = None
                reached = run.to_target_s
                said = f"{reached:.1f} s" if reached is not None else "not met" if run.status == "ok" else run.outcome
                run.outcome = f"to target: {said} (seed {seed})"
                done.append(run)
            if len(done) < len(sides):
                break
            for side, run in zip(runs, done, strict=True):
                side.append(run)
        if runs[0]:
            self.judge_by_target(seeds[: len(runs[0])], sides, runs, rivals)

    def judge_by_target(
        self, seeds: list[int], sides: list[list[str]], runs: list[list[Result]], rivals: list[Result]
    ) -> None:
        """Record the runs to the target and keep the contender that met it soonest, or the start."""
        times = [[r.to_target_s for r in side] for side in runs]
        self.target_runs = {
            "seeds": seeds,
            "candidates": [
                {"changes": side, "numerics": changes_numerics(side), "times": t, "finals": [r.final for r in rs]}
                for side, t, rs in zip(sides, times, runs, strict=True)
            ],
        }
        self.to_target_s = [median_time(t) for t in times]
        fastest = bool(self.changes) and sides[1] == self.changes
        chosen = choose_by_target(times[0], times[1:], first_is_fastest=fastest)
        if chosen is not None and sides[chosen + 1] == self.changes:
            return
        assert self.best is not None, "the runs to the target follow the search, which measured the start"
        if self.changes:
            self.dropped = self.changes
            met = self.to_target_s[1] is not None if fastest else False
            self.best.outcome = "later to the target" if met else "target not met"
        start = self.results[0]
        winner = rivals[chosen] if chosen is not None else start
        if chosen is not None:
            log.info("tune: %s met the target soonest", " ".join(winner.config))
            winner.outcome = "soonest to the target"
        else:
            log.info("tune: no candidate met the target sooner than the starting config: none kept")
        self.best, self.changes = winner, list(winner.config)
        self.speedup, self.rate = winner.speed() / start.speed(), winner.speed()

    def judged(self, result: Result, rival: Result) -> str:
        """What `result` is against `rival` (saturate.tune.rules.judge): their samples/s ratio
        against the wider spread of their timed windows."""
        noise = max(spread(result.rates), spread(rival.rates))
        return judge(result.speed() / rival.speed(), noise, self.tune.min_gain)

    def recheck(self, result: Result, rival: Result | None, said: str) -> str:
        """A candidate that measured faster than `rival` (None: the best config so far), or
        within the noise of it, is measured again, back to back with it, when the budget
        allows: one trial can be an outlier on a shared machine, many times the figures of its
        neighbours. The second pair's judgement decides (the rows say "recheck"); without room
        for it, the first's; "stopped" or "failed" when the pair did not complete."""
        if not self.affordable(reserve=3):
            return said  # no room: one trial decides, as the table's single figures say
        rival_changes = merged(self.changes, rival.changes) if rival is not None else self.changes
        again: list[Result] = []
        for base in (rival_changes, merged(self.changes, result.changes)):  # an interrupt in the first stops at once
            if again and self.stopping():  # the pair's second: none after a stop
                return "stopped"
            again.append(self.trial([], base=base))
            again[-1].outcome = again[-1].outcome or "recheck"
            if again[-1].status != "ok":
                return "stopped" if again[-1].status == "interrupted" else "failed"
        return self.judged(again[1], again[0])

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
            said = self.judged(result, best_here or self.best)
            if said in ("faster", "undecided"):
                said = _after_recheck(said, self.recheck(result, best_here, said))
            result.outcome = said
            if said == "faster":
                best_here = result
            elif dimension == "num_workers":
                break
        if best_here is not None:
            best_here.outcome = "kept"
            for r in self.results:  # an earlier option of this dimension that a later one beat
                if r.outcome == "faster":
                    r.outcome = "beaten"
            changes = [_sized(o, best_here.batch_size) for o in best_here.changes]
            self.changes, self.best = merged(self.changes, changes), best_here


def _after_recheck(first: str, second: str) -> str:
    """A row's outcome from its first judgement and its recheck's."""
    if second == "stopped":
        return "faster once; stopped before measured again" if first == "faster" else "undecided"
    if first == "faster" and second not in ("faster", "undecided"):
        return "not held when measured again"
    return "slower" if second == "failed" else second


def _sized(override: str, batch_size: int | None) -> str:
    """loader.batch_size=auto as the size its search chose, so that a preset reproduces it."""
    return f"loader.batch_size={batch_size}" if override == "loader.batch_size=auto" else override


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
