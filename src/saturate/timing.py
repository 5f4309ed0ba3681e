"""Where each training step's time goes: waiting for the batch, copying it to the device
(with any augmentation done there), and computing the step.

The wait is host time spent in the loader's `next()`. Copy and compute are measured with
CUDA events on a GPU (the host runs ahead of the device, so host clocks would measure
kernel launches) and with the host clock on a CPU. Nothing here synchronises the device
except `flush()`, which the engine calls only at log steps and epoch ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Window:
    """Totals over the steps between two flushes."""

    steps: int = 0
    samples: int = 0
    wall_s: float = 0.0  # host time from the first fetch to the flush, device work included
    wait_s: float = 0.0
    copy_s: float = 0.0
    compute_s: float = 0.0

    def add(self, other: Window) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def metrics(self) -> dict[str, float]:
        steps, wall = max(self.steps, 1), max(self.wall_s, 1e-9)
        return {
            "perf/samples_per_s": self.samples / wall,
            "perf/step_ms": 1000 * wall / steps,
            "perf/data_wait_frac": min(1.0, self.wait_s / wall),
            "perf/data_wait_ms": 1000 * self.wait_s / steps,
            "perf/copy_ms": 1000 * self.copy_s / steps,
            "perf/compute_ms": 1000 * self.compute_s / steps,
        }


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.window = Window()
        self.first: Window | None = None  # carries the start-up costs (workers, compile, caches)
        self.rest = Window()  # every later window: the steady state
        self._opened: float | None = None
        self._timed: dict[str, list] = {"copy": [], "compute": []}  # (begin, end) event pairs
        self._spare: list = []  # events kept for reuse, so no step allocates one

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
            self.window.wait_s += time.perf_counter() - start
            yield batch

    def _event(self) -> torch.cuda.Event:
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the step ("copy" or "compute") without synchronising."""
        if self.cuda:
            begin, end = self._event(), self._event()
            begin.record()
            yield
            end.record()
            self._timed[name].append((begin, end))
        else:
            start = time.perf_counter()
            yield
            setattr(self.window, f"{name}_s", getattr(self.window, f"{name}_s") + time.perf_counter() - start)

    def step_done(self, samples: int) -> None:
        self.window.steps += 1
        self.window.samples += samples

    def flush(self) -> Window | None:
        """Synchronise, close the window and return it (None if no step ran in it)."""
        if self.cuda:
            torch.cuda.synchronize()
            for name, pairs in self._timed.items():
                setattr(self.window, f"{name}_s", sum(b.elapsed_time(e) for b, e in pairs) / 1000)
                self._spare += [event for pair in pairs for event in pair]
                pairs.clear()
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

    def run_window(self) -> Window:
        """The run's steady state: every window after the first, or the first if it was the
        only one."""
        return self.rest if self.rest.steps else (self.first or Window())
