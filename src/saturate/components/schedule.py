"""The learning rate over a run, as one object the loop steps without asking what it is.

Two kinds, with the same calls:

- the built-in schedule (`optim.schedule`): a linear warm-up from `optim.warmup_start_factor`
  x the LR, then constant or cosine (to `optim.min_lr_ratio` at `optim.decay_steps`, else at
  the run's end), one factor per optimizer step (a LambdaLR);
- any torch.optim.lr_scheduler class (`optim.scheduler`, a `_partial_: true` node called with
  the optimizer), stepped after every optimizer step or at every epoch's end as
  `optim.scheduler_interval` says; `ReduceLROnPlateau` at every evaluation, fed the monitored
  metric. The warm-up (`optim.warmup_steps`, or `optim.warmup_epochs` in steps) multiplies its
  LR over the first steps, without the scheduler seeing the product (a scheduler that reads the
  current LR reads its own).

The loop calls `step()` after each optimizer step that moved the weights, `epoch_done()`
after each epoch and `evaluated(metrics)` after each evaluation. Its state (the scheduler's,
the warm-up's position) is checkpointed with `state_dict()`.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

from saturate.errors import UserError


class ScheduleError(UserError):
    """optim.scheduler raised at a step, or set a learning rate that is negative or not finite."""


class Schedule:
    def __init__(
        self,
        optimizer,
        inner,
        *,
        interval: str = "step",
        warmup_steps: int = 0,
        warmup_start: float = 0.1,
        monitor: str | None = None,
    ):
        """`inner`: the torch scheduler; `interval`: "step", "epoch" (ReduceLROnPlateau: at each
        evaluation, whatever it says); `warmup_steps`: the warm-up's length on top of it, from
        `warmup_start` x its LR (the built-in schedule has its warm-up in its factor: 0 here);
        `monitor`: the metric a plateau rule reads."""
        self.optimizer, self.inner, self.warmup_steps, self.monitor = optimizer, inner, warmup_steps, monitor
        self.warmup_start = warmup_start
        self.plateau = isinstance(inner, ReduceLROnPlateau)
        self.interval = "evaluation" if self.plateau else interval
        self.steps = 0  # optimizer steps taken (the warm-up's position)
        self.own = [group["lr"] for group in optimizer.param_groups]  # the scheduler's LR, before the warm-up
        self.base = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]  # where it started
        self._apply()

    @property
    def base_lrs(self) -> list[float]:
        """The LRs the schedule starts from (what a changed optim.optimizer.lr changes)."""
        return list(getattr(self.inner, "base_lrs", None) or self.base)

    # -- the loop's calls

    def step(self) -> None:
        self.steps += 1
        if self.interval == "step":
            self._inner_step()
        else:
            self._apply()

    def epoch_done(self) -> None:
        if self.interval == "epoch":
            self._inner_step()

    def evaluated(self, metrics: dict[str, float]) -> None:
        if self.plateau and self.monitor in metrics:
            self._inner_step(metrics[self.monitor])

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    # -- the warm-up on top of the scheduler

    def warmup_factor(self) -> float:
        if self.steps >= self.warmup_steps:
            return 1.0
        return self.warmup_start + (1 - self.warmup_start) * self.steps / self.warmup_steps

    def _inner_step(self, *value: float) -> None:
        """The scheduler's step, guarded as the optimizer's is: an exception from it, or a
        learning rate it sets that is negative or not finite, is a ScheduleError, the LRs left
        as they were (the loop saves the run at its last finished step)."""
        before = self.own
        for group, lr in zip(self.optimizer.param_groups, self.own, strict=True):
            group["lr"] = lr  # the scheduler reads and writes its own LR, not the warmed-up one
        name = type(self.inner).__name__
        try:
            self.inner.step(*value)
        except Exception as e:  # noqa: BLE001 (the user's scheduler and its arguments: one line)
            self._apply()
            said = " ".join(str(e).split())[:300]
            raise ScheduleError(
                f"optim.scheduler: {name} failed at step {self.steps}: {type(e).__name__}: {said}"
            ) from None
        self.own = [group["lr"] for group in self.optimizer.param_groups]
        bad = next((lr for lr in self.own if isinstance(lr, (int, float)) and not 0 <= lr < math.inf), None)
        if bad is not None:
            self.own = before
            self._apply()
            what = "a negative" if bad < 0 else "a non-finite"
            raise ScheduleError(
                f"optim.scheduler: {name} set {what} learning rate ({bad:g}) at step {self.steps}; a learning rate is "
                "finite and >= 0: check its arguments"
            )
        self._apply()

    def _apply(self) -> None:
        factor = self.warmup_factor()
        for group, lr in zip(self.optimizer.param_groups, self.own, strict=True):
            group["lr"] = lr * factor

    # -- requests from outside the loop

    def scale(self, factor: float) -> None:
        """Multiply the LR by `factor` from now on, the schedule's base with it (so warm-up and
        decay keep their shape): a callback's request (saturate.callbacks.Run.scale_lr)."""
        if hasattr(self.inner, "base_lrs"):
            self.inner.base_lrs = [lr * factor for lr in self.inner.base_lrs]
        for group in self.optimizer.param_groups:
            if "initial_lr" in group:
                group["initial_lr"] *= factor
        self.own = [lr * factor for lr in self.own]
        self.base = [lr * factor for lr in self.base]
        self._apply()
        if hasattr(self.inner, "_last_lr"):
            self.inner._last_lr = list(self.own)

    def rebase(self, base_lrs: list[float]) -> None:
        """Start from other base LRs at the position reached (a resumed run whose config
        changed the optimizer's LR): the built-in schedule recomputes its LR now, a torch
        scheduler's LR moves by the same ratio."""
        old = self.base_lrs
        if isinstance(self.inner, LambdaLR):
            self.inner.base_lrs = list(base_lrs)
            at = self.inner.last_epoch
            self.own = [base * fn(at) for base, fn in zip(base_lrs, self.inner.lr_lambdas, strict=True)]
        else:
            if hasattr(self.inner, "base_lrs"):
                self.inner.base_lrs = list(base_lrs)
            self.own = [lr * new / was if was else new for lr, new, was in zip(self.own, base_lrs, old, strict=True)]
        for group, base in zip(self.optimizer.param_groups, base_lrs, strict=True):
            group["initial_lr"] = base
        self.base = list(base_lrs)
        self._apply()
        if hasattr(self.inner, "_last_lr"):
            self.inner._last_lr = list(self.own)

    # -- checkpoints

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "own": list(self.own), "steps": self.steps, "base": list(self.base)}

    def load_state_dict(self, state: dict) -> None:
        if "inner" not in state:  # a checkpoint written before this object: the LambdaLR's own state
            self.inner.load_state_dict(state)
            self.own = [group["lr"] for group in self.optimizer.param_groups]
            self.steps = self.warmup_steps
            return
        self.inner.load_state_dict(state["inner"])
        self.own, self.steps = list(state["own"]), int(state["steps"])
        self.base = list(state.get("base", self.base))
        self._apply()


def is_scheduler(obj) -> bool:
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, ReduceLROnPlateau))
