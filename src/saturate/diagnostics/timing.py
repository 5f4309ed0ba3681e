"""Where each training step's time goes: waiting for the batch, copying it to the device
(with any augmentation done there), and computing the step.

The wait is host time spent in the loader's `next()`: exposed wait, what the step stalled
on (batches that were ready because workers loaded them during the previous step cost
nothing here). Copy and compute are measured with CUDA events on a GPU (the host runs ahead
of the device, so host clocks would measure kernel launches) and with the host clock on a
CPU. On a GPU the same events also give the device's idle gap between one step's compute
and the next step's copy, split as Holistic Trace Analysis splits idle time: the part the
host spent waiting for the batch (data), and the rest (the host's own work between steps:
Python, logging, a synchronisation).

A step is launch-bound when the device waits on the host's kernel launches: it had finished
the previous step's work before the host began launching this one (a non-blocking `query()`
of the previous step's end event as this step's compute begins), and then kept pace with the
launches (its time for them within LAUNCH_RATIO of the host's time to launch them). Neither
alone says it: the host's time equals the device's in a compute-bound step too, once CUDA's
launch queue (about a thousand launches) is full and each launch waits for a free slot, and
a device idle at a step's start may have waited on data. A step that reads the device on the
host (fp16's non-finite check, GradScaler's with an optimizer that cannot skip on the device,
the DDP agreement) waits for the device inside the phase, which makes the two times equal by
construction: it calls `host_read()` before reading, and only what it launched before that
is compared. Nothing here synchronises the device except `flush()`, which the engine calls
only at log steps and epoch ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from saturate import names
from saturate.started import IMPORTED_AT, IMPORTS, REACHED, process_age

LAUNCH_RATIO = 1.1  # device time within this factor of the host's time to launch the same work: it kept pace


@dataclass
class Window:
    """Totals over the steps between two flushes."""

    steps: int = 0
    samples: int = 0
    wall_s: float = 0.0  # host time from the first fetch to the flush, device work included
    wait_s: float = 0.0
    copy_s: float = 0.0
    compute_s: float = 0.0
    # CUDA only (from the events already recorded; no read per step)
    gap_s: float = 0.0  # device idle between a step's compute and the next step's copy
    gap_data_s: float = 0.0  # the part of it the host spent waiting for the batch
    enqueue_s: float = 0.0  # host time spent enqueuing the compute phases
    launch_steps: int = 0  # steps the device began idle and then kept pace with the launches: it waited on them
    timed_steps: int = 0  # steps with device figures (the first after a flush has no previous step to judge by)

    def add(self, other: Window) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def metrics(self) -> dict[str, float]:
        steps, wall = max(self.steps, 1), max(self.wall_s, 1e-9)
        out = {
            names.SAMPLES_PER_S: self.samples / wall,
            names.STEP_MS: 1000 * wall / steps,
            names.DATA_WAIT_FRAC: min(1.0, self.wait_s / wall),
            names.DATA_WAIT_MS: 1000 * self.wait_s / steps,
            names.COPY_MS: 1000 * self.copy_s / steps,
            names.COMPUTE_MS: 1000 * self.compute_s / steps,
        }
        if self.timed_steps:
            out.update(
                {
                    names.GPU_IDLE_FRAC: min(1.0, self.gap_s / wall),
                    names.GPU_IDLE_DATA_FRAC: min(1.0, self.gap_data_s / wall),
                    names.GPU_IDLE_HOST_FRAC: min(1.0, max(0.0, self.gap_s - self.gap_data_s) / wall),
                    names.LAUNCH_BOUND_FRAC: self.launch_steps / self.timed_steps,
                    names.ENQUEUE_MS: 1000 * self.enqueue_s / self.timed_steps,
                }
            )
        return out


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.window = Window()
        self.first: Window | None = None  # carries the start-up costs (workers, compile, caches)
        self.first_step_at: float | None = None  # perf_counter at the end of the first step (host time)
        self.rest = Window()  # every later window: the steady state
        self._opened: float | None = None
        self._timed: dict[str, list] = {"copy": [], "compute": []}  # (begin, end) event pairs
        self._spare: list = []  # events kept for reuse, so no step allocates one
        self._waits: list[float] = []  # host wait before each step (CUDA: to split the device's idle gaps)
        self._enqueue: list[float] = []  # host time enqueuing each step's compute (CUDA)
        # CUDA, per step: whether the device had finished the previous step as this one began
        # (None: no previous step in the window), and (event, host seconds) at its first host read
        self._idle: list[bool | None] = []
        self._read: list[tuple | None] = []
        self._host_start: float | None = None  # host clock at the current compute phase's start

    def fetch(self, batches: Iterable) -> Iterator:
        """Yield from `batches`, adding the time spent waiting for each to the window."""
        it = iter(batches)
        while True:
            start = time.perf_counter()
            if self._opened is None:
                self._opened = start
            try:
                batch = next(it)
            except StopIteration:
                return
            waited = time.perf_counter() - start
            self.window.wait_s += waited
            if self.cuda:
                self._waits.append(waited)
            yield batch

    def _event(self) -> torch.cuda.Event:
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the step ("copy" or "compute") without synchronising."""
        if self.cuda:
            begin, end = self._event(), self._event()
            if name == "compute":
                computed = self._timed["compute"]
                self._idle.append(computed[-1][1].query() if computed else None)  # non-blocking
                self._read.append(None)
            begin.record()
            host = self._host_start = time.perf_counter()
            yield
            if name == "compute":
                self._enqueue.append(time.perf_counter() - host)
                self._host_start = None
            end.record()
            self._timed[name].append((begin, end))
        else:
            start = time.perf_counter()
            yield
            setattr(self.window, f"{name}_s", getattr(self.window, f"{name}_s") + time.perf_counter() - start)

    def host_read(self) -> None:
        """The step is about to read the device on the host (it will wait for the device):
        the launches before this point are what its launch-boundness is judged by."""
        if self.cuda and self._host_start is not None and self._read and self._read[-1] is None:
            mark = self._event()
            mark.record()
            self._read[-1] = (mark, time.perf_counter() - self._host_start)

    def step_done(self, samples: int) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.perf_counter()
        self.window.steps += 1
        self.window.samples += samples

    def flush(self) -> Window | None:
        """Synchronise, close the window and return it (None if no step ran in it)."""
        if self.cuda:
            torch.cuda.synchronize()
            seconds = {name: [b.elapsed_time(e) / 1000 for b, e in pairs] for name, pairs in self._timed.items()}
            self._device_figures(seconds["compute"])
            for name, pairs in self._timed.items():
                setattr(self.window, f"{name}_s", sum(seconds[name]))
                self._spare += [event for pair in pairs for event in pair]
                pairs.clear()
            self._spare += [read[0] for read in self._read if read is not None]
            for kept in (self._waits, self._enqueue, self._idle, self._read):
                kept.clear()
        window, opened = self.window, self._opened
        self.window, self._opened = Window(), None
        if window.steps == 0 or opened is None:
            return None
        window.wall_s = time.perf_counter() - opened
        if self.first is None:
            self.first = window
        else:
            self.rest.add(window)
        return window

    def _device_figures(self, computed: list[float]) -> None:
        """The window's device idle gaps and launch-boundness, from the events (after a
        synchronise) and the device's seconds for each step's compute (`computed`)."""
        copies, computes = self._timed["copy"], self._timed["compute"]
        w = self.window
        for i, (device, enqueue) in enumerate(zip(computed, self._enqueue, strict=False)):
            begin, compute_end = computes[i]
            w.enqueue_s += enqueue
            idle = self._idle[i]
            if idle is not None:  # the first step after a flush follows a synchronise
                read = self._read[i]
                launched = (begin.elapsed_time(read[0]) / 1000, read[1]) if read else (device, enqueue)
                w.timed_steps += 1
                w.launch_steps += launch_bound(idle, *launched)
            if i + 1 < len(copies) and i + 1 < len(self._waits):
                gap = max(0.0, compute_end.elapsed_time(copies[i + 1][0]) / 1000)
                w.gap_s += gap
                w.gap_data_s += min(gap, self._waits[i + 1])

    def run_window(self) -> Window:
        """The run's steady state: every window after the first, or the first if it was the
        only one."""
        return self.rest if self.rest.steps else (self.first or Window())


def launch_bound(idle: bool, device_s: float, host_s: float) -> bool:
    """A step the device waited on launches for: it was idle when the host began launching
    (`idle`), then took no longer than LAUNCH_RATIO x the host's time to launch the same work."""
    return idle and device_s <= LAUNCH_RATIO * host_s


@dataclass
class RunClock:
    """Where the loop's time went besides the training steps: seconds spent evaluating,
    saving checkpoints and logging (writing metrics to the loggers), and the loop's total."""

    loop_s: float = 0.0
    evaluation_s: float = 0.0
    checkpoint_s: float = 0.0
    logging_s: float = 0.0

    @contextmanager
    def timing(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, f"{name}_s", getattr(self, f"{name}_s") + time.perf_counter() - start)

    def metrics(self) -> dict[str, float]:
        return {f"time/{name}": value for name, value in vars(self).items()}


PROCESS_SLACK_S = 5.0  # the most a process's start may precede saturate's import and still count as its start


def process_origin(began: float) -> float:
    """Where a process's start-up is counted from, given when it began (perf_counter): there,
    unless it began before saturate's import by more than the interpreter and Hydra take. Such
    a process began as something else (a shell that exec'd python after pip install): from
    the import."""
    return began if IMPORTED_AT - began < PROCESS_SLACK_S else IMPORTED_AT


class Startup:
    """Where the time from the command to the end of the first optimizer step went: spans
    marked in order as the run builds its parts (`mark(name)`: the time since the previous
    mark), the first step's end taken by the step timer. From the process's start when the
    run is the process's own (train.py's first run: the interpreter and the imports count),
    else from the call (saturate.fit in a notebook, a sweep's later jobs, tune's trials)."""

    runs = 0  # runs started in this process

    def __init__(self, from_process: bool):
        now = time.perf_counter()
        self.origin = now
        from_process = from_process and Startup.runs == 0
        Startup.runs += 1
        if from_process:
            self.origin = process_origin(now - process_age())
        self.last = self.origin
        self.spans: dict[str, float] = {}
        self.imports: dict[str, float] = {}  # within the imports' span: the heavy dependencies train.py timed
        if from_process:
            self._process_spans()
            self.imports = dict(IMPORTS)

    def _process_spans(self) -> None:
        """The process's own start-up: the interpreter to train.py's call of its app, Hydra's
        work to the task, the imports to this run; one span where those points are not known
        or not in order (the user's own app calling saturate.train; a process forked after them)."""
        main, task, now = REACHED.get("main"), REACHED.get("task"), time.perf_counter()
        if main is None or task is None or not self.origin <= main <= task <= now:
            self.mark(names.PROCESS_SPAN, at=now)
            return
        for name, end in ((names.INTERPRETER_SPAN, main), (names.HYDRA_SPAN, task), (names.IMPORTS_SPAN, now)):
            self.mark(name, at=end)

    def mark(self, name: str, at: float | None = None) -> None:
        """The span `name` ends now (or `at`, a perf_counter time already taken)."""
        now = time.perf_counter() if at is None else at
        self.spans[name] = self.spans.get(name, 0.0) + now - self.last
        self.last = now

    def metrics(self, first_step_at: float | None) -> dict[str, float]:
        """`startup/<span>_s` for each span, the first step (loader workers, the first batch, the
        step) as the last, `time/first_step_s`: all of it (none when no step ran), and
        `imports/<module>_s`: what each heavy dependency took of the imports' span (or of the
        one process span)."""
        if first_step_at is None:
            return {}
        spans = {**self.spans, "first step": first_step_at - self.last}
        return {
            **{f"startup/{name.replace(' ', '_')}_s": s for name, s in spans.items()},
            **{f"{names.IMPORTS_PREFIX}{module}_s": s for module, s in self.imports.items()},
            names.FIRST_STEP_S: first_step_at - self.origin,
        }
