"""Hooks and loggers: how a user's code sees a run without changing it.

A **callback** is any object with some of the methods of `Callback` (each is optional); list
them as `_target_` nodes under `callbacks:` (or pass instances to `saturate.fit`). They are
called on rank 0, for side effects only (notify, export, watch): they never steer the loop.

A **logger** receives every logged metric, as TensorBoard does: `log_metrics(metrics, step)`
is required; `log_text(tag, text, step)`, `log_hparams(params, metrics)` and `close()` are
called when present. `logger: [tensorboard, csv]` picks the built-in ones; a `_target_` node
in that list adds yours.
"""

from __future__ import annotations

import csv
import logging
import re
import signal
import threading
from collections.abc import Collection
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HOOKS = ("on_run_start", "on_log", "on_eval_end", "on_checkpoint", "on_run_end")


class Callback:
    """The hooks, with what they receive. Subclassing is optional: any object with some of
    these methods works."""

    def on_run_start(self, info: dict[str, Any]) -> None:
        """After set-up, before the first step: run_dir, total_steps, start_step, data, model, task."""

    def on_log(self, metrics: dict[str, float], step: int) -> None:
        """At every log step and epoch end: the training metrics just logged."""

    def on_eval_end(self, metrics: dict[str, float], step: int) -> None:
        """After each evaluation: val/loss and the task's val/* metrics."""

    def on_checkpoint(self, path: str, step: int) -> None:
        """After last.pt (and best.pt when it improved) was written."""

    def on_run_end(self, metrics: dict[str, Any]) -> None:
        """After the run: the final metrics, as in metrics.json (status included)."""


HANG_S = 5.0  # once the run is asked to stop, how long a hook may still run before it is abandoned


class CallbackHung(BaseException):
    """Raised inside a hook that did not return within HANG_S of a stop signal. A
    BaseException, so that a callback's own `except Exception` does not swallow it."""


class Callbacks:
    """Calls each hook on every callback that has it, in order. A hook that hangs cannot keep
    a run alive past a stop signal: HANG_S after the signal (or after the hook started, if
    the signal came first) it is interrupted and abandoned with a warning naming it, and the
    run stops as any stopped run does (last.pt saved, exit 143 for SIGTERM)."""

    def __init__(self, callbacks: list[Any] = (), enabled: bool = True):
        self.callbacks = list(callbacks) if enabled else []
        self.running: str | None = None  # the hook running now, as callback.hook
        self.stopping = False  # a stop signal arrived
        self._previous_alarm = None  # SIGALRM's handler while a hook is on the clock
        for c in self.callbacks:
            if not any(callable(getattr(c, hook, None)) for hook in HOOKS):
                from saturate.errors import UserError

                raise UserError(f"callbacks: {type(c).__name__} has none of the hooks {', '.join(HOOKS)}")

    def stop_requested(self, signum: int) -> None:
        """Called from the stop signal's handler: a hook running now gets HANG_S to return."""
        self.stopping = True
        if self.running is not None:
            self._arm()

    def _arm(self) -> None:
        if self._previous_alarm is None and threading.current_thread() is threading.main_thread():
            self._previous_alarm = signal.signal(signal.SIGALRM, self._hung)
            signal.setitimer(signal.ITIMER_REAL, HANG_S)

    def _disarm(self) -> None:
        if self._previous_alarm is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous_alarm)
            self._previous_alarm = None

    def _hung(self, signum, frame) -> None:
        raise CallbackHung(self.running)

    def _call(self, hook: str, *args) -> None:
        for c in self.callbacks:
            fn = getattr(c, hook, None)
            if not callable(fn):
                continue
            self.running = f"{type(c).__name__}.{hook}"
            try:
                if self.stopping:
                    self._arm()
                fn(*args)
            except CallbackHung:
                log.warning("callback %s did not return within %.0f s of the stop signal: abandoned; the run stops", self.running, HANG_S)
            finally:
                self._disarm()
                self.running = None

    def on_run_start(self, info: dict[str, Any]) -> None:
        self._call("on_run_start", info)

    def on_log(self, metrics: dict[str, float], step: int) -> None:
        self._call("on_log", metrics, step)

    def on_eval_end(self, metrics: dict[str, float], step: int) -> None:
        self._call("on_eval_end", metrics, step)

    def on_checkpoint(self, path: str, step: int) -> None:
        self._call("on_checkpoint", path, step)

    def on_run_end(self, metrics: dict[str, Any]) -> None:
        self._call("on_run_end", metrics)


class TensorBoardLogger:
    """Event files under <run dir>/tb. A run resumed at step `resumed_at` first drops the
    events an earlier attempt wrote after that step (TensorBoard's purge_step)."""

    def __init__(self, directory: Path, resumed_at: int = 0):
        from torch.utils.tensorboard import SummaryWriter  # imported here: slow, and rank 0 only

        self.writer = SummaryWriter(str(directory), purge_step=resumed_at + 1 if resumed_at else None)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        self.writer.add_text(tag, text, step)

    def log_images(self, tag: str, images, step: int) -> None:
        self.writer.add_images(tag, images, step)

    def log_layout(self, charts: dict[str, list[str]]) -> None:
        """The Custom Scalars tab: one chart per entry, each plotting the exact tags listed."""
        exact = {title: ["Multiline", [f"^{re.escape(tag)}$" for tag in tags]] for title, tags in charts.items()}
        self.writer.add_custom_scalars({"saturate": exact})

    def log_hparams(self, params: dict[str, Any], metrics: dict[str, float], varied: Collection[str] = ()) -> None:
        """The experiment (columns in the order given, metrics too) and this run's session.
        TensorBoard sorts the columns by (not differs, name) and ticks the first few: the
        `varied` ones are marked as differing, so a sweep's keys come first."""
        from tensorboard.plugins.hparams import plugin_data_pb2
        from torch.utils.tensorboard.summary import hparams

        experiment, session_start, session_end = hparams(params, metrics)
        stored = experiment.value[0].metadata.plugin_data
        data = plugin_data_pb2.HParamsPluginData.FromString(stored.content)
        for info in data.experiment.hparam_infos:
            info.differs = info.name in varied
        stored.content = data.SerializeToString()
        for summary in (experiment, session_start, session_end):
            self.writer.file_writer.add_summary(summary)

    def close(self) -> None:
        self.writer.close()


class CSVLogger:
    """<run dir>/metrics.csv, one row per logged value: `step,name,value` (long format:
    appendable as metrics come and go; `pandas.read_csv(...).pivot(index="step",
    columns="name", values="value")` gives one column per metric). A run resumed at step
    `resumed_at` keeps the rows up to that step and drops the rest."""

    def __init__(self, path: Path, resumed_at: int = 0):
        self.path = path
        kept = []
        if resumed_at and path.is_file():
            with open(path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["step"]) <= resumed_at]
        self.file = open(path, "w", newline="")  # noqa: SIM115 (open for the whole run)
        self.writer = csv.writer(self.file)
        self.writer.writerow(["step", "name", "value"])
        self.writer.writerows([r["step"], r["name"], r["value"]] for r in kept)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.writer.writerows([step, name, repr(float(value))] for name, value in metrics.items() if isinstance(value, (int, float)))
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def builtin_logger(name: str, run_dir: Path, resumed_at: int):
    if name == "tensorboard":
        return TensorBoardLogger(run_dir / "tb", resumed_at)
    return CSVLogger(run_dir / "metrics.csv", resumed_at)
