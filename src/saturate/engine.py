"""The training loop, and only the loop.

It receives built objects (model, optimizer, precision policy, batches, evaluator,
checkpointer, tracker, timer) and never asks which options built them. Per step it touches
the host only at log steps: the loss is summed on the device and read there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TrainState:
    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps completed
    batch_in_epoch: int = 0  # batches of epoch `epoch` already trained on


class Engine:
    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer,
        scheduler,
        precision,
        train_batches,
        evaluator,
        checkpointer,
        tracker,
        timer,
        memory,
        max_epochs: int,
        max_steps: int,
        grad_clip: float,
        start_time: float,
    ):
        self.model, self.optimizer, self.scheduler, self.precision = model, optimizer, scheduler, precision
        self.train_batches, self.evaluator, self.checkpointer = train_batches, evaluator, checkpointer
        self.tracker, self.timer, self.memory = tracker, timer, memory
        self.max_epochs, self.max_steps, self.start_time = max_epochs, max_steps, start_time
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.max_norm = grad_clip if grad_clip > 0 else float("inf")  # inf: measure, never clip
        device = self.params[0].device
        self.loss_sum = torch.zeros((), device=device)  # summed on the device, read at log steps
        self.loss_count = 0

    def fit(self, state: TrainState) -> dict[str, float]:
        """Train from `state` to max_epochs (or max_steps); return the last metrics."""
        steps_per_epoch = len(self.train_batches)
        while True:
            self.model.train()
            batches = self.train_batches.epoch(state.epoch, start=state.batch_in_epoch)
            for batch in self.timer.fetch(batches):
                with self.timer.phase("copy"):
                    x, y = self.train_batches.to_device(batch)
                with self.timer.phase("compute"):
                    self.loss_sum += self.train_step(x, y)
                self.loss_count += 1
                self.timer.step_done(len(y))
                state.step += 1
                state.batch_in_epoch += 1
                if self.tracker.due(state.step):
                    self.log_train(state, steps_per_epoch)
                if state.step == self.max_steps:
                    break

            if state.batch_in_epoch >= steps_per_epoch:
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            last = state.epoch >= self.max_epochs or state.step == self.max_steps
            self.log_train(state, steps_per_epoch)  # closes the timing window before evaluation
            if self.evaluator.due(state.epoch, last):
                self.tracker.log(self.evaluator.run(), state.step)
            if self.checkpointer.due(state.epoch, last):
                self.checkpointer.save(state, self.tracker.latest)
            self.tracker.progress(state.step, state.epoch)
            if last:
                return dict(self.tracker.latest)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the batch (x, y); returns the loss, still on the device."""
        with self.precision.autocast():
            loss = F.cross_entropy(self.model(x), y)
        scaler = self.precision.scaler
        scaler.scale(loss).backward()
        scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        scaler.step(self.optimizer)
        scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss.detach()

    def log_train(self, state: TrainState, steps_per_epoch: int) -> None:
        """The one place the loop waits for the device: at log steps and epoch ends."""
        window = self.timer.flush()
        if window is None or self.loss_count == 0:
            return
        metrics = {
            "train/loss": self.loss_sum.item() / self.loss_count,
            "train/lr": self.scheduler.get_last_lr()[0],
            "progress/epoch": state.epoch + state.batch_in_epoch / steps_per_epoch,
            "progress/step": state.step,
            "memory/peak_mb": self.memory(),
            "time/wall_s": time.perf_counter() - self.start_time,
            **window.metrics(),
        }
        self.loss_sum.zero_()
        self.loss_count = 0
        self.tracker.log(metrics, state.step)
        self.tracker.progress(state.step, state.epoch)
