"""The observer protocol: what a callback or a logger may implement, and the `Run` it sees.

Every hook is optional: an object with any of these methods is a callback (or a logger; the
two differ only in where they run: callbacks on every rank, loggers on rank 0). Hooks get
the `Run` first. A hook sees device tensors only where the loop has them (`loss` at
`on_train_batch_end`): reading one (`.item()`) would make the host wait for the device
every step, which is the one thing saturate is built to avoid.

A callback may steer the run only through the requests `Run` offers: ask it to stop
(`run.request_stop(reason)`: the run ends at the next step boundary or evaluation, as a
success, with last.pt and best.pt, and the reason in the log, metrics.json and the report),
scale the learning rate (`run.scale_lr(factor)`), or have another model evaluated and
checkpointed as the run's weights (`run.eval_model`, e.g. an average of the weights). A
callback with `state_dict()`/`load_state_dict()` has its state saved in every checkpoint and
restored on resume, so a resumed run behaves as an uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from saturate import names
from saturate.errors import ConfigError, Problem, is_number

if TYPE_CHECKING:  # this module is the protocol, light to import: torch only for the types
    import torch
    from torch import nn


@dataclass(frozen=True)
class Plan:
    """What a run is set to do, as its callbacks read it."""

    run_dir: Path
    monitor: str = names.VAL_LOSS  # checkpoint.monitor, resolved
    mode: str = "min"  # its direction: max or min
    total_steps: int = 0
    rank: int = 0
    world_size: int = 1
    # data, model, task: names, for the record; name, app, sweep: how trackers name the run
    # (saturate.config.naming.identity)
    info: dict[str, Any] = field(default_factory=dict)


class Run:
    """What a callback sees of the run, and the requests it may make. Built by the run from
    its plan, the objects it trains with, and where the loop is (`position`: its `step` and
    `epoch`, which the loop keeps current; `timer`: the step timer's steady-state windows,
    saturate.diagnostics.timing.StepTimer, read-only)."""

    def __init__(
        self,
        plan: Plan,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        position: Any,
        timer: Any = None,
        lr_scale: float = 1.0,
        direction: Callable[[str], str] | None = None,
    ):
        self.run_dir, self.monitor, self.mode = Path(plan.run_dir), plan.monitor, plan.mode
        self.total_steps, self.rank, self.world_size = plan.total_steps, plan.rank, plan.world_size
        self.info = dict(plan.info)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.position, self.timer = position, timer
        self.start_step = position.step  # where this attempt started (a resumed run: its checkpoint's step)
        self._direction = direction or (lambda name: "min" if name.endswith("loss") else "max")
        self.metrics: dict[str, float] = {}  # the latest logged value of every metric
        self.eval_model = model  # what is evaluated and saved as the run's weights (a callback may set an average)
        self.stop_reason: str | None = None
        self.lr_scale = lr_scale  # the product of scale_lr's factors (saved in checkpoints, so a resumed run keeps it)

    @property
    def step(self) -> int:
        """Training steps completed."""
        return self.position.step

    @property
    def epoch(self) -> int:
        """Epochs completed."""
        return self.position.epoch

    def direction(self, metric: str) -> str:
        """Which way `metric` (e.g. "val/acc") improves: "max" or "min", as the task says."""
        return self._direction(metric)

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes the run dir."""
        return self.rank == 0

    def request_stop(self, reason: str) -> None:
        """End the run at the next step boundary or evaluation, as a success (last.pt and
        best.pt saved); under DDP every rank stops at the same point. The first reason given
        is the one recorded."""
        if self.stop_reason is None:
            self.stop_reason = str(reason)

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rate by `factor` (finite, >= 0) from the next step on (the
        schedule's base rates with it, so warm-up and cosine keep their shape); kept across a resume."""
        if not is_number(factor, 0, math.inf, open_high=True):
            raise ValueError(
                f"run.scale_lr({factor!r}): expected a finite factor >= 0 (a negative one climbs the loss)"
            )
        self.lr_scale *= factor
        self.scheduler.scale(factor)

    @property
    def eval_model(self) -> nn.Module:
        """What is evaluated and saved as the run's weights (a callback may set an average)."""
        return self._eval_model

    @eval_model.setter
    def eval_model(self, model: nn.Module) -> None:
        import torch  # here: this module is the protocol, light to import

        if not isinstance(model, torch.nn.Module):
            shown = repr(model) if len(repr(model)) < 60 else type(model).__name__
            raise TypeError(
                f"run.eval_model={shown}: expected a torch.nn.Module (the model, or an average of its weights)"
            )
        self._eval_model = model

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


class Callback:
    """The hooks, with what they receive. Subclassing is optional: any object with some of
    these methods works. The run calls them in this order: on_run_start; then per step
    on_train_batch_end and on_after_optimizer_step; on_log at log steps; on_eval_end after
    each evaluation; on_checkpoint after each save; on_run_end last (also after a failure or
    a stop, with the status in the metrics)."""

    def on_run_start(self, run: Run) -> None:
        """After set-up, before the first step (run.step is where a resumed run continues)."""

    def on_train_batch_end(self, run: Run, loss: torch.Tensor) -> None:
        """After each training step: `loss` is the step's loss on the device (do not read it)."""

    def on_after_optimizer_step(self, run: Run) -> None:
        """After each step's optimizer update (weight averaging goes here)."""

    def on_log(self, run: Run, metrics: dict[str, float], step: int) -> None:
        """Metrics to record at `step` (training figures at log steps, evaluations, the final metrics)."""

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        """After each evaluation: val/loss and the task's val/* metrics."""

    def on_checkpoint(self, run: Run, path: str) -> None:
        """After last.pt (and best.pt when it improved) was written, on rank 0."""

    def on_run_end(self, run: Run, metrics: dict[str, Any]) -> None:
        """After the run, whatever ended it: the final metrics, status included."""

    # what loggers record besides metrics
    def on_text(self, run: Run, tag: str, text: str, step: int) -> None:
        """A text (Markdown) to record: the report, the config."""

    def on_images(self, run: Run, tag: str, images: torch.Tensor, step: int) -> None:
        """A batch of images (N, C, H, W) in [0, 1] on the CPU: what the augmentation does."""

    def on_layout(self, run: Run, charts: dict[str, list[str]]) -> None:
        """The overview to open on: {chart title: metric names}."""

    def on_hparams(self, run: Run, params: dict[str, Any], metrics: dict[str, float], varied: list[str]) -> None:
        """This run's settings and final metrics, for comparing runs; `varied`: the settings a sweep varies."""


HOOKS = (
    "on_run_start",
    "on_train_batch_end",
    "on_after_optimizer_step",
    "on_log",
    "on_eval_end",
    "on_checkpoint",
    "on_run_end",
    "on_text",
    "on_images",
    "on_layout",
    "on_hparams",
)


def agreed_mode(run: Run, monitor: str, mode: str, key: str) -> str:
    """`mode` (auto, max or min) for `monitor` as the task's direction says: auto takes it, the
    other direction is refused as checkpoint.mode refuses it (a contradiction, not a choice).
    `key`: the callback's config node, for the message (callbacks.early_stopping)."""
    direction = run.direction(monitor)
    if mode not in ("auto", direction):
        better = "higher" if direction == "max" else "lower"
        allowed = f"{direction} or auto for {key}.monitor={monitor} ({better} is better)"
        raise ConfigError([Problem(f"{key}.mode", mode, allowed)])
    return direction
