"""A task that takes its own steps with several optimizers (optim.optimizers): a GAN's
alternating discriminator and generator updates, read as in the author's loop.

The loop calls `task.training_step(model, batch, optimizers)` once per batch, under the
precision's autocast; the task computes its losses and takes each step through `optimizers`
(a `Steps`), which keeps every guarantee of a one-optimizer step:

- `optimizers.backward(loss)`: the backward pass with mixed precision's loss scaling (fp16);
- `optimizers.step(name)`: that optimizer's gradients unscaled, their norm clipped
  (trainer.grad_clip), the non-finite guard (a NaN or inf loss or gradient skips that step
  alone, counted as any skipped step), the step, its schedule's step, its gradients zeroed;
- `optimizers.zero_grad(name)`, and `optimizers[name]`: the torch optimizer itself.

It returns the batch's loss (a 0-d tensor), logged as train/loss. Evaluation, saturate's
start-up check and its cost probes call the task's `forward` only: nothing is stepped there.
No micro-batches (trainer.accumulate), no out-of-memory retry, one process: refused at
start-up for such a run.
"""

from __future__ import annotations

import math

import torch

from saturate.components.device import OutOfMemory, free_device_memory, is_oom
from saturate.errors import UserError
from saturate.loop.step import Buffers, TrainStep


class Steps:
    """What a task's training_step takes its steps with (see the module)."""

    def __init__(self, optimizers, schedules, precision, guard, grad_clip: float):
        self.optimizers, self.schedules, self.precision, self.guard = optimizers, schedules, precision, guard
        self.max_norm = grad_clip if grad_clip > 0 else math.inf
        self.at, self.applied = 0, True
        self.loss: torch.Tensor | None = None  # the losses backpropagated since the last step: what the guard judges

    def begin(self, step: int) -> None:
        self.at, self.applied, self.loss = step, True, None

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self.optimizers[self._known(name)]

    def names(self) -> list[str]:
        return list(self.optimizers.named)

    def zero_grad(self, name: str | None = None) -> None:
        for one in [self._known(name)] if name is not None else self.names():
            self.optimizers[one].zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()  # what the guard judges
        self.precision.scaler.scale(loss).backward()

    def step(self, name: str) -> bool:
        """Step optimizer `name` (see the module); whether the step was taken."""
        optimizer = self.optimizers[self._known(name)]
        params = self.optimizers.params[name]
        if self.precision.scaler.is_enabled():
            self.precision.scaler.unscale_(optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if self.max_norm != math.inf:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm)
        loss = self.loss if self.loss is not None else norm
        applied = self.guard.ok(loss, norm, self.at)
        if self.precision.step(optimizer, applied):
            self.schedules.named[name].step()
        optimizer.zero_grad(set_to_none=True)
        self.loss = None  # the next step's losses are its own
        self.applied = self.applied and applied
        return applied

    def _known(self, name: str) -> str:
        if name not in self.optimizers.named:
            raise UserError(
                f"task: training_step asked for optimizer {name!r}; optim.optimizers has {', '.join(self.names())}"
            )
        return name


def _no_loss(model, batch) -> torch.Tensor:
    raise AssertionError("a task's own steps compute their losses in training_step")  # never called


class ManualStep(TrainStep):
    """One batch trained by the task's own training_step, with the loop's interface (the
    engine sees a step as it sees a TrainStep's)."""

    def __init__(self, model, optimizers, schedules, precision, guard, *, training_step, grad_clip: float, dist=None):
        super().__init__(
            model, optimizers, precision, guard, loss=_no_loss, grad_clip=grad_clip, recover_oom=False, dist=dist
        )
        self.buffers = Buffers([])  # a skipped step is one optimizer's: the others' steps stand
        self.guard.on_device = self.on_device = False
        self.update_reads = guard.skip
        self.training_step = training_step
        self.steps = Steps(optimizers, schedules, precision, guard, grad_clip)

    def __call__(self, batch, step: int) -> tuple[torch.Tensor, bool, bool]:
        """(the batch's loss, whether every step the task took was applied, False: each
        schedule stepped with its own optimizer)."""
        self.steps.begin(step)
        try:
            with self.precision.autocast():
                loss = self.training_step(self.model, batch, self.steps)
        except Exception as e:
            if not is_oom(e):
                raise
            self.steps.zero_grad()
            free_device_memory()
            raise OutOfMemory(
                f"out of memory at step {step} in the task's training_step (several optimizers: no retry in smaller "
                "micro-batches); lower loader.batch_size"
            ) from None
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            what = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserError(f"task: training_step returned {what}; it returns the batch's loss, one number")
        loss = loss.detach().float().reshape(())
        return (loss if self.steps.applied else torch.zeros_like(loss)), self.steps.applied, False
