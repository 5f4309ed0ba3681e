"""This process's start: when it first imported saturate, what its heaviest imports took, and
Python's garbage collector over a run's start-up.

`IMPORTED_AT` (time.perf_counter()): where a run's start-up is counted from when the process's
own start says nothing (a shell that ran `pip install ... && python train.py` and exec'd python
keeps its own start time, minutes earlier).

The collector: importing torch, torch._dynamo, torchmetrics, Hydra and the rest allocates some
700k objects that live as long as the process, and the collector walks the growing heap again
and again while they load (docs/benchmarks.md, "Start-up"). In train.py's process (a single
run: commands.train.run_hydra_app) the collector is off from the command to the end of those
imports (`pause_collector`), which then freezes everything alive and turns it back on
(`resume_collector(freeze=True)`, in commands.train.task): its later passes skip the frozen objects (so
does the one at exit; in DataLoader workers forked after it, they no longer touch those pages:
gc.freeze's documented use). Nothing the run builds is frozen: the data, the model and DDP's
reducer are freed as before. What the imports left as garbage in reference cycles (some 30k
small objects, 10-15 MB, no tensors) is frozen with the rest and never freed: collecting it
first would cost one pass over the whole heap. A collector the user turned off stays off;
saturate.fit and train() called from Python leave it alone.
"""

import gc
import importlib
import os
import sys
import time

IMPORTED_AT = time.perf_counter()
IMPORTS: dict[str, float] = {}  # seconds each heavy dependency took to import in this process (import_timed)
# time.perf_counter() when this process first reached each point of train.py's way to a run: "main"
# (run_hydra_app calls the Hydra app) and "task" (Hydra calls saturate.commands.train.task); between
# them, Hydra's work (the start-up's "hydra")
REACHED: dict[str, float] = {}

_paused = False  # pause_collector turned the collector off; the start-up is not over


def import_timed(*modules: str) -> None:
    """Import each module in turn, timing those not imported yet (IMPORTS): the start-up's
    report names the dependencies that took the longest."""
    for name in modules:
        if name in sys.modules:
            continue
        start = time.perf_counter()
        importlib.import_module(name)
        IMPORTS[name] = time.perf_counter() - start


def process_age() -> float:
    """Seconds since this process began. On Linux from the kernel's own start time (clock
    ticks since boot, /proc/self/stat) against CLOCK_BOOTTIME: 10 ms resolution, as the bench's
    references take theirs. Without /proc, from psutil's create_time. (On Linux psutil counts
    from /proc/stat's boot time in whole seconds: up to a second too early, the same for every
    process until the machine restarts.)"""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, no CLOCK_BOOTTIME (macOS, Windows)
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())


def mark_reached(point: str) -> None:
    """This process reached `point` ("main", "task"); the first time counts."""
    REACHED.setdefault(point, time.perf_counter())


def pause_collector() -> None:
    """Turn the collector off for the start-up (if it is on)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_collector(*, freeze: bool = False) -> None:
    """Turn the collector back on if pause_collector turned it off; with `freeze`, first
    freeze everything alive (gc.freeze): the start-up's imports are done, and what they built
    lives as long as the process."""
    global _paused
    if _paused:
        if freeze:
            gc.freeze()
        gc.enable()
        _paused = False
