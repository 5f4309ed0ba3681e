"""Tunes cached per (config, hardware) in `tune.cache`: the key, what an entry must hold
before it is trusted, and the trials run or their cached results read back."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from saturate.components.batch_size import Cache
from saturate.data.loader import cpus_per_process
from saturate.diagnostics.environment import cpu_name
from saturate.errors import UserError
from saturate.loop.faults import StopSignal
from saturate.tune.options import tunable
from saturate.tune.rules import median_time
from saturate.tune.trials import Result

if TYPE_CHECKING:
    from saturate.tune.search import Tuner

log = logging.getLogger("saturate.tune")  # one logger for the whole tune, whichever module writes a line

# of the cached entries' layout (Result's fields; 2: the dropped changes; 3: seeds to the target; 4: each trial's
# window rates, compile counts and whole config, and the candidates run to the target)
CACHE_VERSION = 4


def valid_entry(entry: dict, extra: list[str]) -> bool:
    """A tune cache entry holds together: trial results of Result's shape, a best among them
    that trained, changes a tune can make, and figures that match its confirmation (at least
    one measured pair behind `confirmed`)."""
    fields = {f.name for f in dataclasses.fields(Result)}
    tunable_list = lambda x: isinstance(x, list) and all(isinstance(c, str) and tunable(c, extra) for c in x)
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
    target = entry.get("target_runs", False)  # absent: an entry of another layout
    if target is False or not _target_runs_valid(target, entry.get("to_target_s"), tunable_list):
        return False
    figures = [entry.get("rate"), entry.get("speedup")]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in figures):
        return False
    pairs = sum(r.outcome == "again" for r in rows) // 2
    return entry.get("confirmed") is (pairs >= 1)


def _target_runs_valid(runs, medians, tunable_list) -> bool:
    """None (and no medians), or the seeds and each candidate's changes, numerics mark, time per
    seed (a number of seconds, or None) and final figures, the start first (no changes), of whose
    times `medians` are the medians."""
    if runs is None:
        return medians is None
    if not (isinstance(runs, dict) and set(runs) == {"seeds", "candidates"}):
        return False
    seeds, sides = runs["seeds"], runs["candidates"]
    if not (isinstance(seeds, list) and seeds and all(isinstance(x, int) and not isinstance(x, bool) for x in seeds)):
        return False
    number = lambda t, low: t is None or isinstance(t, (int, float)) and not isinstance(t, bool) and t >= low
    fields = {"changes", "numerics", "times", "finals"}
    shaped = lambda c: isinstance(c, dict) and set(c) == fields
    if not (isinstance(sides, list) and len(sides) >= 2 and all(map(shaped, sides))):
        return False
    marked = lambda c: isinstance(c["numerics"], bool) and tunable_list(c["changes"])
    if sides[0]["changes"] != [] or not all(map(marked, sides)):
        return False
    for side in sides:
        times, finals = side["times"], side["finals"]
        if not all(isinstance(t, list) and len(t) == len(seeds) for t in (times, finals)):
            return False
        if not (all(number(t, 0) for t in times) and all(number(f, -math.inf) for f in finals)):
            return False
    return isinstance(medians, list) and medians == [median_time(c["times"]) for c in sides]


def cache_key(cfg: DictConfig, tuner: Tuner) -> dict:
    config = cast("dict[str, Any]", OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's is a dict
    for key in ("run_dir", "name"):
        config.pop(key, None)
    config["tune"] = {k: v for k, v in config["tune"].items() if k not in ("enabled", "preset", "cache")}
    device = torch.cuda.get_device_name(cfg.device.index) if tuner.cuda else f"cpu: {cpu_name()}"
    return {
        "version": CACHE_VERSION,
        "config": config,
        "hardware": {"device": device, "cpus": cpus_per_process(), "torch": torch.__version__},
    }


def measure_or_reuse(tuner: Tuner, cache: Cache, key: dict, cfg) -> None:
    """The trials, or the cached tune of the same config on the same hardware."""
    hit = cache.get(key)
    if hit is not None:
        tuner.results = [Result(**r) for r in hit["results"]]
        tuner.changes = hit["changes"]
        tuner.best = next(r for r in tuner.results if r.number == hit["best"])
        tuner.rate, tuner.speedup, tuner.confirmed = hit["rate"], hit["speedup"], hit["confirmed"]
        tuner.to_target_s = hit["to_target_s"]
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
            tuner.budget_s,
        )
        try:
            with StopSignal() as tuner.stop:
                tuner.run()
        except KeyboardInterrupt:
            tuner.interrupted = True
            if tuner.best is not None:
                tuner.rate, tuner.speedup = tuner.best.speed(), tuner.best.speed() / tuner.results[0].speed()
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
