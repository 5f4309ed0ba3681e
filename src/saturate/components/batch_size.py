"""`loader.batch_size=auto`: the fastest batch size that safely fits, found by trial and
remembered.

Candidates double from `batch_search.min`, each timed over a few real training steps (the
run's model, precision, compile, channels_last and device augmentation). Growing stops at
the first out-of-memory (then the memory limit is bisected), when samples/s improves by no
more than `min_gain`, or at `max` (never above the training set). The pick is the
highest-throughput size; after an out-of-memory, only among sizes at most `safety` times
the largest that fit, so a run does not live on the edge of memory. Model and RNG state
are put back afterwards; the trials step an optimizer and a GradScaler of their own. The
choice is cached in a JSON file keyed by what decides it, and reused by later runs with the
same key.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from saturate.components.device import OutOfMemory, free_device_memory, is_oom, untouched_rng
from saturate.errors import is_integer

log = logging.getLogger(__name__)


@dataclass
class Trial:
    size: int
    fit: bool
    samples_per_s: float | None = None  # the median of its measurements
    peak_mb: float | None = None  # peak allocated device memory (CUDA only)
    spread: float | None = None  # (highest - lowest) / median of its measurements, when measured more than once

    @property
    def rate(self) -> float:
        """The samples/s of a size that fit (one that ran out of memory has none)."""
        assert self.samples_per_s is not None, f"batch {self.size} did not fit"
        return self.samples_per_s


def search(
    measure: Callable[[int], Trial], *, low: int, high: int, min_gain: float, safety: float, repeats: int = 1
) -> tuple[int, list[Trial]]:
    """The search itself, given `measure(size) -> Trial`. Returns (chosen size, trials)."""
    trials: list[Trial] = []

    def trial(size: int) -> Trial:
        trials.append(measure(size))
        return trials[-1]

    largest_fit, smallest_oom, best_rate, size = None, None, 0.0, low
    while True:  # doubling
        t = trial(size)
        if not t.fit:
            smallest_oom = size
            break
        largest_fit = size
        improved = t.rate > best_rate * (1 + min_gain)
        best_rate = max(best_rate, t.rate)
        if not improved or size >= high:
            break
        size = min(2 * size, high)
    if largest_fit is None:
        raise OutOfMemory(
            f"loader.batch_size=auto: even batch_search.min={low} runs out of memory; lower it or free device memory"
        )
    if smallest_oom is not None:  # bisection: where between the two does memory run out?
        while smallest_oom - largest_fit > max(1, largest_fit // 16):
            middle = (largest_fit + smallest_oom) // 2
            if trial(middle).fit:
                largest_fit = middle
            else:
                smallest_oom = middle
    limit = int(safety * largest_fit) if smallest_oom is not None else high
    allowed = [t for t in trials if t.fit and t.size <= limit]
    if repeats > 1:
        allowed = measured_again(measure, allowed, repeats)
    if not allowed:
        log.warning(
            "batch_search: %g x the largest size that fit (%d) is below batch_search.min; using %d",
            safety,
            largest_fit,
            low,
        )
        return low, trials
    # Throughputs within min_gain of the best are a tie, which the smaller batch wins:
    # it generalises at least as well and leaves memory to spare.
    best = max(t.rate for t in allowed)
    return min(t.size for t in allowed if t.rate * (1 + min_gain) >= best), trials


def measured_again(measure: Callable[[int], Trial], trials: list[Trial], repeats: int) -> list[Trial]:
    """Each trial's size measured until it has `repeats` measurements, in rounds over all the
    sizes (alternating their order: a machine that slows down slows them all alike), each
    trial's figure then the median: one outlier (a batch of 128 once measured 3,609 samples/s
    between sizes at 96 and 341, and was chosen) no longer decides. A size that runs out of
    memory when measured again is dropped."""
    rates = {t.size: [t.rate] for t in trials}
    for round_ in range(repeats - 1):
        for t in trials if round_ % 2 else trials[::-1]:
            if t.size in rates:
                again = measure(t.size)
                if again.fit:
                    rates[t.size].append(again.rate)
                else:
                    del rates[t.size]
    kept = [t for t in trials if t.size in rates]
    for t in kept:
        t.samples_per_s = statistics.median(rates[t.size])
        t.spread = (max(rates[t.size]) - min(rates[t.size])) / t.rate
    return kept


def measure_with(
    step: Callable, optimizer: torch.optim.Optimizer, pipeline, fetch, *, steps: int, device: torch.device
) -> Callable[[int], Trial]:
    """measure(size): one warm-up and `steps` timed training steps on a batch of `size`
    real samples (`fetch(size)` gives the host batch, pinned on CUDA as the run's are;
    preparing it is not timed). `step(batch, n)` is one training step that does not recover
    from out-of-memory itself."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def measure(size: int) -> Trial:
        host = fetch(size)
        if device.type == "cuda":  # as the run's loader gives them: copies overlap, as in the run
            host = tree_map(lambda t: t.pin_memory() if isinstance(t, torch.Tensor) else t, host)
            torch.cuda.reset_peak_memory_stats(device)
        try:
            step(pipeline(host), 0)
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                step(pipeline(host), 0)
            sync()
            elapsed = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
            return Trial(size, True, size * steps / elapsed, peak)
        except Exception as e:
            if not is_oom(e):
                raise
        optimizer.zero_grad(set_to_none=True)  # out here: the exception no longer holds the tensors
        free_device_memory()
        return Trial(size, False)

    return measure


def restoring(model: torch.nn.Module, run: Callable[[], tuple[int, list[Trial]]]) -> tuple[int, list[Trial]]:
    """Run the search, then put the model's weights and buffers and every RNG back."""
    saved = copy.deepcopy(model.state_dict())
    with untouched_rng():
        try:
            return run()
        finally:
            model.load_state_dict(saved)


@dataclass
class TrialSetup:
    """How a trial runs: a fresh step (`make_step()`: the run's own step, built by the same
    factory, that does not recover from out-of-memory itself), its optimizer, the device
    pipeline, and `fetch(size)`: a host batch of `size` real training samples."""

    make_step: Callable
    optimizer: Any
    pipeline: Callable
    fetch: Callable[[int], Any]
    device: torch.device


def choose(cfg, *, key: dict, samples: int, trial: TrialSetup, model: torch.nn.Module, dist, compiled: bool):
    """loader.batch_size=auto: (the cached choice for `key`, or the size a search over real
    training steps chose; the trials). Under DDP each rank searches on its own device with the plain
    model (no collectives in the trials: not DDP's, and SyncBatchNorm's only within the rank
    itself; `dist.alone`) and the smallest choice wins, so it fits everywhere."""
    from saturate.scale.distributed import alone

    high = min(cfg.max, samples // dist.world_size)
    cache = Cache(cfg.cache, valid=valid_choice)
    hit = cache.get(key)
    if hit is not None and cfg.min <= hit["batch_size"] <= high:
        log.info(
            "loader.batch_size=auto: %d, reused from %s (same model, input, precision, compile, device)",
            hit["batch_size"],
            cfg.cache,
        )
        return hit["batch_size"], [Trial(**t) for t in hit["trials"]]
    start = time.perf_counter()
    measure = measure_with(
        trial.make_step(), trial.optimizer, trial.pipeline, trial.fetch, steps=cfg.steps, device=trial.device
    )
    with alone(model, dist):  # SyncBatchNorm: each rank's trials are its own
        chosen, trials = restoring(
            model,
            lambda: search(
                measure, low=cfg.min, high=high, min_gain=cfg.min_gain, safety=cfg.safety, repeats=cfg.repeats
            ),
        )
    chosen = dist.minimum(chosen)
    if compiled:  # each trial's size was a new shape: from the second on, a graph with a dynamic batch dimension
        torch.compiler.reset()  # dropped, so the run compiles once for the size it trains with (in its warm-up window)
    cached = dist.is_main and cache.put(key, {"batch_size": chosen, "trials": [dataclasses.asdict(t) for t in trials]})
    log.info(
        "loader.batch_size=auto: %d after %d trials in %.1fs%s\n%s",
        chosen,
        len(trials),
        time.perf_counter() - start,
        f" (cached in {cfg.cache})" if cached else "",
        table(trials, chosen),
    )
    return chosen, trials


def table(trials: list[Trial], chosen: int) -> str:
    lines = ["| batch size | samples/s (median) | spread | peak MB | result |", "|---:|---:|---:|---:|---|"]
    for t in trials:
        rate = f"{t.samples_per_s:,.0f}" if t.samples_per_s else "-"
        spread = f"{t.spread:.0%}" if t.spread is not None else "-"
        peak = f"{t.peak_mb:,.0f}" if t.peak_mb is not None else "-"
        lines.append(
            f"| {t.size} | {rate} | {spread} | {peak} | "
            f"{'fit' if t.fit else 'out of memory'}{' **chosen**' if t.size == chosen else ''} |"
        )
    return "\n".join(lines)


class Cache:
    """JSON file of earlier results, {key: entry}; updated under a file lock and replaced
    atomically, so concurrent sweep jobs do not corrupt it. `what` names it in warnings (the
    config key that sets the path); `valid(entry)` says whether an entry read back has the
    shape its reader needs. Whatever the file holds (damaged, a list, an entry of the wrong
    shape: it is saturate's own file, but anyone can edit it), reading it never fails: the
    answer is None, with a warning naming the file, and the next put() rebuilds it."""

    def __init__(self, path: str, what: str = "batch_search.cache", valid: Callable[[dict], bool] = lambda entry: True):
        self.path = Path(path) if path else None
        self.what, self.valid = what, valid

    def _entries(self) -> dict:
        """Every entry in the file; a warning and {} when it is not a JSON object."""
        assert self.path is not None  # callers look only where a cache is set
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError, RecursionError) as e:
            log.warning(
                "%s: cannot read %s (%s: %s); measuring again", self.what, self.path, type(e).__name__, str(e)[:200]
            )
            return {}
        if not isinstance(entries, dict):
            log.warning(
                "%s: %s holds a %s, not saturate's cache (an object of entries); measuring again",
                self.what,
                self.path,
                type(entries).__name__,
            )
            return {}
        return entries

    def get(self, key: dict) -> dict | None:
        if self.path is None or not self.path.is_file():
            return None
        entry = self._entries().get(json.dumps(key, sort_keys=True))
        if entry is None:
            return None
        try:
            ok = isinstance(entry, dict) and self.valid(entry)
        except Exception:  # noqa: BLE001 (a check that trips on the entry: the entry is wrong)
            ok = False
        if not ok:
            log.warning("%s: the entry for this configuration in %s is damaged; measuring again", self.what, self.path)
            return None
        return entry

    def put(self, key: dict, entry: dict) -> bool:
        """Add `entry` under `key`; whether the file now holds it (a write the disk refuses is
        a warning: the cache is a convenience, the run goes on)."""
        if self.path is None:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = self._entries() if self.path.is_file() else {}  # a damaged cache loses its entries, not the run
            entries[json.dumps(key, sort_keys=True)] = {**entry, "key": key}
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            try:
                tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
                os.replace(tmp, self.path)
            except OSError as e:  # a full disk, a folder in its place
                tmp.unlink(missing_ok=True)
                log.warning(
                    "%s: cannot write %s (%s); the next run measures again", self.what, self.path, e.strerror or e
                )
                return False
        return True


def valid_choice(entry: dict) -> bool:
    """A batch-size cache entry: the size chosen and the trials that chose it."""
    size, trials = entry.get("batch_size"), entry.get("trials")
    if not is_integer(size, 1) or not isinstance(trials, list):
        return False
    for t in trials:
        if not isinstance(t, dict) or set(t) != {"size", "fit", "samples_per_s", "peak_mb", "spread"}:
            return False
        if type(t["size"]) is not int or type(t["fit"]) is not bool:
            return False
        if not all(
            t[k] is None or (isinstance(t[k], (int, float)) and not isinstance(t[k], bool))
            for k in ("samples_per_s", "peak_mb", "spread")
        ):
            return False
    return True
