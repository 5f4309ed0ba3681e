"""The step the run trains with, built from its config: the one-optimizer step
(saturate.trainer.build.make_step), or that of a task that takes its own steps with several
optimizers (optim.optimizers: saturate.loop.manual)."""

from __future__ import annotations

import torch

from saturate.components.optimizers import Optimizers
from saturate.config.schema import RunConfig
from saturate.errors import UserError
from saturate.loop.faults import NonFiniteGuard
from saturate.loop.manual import ManualStep
from saturate.loop.step import TrainStep
from saturate.scale.distributed import Dist
from saturate.trainer.build import Parts, make_step


def train_step(run: RunConfig, parts: Parts, device: torch.device, dist: Dist) -> TrainStep:
    if isinstance(parts.optimizer, Optimizers):
        return manual_step(run, parts, device, dist)
    return make_step(run, parts.models, parts.optimizer, parts.precision, parts.task, device, dist)


def manual_step(run: RunConfig, parts: Parts, device: torch.device, dist: Dist) -> ManualStep:
    """The step of a task that takes its own steps (optim.optimizers): the guard, clipping and
    precision of a one-optimizer step, per optimizer; one process."""
    if dist.world_size > 1:
        raise UserError(
            f"optim.optimizers: one process (this run has {dist.world_size}); a task's own steps are not synchronised "
            "across ranks: trainer.devices=1"
        )
    guard = NonFiniteGuard(
        skip=run.trainer.skip_nonfinite,
        check_grads=not parts.precision.scaler.is_enabled(),
        max_consecutive=run.trainer.max_nonfinite_steps,
        device=device,
    )
    return ManualStep(
        parts.models.train,
        parts.optimizer,
        parts.scheduler,
        parts.precision,
        guard,
        training_step=parts.task.training_step,  # type: ignore[attr-defined]  # checked when the optimizers were built
        grad_clip=run.trainer.grad_clip,
    )
