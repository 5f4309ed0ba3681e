"""Lower the learning rate when the monitored metric stops improving: torch's
ReduceLROnPlateau (factor, patience, threshold, cooldown, min_lr) deciding when, applied as a
scale on the run's schedule (so warm-up and cosine keep their shape), through saturate's
public callback protocol. Counted in evaluations.

    python train.py optim.schedule=constant callbacks=[plateau] callbacks.plateau.patience=2
"""

from __future__ import annotations

import torch

from saturate.callbacks.base import agreed_mode
from saturate.errors import ConfigError, Problem, is_integer, is_number


class Plateau:
    def __init__(
        self,
        monitor: str = "auto",
        mode: str = "auto",
        factor: float = 0.1,
        patience: int = 2,
        threshold: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
    ):
        problems = []
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor < 1:
            problems.append(Problem("callbacks.plateau.factor", factor, "a number in (0, 1)"))
        for key, value in (("patience", patience), ("cooldown", cooldown)):
            if not is_integer(value, 0):
                problems.append(Problem(f"callbacks.plateau.{key}", value, "an integer >= 0 (evaluations)"))
        if not is_number(min_lr, 0):
            problems.append(Problem("callbacks.plateau.min_lr", min_lr, "a number >= 0"))
        if mode not in ("auto", "max", "min"):
            problems.append(Problem("callbacks.plateau.mode", mode, "auto, max or min"))
        if problems:
            raise ConfigError(problems)
        self.monitor, self.mode, self.factor, self.patience = monitor, mode, float(factor), patience
        self.threshold, self.cooldown, self.min_lr = float(threshold), cooldown, float(min_lr)
        # torch's rule, on a stand-in optimizer whose only "lr" is the scale
        self.rule: torch.optim.lr_scheduler.ReduceLROnPlateau | None = None
        self._pending: dict | None = None  # its state, restored before the run started

    def on_run_start(self, run) -> None:
        if self.monitor == "auto":
            self.monitor = run.monitor
        self.mode = agreed_mode(run, self.monitor, self.mode, "callbacks.plateau")
        base = max(run.scheduler.base_lrs)
        scale = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        self.rule = torch.optim.lr_scheduler.ReduceLROnPlateau(
            scale,
            mode="max" if self.mode == "max" else "min",
            factor=self.factor,
            patience=self.patience,
            threshold=self.threshold,
            cooldown=self.cooldown,
            min_lr=self.min_lr / base if base else 0.0,
        )
        if self._pending is not None:  # restored before the run started
            self.rule.load_state_dict(self._pending)
            self._pending = None

    @property
    def scale(self) -> float:
        assert self.rule is not None, "plateau: made when the run starts"
        return self.rule.optimizer.param_groups[0]["lr"]

    def on_eval_end(self, run, metrics: dict[str, float]) -> None:
        value = metrics.get(self.monitor.removeprefix("val/"), metrics.get(self.monitor))
        if value is None:
            raise KeyError(
                f"plateau: {self.monitor} is not among the evaluation's metrics ({', '.join(sorted(metrics))})"
            )
        before = self.scale
        assert self.rule is not None
        self.rule.step(value)
        if self.scale < before:
            run.scale_lr(self.scale / before)

    def state_dict(self) -> dict:
        return self.rule.state_dict() if self.rule is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self._pending = state  # the rule is made at on_run_start, after the checkpoint is read
