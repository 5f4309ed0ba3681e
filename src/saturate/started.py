"""This process's start: when it first imported saturate, what its heaviest imports took (and
torchmetrics' import without the scipy.signal it loads for nothing: `scipy_signal_stood_in`),
and Python's garbage collector over a run's start-up.

`IMPORTED_AT` (time.perf_counter()): where a run's start-up is counted from when the process's
own start says nothing (a shell that ran `pip install ... && python train.py` and exec'd python
keeps its own start time, minutes earlier).

The collector: importing torch, torch._dynamo, torchmetrics (with matplotlib when installed),
Hydra and the rest allocates some 700k objects (measured with scipy.signal among them) that live
as long as the process, and the collector walks the growing heap again and again while they load
(about a second of a 2-core CPU's start-up; docs/benchmarks.md). In train.py's process (a single
run: cli.run) the collector is off from the command to the end of those imports
(`pause_collector`), which then freezes everything alive and turns it back on
(`resume_collector(freeze=True)`, in cli.task): its later passes skip the frozen objects (so
does the one at exit; in DataLoader workers forked after it, they no longer touch those pages:
gc.freeze's documented use, not measured here). Nothing the run builds is frozen: the data, the
model and DDP's reducer are freed as before. What the imports left as garbage in reference
cycles (some 30k small objects, 10-15 MB, no tensors: measured on the examples) is frozen with
the rest and never freed: collecting it first would cost one pass over the whole heap (0.4-0.65
s on a 2-core CPU). A collector the user turned off stays off; saturate.fit and train() called
from Python leave it alone.
"""

import contextlib
import gc
import importlib
import importlib.util
import os
import sys
import time
import types
from collections.abc import Iterator

IMPORTED_AT = time.perf_counter()
IMPORTS: dict[str, float] = {}  # seconds each heavy dependency took to import in this process (import_timed)
# time.perf_counter() when this process first reached each point of train.py's way to a run: "main" (saturate.cli.run
# calls the Hydra app) and "task" (Hydra calls saturate.cli.task); between them, Hydra's work (the start-up's "hydra")
REACHED: dict[str, float] = {}

_paused = False  # pause_collector turned the collector off; the start-up is not over


def import_timed(*modules: str) -> None:
    """Import each module in turn, timing those not imported yet (IMPORTS): the start-up's
    report names the dependencies that took the longest. torchmetrics is imported without
    scipy.signal (scipy_signal_stood_in)."""
    for name in modules:
        if name in sys.modules:
            continue
        start = time.perf_counter()
        with scipy_signal_stood_in() if name == "torchmetrics" else contextlib.nullcontext():
            importlib.import_module(name)
        IMPORTS[name] = time.perf_counter() - start


class _SignalStandIn(types.ModuleType):
    """What `scipy.signal` is while torchmetrics imports: `hamming` is there (the one thing its
    shim asks, with hasattr), and so is the real module's `__file__` (what `inspect.getmodule`
    asks of every module: torch.library's registrations call it); any other attribute imports
    the real module and is read from it. A name bound to the stand-in itself (`import
    scipy.signal as s` while it stands) keeps forwarding to the real one. A submodule of
    scipy.signal imported while it stands would be loaded twice (Python reads `__path__`, which
    loads the real package and the submodule with it, then loads the submodule again): nothing
    torchmetrics 1.9 imports does that."""

    def __init__(self, spec):
        super().__init__(spec.name)
        self.__file__ = spec.origin

    def __getattr__(self, name: str):
        if name == "hamming":
            return lambda *args, **kwargs: self.__getattr__("windows").hamming(*args, **kwargs)
        if sys.modules.get(self.__name__) is self:
            sys.modules.pop(self.__name__, None)
        return getattr(importlib.import_module(self.__name__), name)


@contextlib.contextmanager
def scipy_signal_stood_in() -> Iterator[None]:
    """A stand-in for `scipy.signal` while the block imports, when scipy is there and
    scipy.signal not imported yet; afterwards the stand-in is gone and a later import gets the
    real module.

    torchmetrics (up to 1.9.0 at least) imports scipy.signal in three `__init__`s for one line
    that patches `scipy.signal.hamming` back in for SRMRpy, a package it never imports
    (Lightning-AI/torchmetrics#3457, #3459): about 1.1 s of a 2-core CPU's start-up, scipy.stats
    and scipy.interpolate with it, two thirds of what train.py imported that a plain loop does
    not (forecast, `python -X importtime`). Neither saturate nor torchmetrics' metrics use it.
    What changes: scipy.signal.hamming is not put back for SRMRpy's callers (scipy removed it in
    1.13)."""
    spec = None
    if "scipy.signal" not in sys.modules:
        with contextlib.suppress(ImportError):  # scipy not installed
            spec = importlib.util.find_spec("scipy.signal")  # imports scipy (light), not scipy.signal
    if spec is None:
        yield
        return
    stand_in = _SignalStandIn(spec)
    sys.modules["scipy.signal"] = stand_in
    try:
        yield
    finally:
        if sys.modules.get("scipy.signal") is stand_in:
            sys.modules.pop("scipy.signal", None)
        scipy = sys.modules.get("scipy")
        if scipy is not None and vars(scipy).get("signal") is stand_in:
            del scipy.signal


def process_age() -> float:
    """Seconds since this process began. On Linux from the kernel's own start time (clock
    ticks since boot, /proc/self/stat) against CLOCK_BOOTTIME: 10 ms resolution, as the bench's
    references take theirs. Without /proc, from psutil's create_time. (On Linux psutil counts
    from /proc/stat's boot time in whole seconds: up to a second too early, the same for every
    process until the machine restarts; 0.26 s on the machine that found it.)"""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, no CLOCK_BOOTTIME (macOS, Windows)
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())


def reach(point: str) -> None:
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
