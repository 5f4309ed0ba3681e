"""This process's start: when it first imported saturate, what its heaviest imports took,
Python's garbage collector over a run's start-up, and a stop signal that comes before any
training (`stopping_at_once`: the process ends at once, with one line).

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

import contextlib
import gc
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

IMPORTED_AT = time.perf_counter()
IMPORTS: dict[str, float] = {}  # seconds each heavy dependency took to import in this process (import_timed)
# time.perf_counter() when this process first reached each point of train.py's way to a run: "main"
# (run_hydra_app calls the Hydra app) and "task" (Hydra calls saturate.commands.train.task); between
# them, Hydra's work (the start-up's "hydra")
REACHED: dict[str, float] = {}

# What a scheduler sends to stop a job (SLURM: SIGTERM, or the --signal before the time limit: SIGUSR2 from
# hydra/launcher=slurm, SIGUSR1 often in a user's own script; Ctrl-C: SIGINT). Once training began, every rank
# stops at the same step, saves and exits 128 + the signal (saturate.loop.faults.StopSignal); before, at once
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)

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


class StoppedEarly(SystemExit):
    """A stop signal (SIGTERM, SIGINT, SIGUSR1, SIGUSR2) before training began: there is
    nothing to save, so the process ends at once with 128 + the signal's number, after one
    line saying so (written by `stopped_early`)."""

    def __init__(self, signum: int, phase: str):
        self.signum, self.phase = signum, phase
        super().__init__(128 + signum)

    @property
    def line(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name} while {self.phase}: nothing was trained yet"


def stopped_early(signum: int, phase: str) -> StoppedEarly:
    """The exception that ends a process stopped while `phase`, its line written to stderr
    now: a write of its own (os.write), safe in a signal handler that interrupted a print."""
    stopped = StoppedEarly(signum, phase)
    with contextlib.suppress(OSError):
        os.write(2, f"{stopped.line}\n".encode())
    return stopped


@contextlib.contextmanager
def stopping_at_once(phase: str, signals=STOP_SIGNALS) -> Iterator[None]:
    """For the block (in the main thread), a stop signal raises StoppedEarly at once: a
    process that waits (for its peers, on a lock) or works before it trains is ended, not
    left to be killed. A signal the parent chose to ignore (SIGINT in a background job)
    stays ignored; the handlers before the block are put back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise stopped_early(signum, phase)

    watched = [s for s in signals if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, stop) for s in watched}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
