"""This process's start: when it first imported saturate, what its heaviest imports took (and
torchmetrics' import without the scipy.signal and matplotlib it loads for nothing:
`torchmetrics_stood_in`),
and Python's garbage collector over a run's start-up.

`IMPORTED_AT` (time.perf_counter()): where a run's start-up is counted from when the process's
own start says nothing (a shell that ran `pip install ... && python train.py` and exec'd python
keeps its own start time, minutes earlier).

The collector: importing torch, torch._dynamo, torchmetrics, Hydra and the rest allocates some
700k objects (measured with scipy.signal and matplotlib among them, before their stand-ins) that live
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
import dataclasses
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
    the scipy.signal and matplotlib it loads for nothing (torchmetrics_stood_in)."""
    for name in modules:
        if name in sys.modules:
            continue
        start = time.perf_counter()
        with torchmetrics_stood_in() if name == "torchmetrics" else contextlib.nullcontext():
            importlib.import_module(name)
        IMPORTS[name] = time.perf_counter() - start


class _StandIn(types.ModuleType):
    """What a module is while a block imports (`_stood_in`). While the block runs, the names it
    was given are answered here, and a dunder but `__path__` is not there (inspect asks every
    module for `__file__`: torch.library's registrations do); anything else (a submodule's
    import asks `__path__`), or any name after the block, gives up its package's stand-ins,
    imports the real module and is read from it. A name bound to a stand-in (`import
    matplotlib.pyplot as plt` while it stands) keeps forwarding to the real one."""

    def __init__(self, name: str, names: dict, family: dict, standing: list):
        super().__init__(name)
        self._names, self._family, self._standing = names, family, standing

    def __getattr__(self, name: str):
        if self._standing:
            if name in self._names:
                value = self._names[name]
                return self._family[value.name] if isinstance(value, _Sibling) else value
            if f"{self.__name__}.{name}" in self._family:  # `matplotlib.axes` after `import matplotlib.axes`
                return self._family[f"{self.__name__}.{name}"]
            if name.startswith("__") and name != "__path__":
                raise AttributeError(name)
        return getattr(_real(self.__name__), name)


@dataclasses.dataclass(frozen=True)
class _Sibling:
    """A name that is another stand-in of the same block (pyplot's `style` is matplotlib.style)."""

    name: str


def _real(module: str) -> types.ModuleType:
    """The real `module`, its package's stand-ins given up first."""
    package = module.partition(".")[0]
    for name, held in list(sys.modules.items()):
        if isinstance(held, _StandIn) and name.partition(".")[0] == package:
            del sys.modules[name]
    return importlib.import_module(module)


@contextlib.contextmanager
def _stood_in(package: str, modules: dict[str, dict]) -> Iterator[None]:
    """`modules` (name -> the names each answers) stand in for the real ones while the block
    runs, when `package` is installed (finding its spec imports nothing) and none of them is
    imported yet; afterwards they are gone from sys.modules (and from their parents) and a later
    import gets the real modules."""
    if any(name in sys.modules for name in modules) or importlib.util.find_spec(package) is None:
        yield
        return
    family: dict[str, _StandIn] = {}
    standing = [True]
    for name, names in modules.items():
        family[name] = _StandIn(name, names, family, standing)
    sys.modules.update(family)
    try:
        yield
    finally:
        standing.clear()
        for name, stand_in in family.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
            parent, _, child = name.rpartition(".")
            if getattr(sys.modules.get(parent), "__dict__", {}).get(child) is stand_in:
                delattr(sys.modules[parent], child)


@contextlib.contextmanager
def torchmetrics_stood_in() -> Iterator[None]:
    """torchmetrics' import without scipy.signal and matplotlib (each when installed and not
    imported yet), both loaded for nothing on every `import torchmetrics` (up to 1.9.0 at least;
    Lightning-AI/torchmetrics#3457, open):

    - scipy.signal, for one line in three `__init__`s that patches `scipy.signal.hamming` back in
      for SRMRpy, a package torchmetrics never imports (#3459): its stand-in answers `hamming`
      (what the shim asks, with hasattr). What changes: hamming is not put back for SRMRpy's
      callers (scipy removed it in 1.13).
    - matplotlib, which `torchmetrics.utilities.plot` imports to build three annotation aliases
      and to call `pyplot.style.context` as a decorator of its plot functions: 0.2-0.4 s of a 2-core
      CPU, most of torchmetrics' import (#3463 made the same change upstream, closed unmerged).
      The stand-ins answer those names: classes whose isinstance and issubclass ask the real
      ones, and a style context that imports pyplot when a plot function is first called.

    Neither saturate nor torchmetrics' metrics use either; `metric.plot()` works as before. What
    differs: torchmetrics.utilities.plot's three aliases are those classes, not matplotlib's own
    (isinstance agrees; `is` and pickling by reference do not), and a name taken from a stand-in
    by another thread during the import is one too. When scienceplots is installed (torchmetrics
    imports it, and it styles matplotlib as it loads) nothing stands in for matplotlib."""
    # scienceplots, when installed, is imported by torchmetrics' plot module and styles matplotlib as it loads
    matplotlib = contextlib.nullcontext() if importlib.util.find_spec("scienceplots") else _stood_in(*_MATPLOTLIB)
    with _stood_in("scipy", {"scipy.signal": {"hamming": _hamming}}), matplotlib:
        yield


def _hamming(*args, **kwargs):
    return _real("scipy.signal").windows.hamming(*args, **kwargs)


class _Deferred(type):
    """A class of a module not imported yet: isinstance, issubclass and a call ask the real
    class (importing its module)."""

    def __call__(cls, *args, **kwargs):
        return getattr(_real(cls.__module__), cls.__name__)(*args, **kwargs)

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, getattr(_real(cls.__module__), cls.__name__))

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, getattr(_real(cls.__module__), cls.__name__))


class _DeferredStyle(contextlib.ContextDecorator):
    """`matplotlib.pyplot.style.context(*args, **kwargs)`, pyplot imported when it is entered."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.entered = args, kwargs, []

    def _recreate_cm(self):  # each call of a decorated function enters its own
        return _DeferredStyle(*self.args, **self.kwargs)

    def __enter__(self):
        self.entered.append(_real("matplotlib.pyplot").style.context(*self.args, **self.kwargs))
        return self.entered[-1].__enter__()

    def __exit__(self, *exc):
        return self.entered.pop().__exit__(*exc)


# What torchmetrics.utilities.plot reads of matplotlib as it loads (1.9.0); pyplot's `style` is matplotlib.style
_MATPLOTLIB = (
    "matplotlib",
    {
        "matplotlib": {},
        "matplotlib.axes": {"Axes": _Deferred("Axes", (), {"__module__": "matplotlib.axes"})},
        "matplotlib.colors": {"Colormap": _Deferred("Colormap", (), {"__module__": "matplotlib.colors"})},
        "matplotlib.style": {"context": _DeferredStyle},
        "matplotlib.pyplot": {
            "Figure": _Deferred("Figure", (), {"__module__": "matplotlib.pyplot"}),
            "style": _Sibling("matplotlib.style"),
        },
    },
)


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
