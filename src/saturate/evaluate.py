"""Validation: the task's loss and metrics over the whole validation set, never augmented.

Metrics are torchmetrics objects: their states accumulate on the device (no host read per
batch) and `compute()` sums them across DDP ranks, each rank having seen its own unpadded
shard. The loss is averaged per sample."""

from __future__ import annotations

import torch
from torch import nn
from torchmetrics import MeanMetric

from saturate.precision import Precision
from saturate.task import Task


class Evaluator:
    def __init__(self, model: nn.Module, batches, precision: Precision, task: Task, *, interval: int):
        self.model, self.batches, self.precision, self.task, self.interval = model, batches, precision, task, interval

    def due(self, epoch: int, last: bool) -> bool:
        """After every `interval`-th epoch, and always after the last (never without a
        validation set)."""
        return self.batches is not None and (last or epoch % self.interval == 0)

    @torch.inference_mode()
    def run(self, interrupted=lambda: False) -> dict[str, float] | None:
        """The metrics, or None when `interrupted()` turned true between two batches (a
        preemption signal during a long evaluation: the caller saves and stops)."""
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        metrics = self.task.metrics(device)
        loss = MeanMetric().to(device)
        for batch in self.batches.epoch(0):  # this rank's shard of the validation set, unpadded
            if interrupted():
                self.model.train(was_training)
                return None
            x, y = self.batches.to_device(batch)
            with self.precision.autocast():  # the loss too, as in the step (autocast computes it in fp32)
                outputs = self.model(x)
                loss.update(self.task.loss(outputs, y), weight=len(y))
            metrics.update(*self.task.prepare(outputs, y))
        self.model.train(was_training)
        return {"val/loss": float(loss.compute()), **{k: float(v) for k, v in metrics.compute().items()}}
