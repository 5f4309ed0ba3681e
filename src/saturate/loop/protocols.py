"""What the loop takes, as protocols: any object with these members serves (the built-in ones
are named in each docstring). The loop asks nothing else of them, and never which options
built them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

from torch import nn


class Batches(Protocol):
    """A split's batches (saturate.data.loader: StreamLoader, ResidentLoader)."""

    num_workers: int

    def __len__(self) -> int:
        """Batches per epoch."""

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """The host batches of `epoch` from batch `start` on, in a seeded order."""

    def to_device(self, batch: Any) -> Any:
        """One batch on the device, prepared there (augmented, normalised)."""


class Schedule(Protocol):
    """The learning rate over the run (saturate.components.schedule.Schedule)."""

    def step(self) -> None:
        """After an optimizer step that moved the weights."""

    def epoch_done(self) -> None: ...

    def evaluated(self, metrics: dict[str, float]) -> None: ...

    def get_last_lr(self) -> list[float]: ...


class Tracker(Protocol):
    """Where metrics go (saturate.diagnostics.tracking.Tracker)."""

    latest: dict[str, float]

    def due(self, step: int) -> bool: ...

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def progress(self, step: int, epoch: int) -> None: ...

    def matrices(self, matrices: dict, step: int, labels: list[str] | None = None) -> None: ...

    def images(self, tag: str, images: Any, step: int) -> None: ...

    def changed(self, counts: dict[str, float]) -> dict[str, float]: ...

    def pictures_due(self, at_end: bool) -> bool: ...

    def epoch_line(
        self,
        epoch: float,
        epochs: int,
        step: int,
        evaluated: dict[str, float],
        inside: int | None,
        started: float,
        max_steps: int = -1,
    ) -> None: ...


class Timer(Protocol):
    """Where each step's time goes (saturate.diagnostics.timing.StepTimer)."""

    first_step_at: float | None  # perf_counter at the end of the first step (host time)

    def fetch(self, batches: Iterable[Any]) -> Iterator[Any]: ...

    def phase(self, name: str) -> AbstractContextManager: ...

    def host_read(self) -> None:
        """The step is about to read the device on the host."""

    def step_done(self, samples: int) -> None: ...

    def flush(self) -> Any: ...

    def run_window(self) -> Any: ...


class Monitor(AbstractContextManager, Protocol):
    """Resource sampling in the background (saturate.diagnostics.monitor.ResourceMonitor)."""

    phase: str

    def window(self) -> dict[str, float]: ...

    def gpu_summary(self) -> dict[str, float] | None: ...

    def cpu_summary(self) -> dict[str, float]: ...


class Clock(Protocol):
    """The loop's time besides the steps (saturate.diagnostics.timing.RunClock)."""

    def timing(self, name: str) -> AbstractContextManager: ...

    def metrics(self) -> dict[str, float]: ...


class StopRequest(Protocol):
    """A stop signal (saturate.loop.faults.StopSignal): the signal's number once one arrived."""

    requested: int | None


class Checkpoints(Protocol):
    """Saving the run (saturate.checkpoint.checkpointer.Checkpointer)."""

    last_path: Any
    best: float | None
    best_at: tuple[int, int] | None

    def due(self, epoch: int, last: bool) -> bool: ...

    def due_step(self, step: int) -> bool: ...

    def save(self, position: Any, metrics: dict[str, float], run: Any = None, *, background: bool = False) -> float: ...

    def hold(self, position: Any, metrics: dict[str, float], run: Any = None) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def last_good(self) -> str: ...


class Evaluation(Protocol):
    """Evaluating a split (saturate.loop.evaluate.Evaluator)."""

    batches: Batches | None
    matrices: dict
    class_names: list[str] | None
    split: str  # the metrics' prefix: val, test
    preview: Any  # images the task drew of the first batch (a tensor), or None

    @property
    def test_evaluator(self) -> Evaluation | None:
        """A second split evaluated beside this one (test at every evaluation)."""

    @property
    def estimate_evaluator(self) -> Evaluation | None:
        """Training batches drawn at random, evaluated beside this one (trainer.train_est_batches)."""

    def due(self, epoch: int, last: bool) -> bool: ...

    def due_step(self, step: int) -> bool: ...

    def run(
        self, model: nn.Module, interrupted=None, predict: bool = False, key: int = 0
    ) -> dict[str, float] | None: ...


class Ranks(Protocol):
    """This process among the run's (saturate.scale.distributed.Dist)."""

    is_main: bool
    rank: int
    world_size: int
    check_every: int

    def any(self, flag: bool) -> bool: ...

    def any_of(self, flags: Iterable[bool]) -> list[bool]: ...

    def mean(self, values: dict[str, float], sum_keys: tuple[str, ...] = ()) -> dict[str, float]: ...

    def barrier(self) -> None: ...


class Observers(Protocol):
    """The callbacks and loggers behind one call per hook (saturate.callbacks.Observers)."""

    def has(self, hook: str) -> bool: ...

    def call(self, hook: str, run: Any, *args: Any) -> None: ...


class RunView(Protocol):
    """What the callbacks see of the run and may request (saturate.callbacks.Run)."""

    eval_model: nn.Module
    stop_reason: str | None
    lr_scale: float

    def request_stop(self, reason: str) -> None: ...
