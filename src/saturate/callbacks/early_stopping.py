"""Stop a run whose monitored metric has stopped improving: Lightning's EarlyStopping
(monitor, mode, patience, min_delta), counted in evaluations, written against saturate's
public callback protocol. Copy this file to write your own steering callback.

    python train.py callbacks=[early_stopping] callbacks.early_stopping.patience=5
"""

from __future__ import annotations

import math

from saturate.callbacks.base import agreed_mode
from saturate.errors import ConfigError, Problem, is_integer, is_number


class EarlyStopping:
    """`patience` evaluations in a row without an improvement of more than `min_delta` stop
    the run (as a success: last.pt and best.pt are saved). `monitor`/`mode` default to
    checkpoint.monitor and its direction. A non-finite value never counts as an improvement.
    Its counters are saved in checkpoints: a resumed run stops where an uninterrupted one would."""

    def __init__(self, monitor: str = "auto", mode: str = "auto", patience: int = 3, min_delta: float = 0.0):
        problems = []
        if not is_integer(patience, 1):
            problems.append(Problem("callbacks.early_stopping.patience", patience, "an integer >= 1 (evaluations)"))
        if not is_number(min_delta, 0, math.inf, open_high=True):
            problems.append(Problem("callbacks.early_stopping.min_delta", min_delta, "a number >= 0"))
        if mode not in ("auto", "max", "min"):
            problems.append(Problem("callbacks.early_stopping.mode", mode, "auto, max or min"))
        if problems:
            raise ConfigError(problems)
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0  # evaluations since the last improvement

    def on_run_start(self, run) -> None:
        if self.monitor == "auto":
            self.monitor = run.monitor
        self.mode = agreed_mode(run, self.monitor, self.mode, "callbacks.early_stopping")

    def on_eval_end(self, run, metrics: dict[str, float]) -> None:
        value = metrics.get(self.monitor.removeprefix("val/"), metrics.get(self.monitor))
        if value is None:
            raise KeyError(
                f"early_stopping: {self.monitor} is not among the evaluation's metrics ({', '.join(sorted(metrics))})"
            )
        if math.isfinite(value) and (self.best is None or self._better(value)):
            self.best, self.best_step, self.wait = float(value), run.step, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            best = f"{self.best:.4f} at step {self.best_step}" if self.best is not None else "no finite value"
            run.request_stop(
                f"early stopping: {self.monitor} did not improve by more than {self.min_delta:g} in {self.patience} "
                f"evaluation(s) (best {best})"
            )

    def _better(self, value: float) -> bool:
        assert self.best is not None  # compared once a first finite value is kept
        return value > self.best + self.min_delta if self.mode == "max" else value < self.best - self.min_delta

    def state_dict(self) -> dict:
        return {"monitor": self.monitor, "best": self.best, "best_step": self.best_step, "wait": self.wait}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step, self.wait = state["best"], state["best_step"], state["wait"]
