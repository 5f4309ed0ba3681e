"""The training loop, and only the loop.

It receives built objects (the model, the step, the schedule, batches, evaluator,
checkpointer, tracker, callbacks, timer, stop signal) and never asks which options built
them. Callbacks see what happened (logged metrics, evaluations, checkpoints); they never
steer the loop. It
touches the host only at log steps (the loss is summed on the device and read there),
apart from the non-finite guard's one scalar per step with an optimizer that cannot skip a
step on the device (not one of torch's fused optimizers: saturate.faults.NonFiniteGuard).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from dataclasses import dataclass

import torch
from torch import nn

from saturate.device import OutOfMemory, free_device_memory, is_oom
from saturate.faults import Preempted
from saturate.step import TrainStep

log = logging.getLogger(__name__)


@contextlib.contextmanager
def closing(*iterators):
    """Close an epoch's batch iterators however the loop leaves them. After an exception
    (a preemption, a failure), its traceback would keep a DataLoader's worker processes
    alive until the garbage collector finds them, and shut down from a reference cycle they
    wait out torch's 5 s join each (measured: 10 s stalls, two workers, in a later test)."""
    try:
        yield
    finally:
        for it in iterators:
            close = getattr(it, "close", None)
            if close is not None:
                close()


@dataclass
class Measured:
    """Stop once the timer holds `seconds` of steady state (every log window after the
    first) over at least `steps` steps, or at `deadline` (a perf_counter time): saturate.tune's
    trials. Checked at log steps, in one process."""

    seconds: float
    steps: int
    deadline: float = float("inf")

    def reached(self, timer) -> bool:
        enough = timer.rest.wall_s >= self.seconds and timer.rest.steps >= self.steps
        return enough or time.perf_counter() >= self.deadline


@dataclass
class TrainState:
    epoch: int = 0  # epochs completed
    step: int = 0  # training steps completed (batches trained on)
    batch_in_epoch: int = 0  # batches of epoch `epoch` already trained on


class Engine:
    def __init__(self, *, model: nn.Module, step: TrainStep, scheduler, train_batches, evaluator, checkpointer, tracker, callbacks,
                 timer, stop, monitor, profiler, memory, dist, max_epochs: int, max_steps: int, start_time: float,
                 resume_hint: str = "trainer.resume=auto", measured: Measured | None = None):  # fmt: skip
        self.model, self.step, self.scheduler, self.guard = model, step, scheduler, step.guard
        self.train_batches, self.evaluator, self.checkpointer, self.callbacks = train_batches, evaluator, checkpointer, callbacks
        self.tracker, self.timer, self.stop, self.memory = tracker, timer, stop, memory
        self.monitor, self.profiler, self.dist = monitor, profiler, dist
        self.max_epochs, self.max_steps, self.start_time = max_epochs, max_steps, start_time
        self.resume_hint = resume_hint  # the command that resumes this run, for the messages that stop it
        self.measured, self.measured_enough = measured, False  # a tuning trial: stop once measured
        self.loss_sum = torch.zeros((), device=next(model.parameters()).device)  # summed on the device, read at log steps
        self.loss_count = 0
        self._counts: dict[str, float] = {}  # the flat counters' last logged values
        self.batch: tuple | None = None  # the last device batch (a reference: what a failed guard looks at)

    def finished(self, state: TrainState) -> bool:
        """Whether `state` is already at max_epochs or max_steps (a finished run resumed)."""
        return state.epoch >= self.max_epochs or 0 < self.max_steps <= state.step or self.measured_enough

    def fit(self, state: TrainState) -> dict[str, float]:
        """Train from `state` to max_epochs (or max_steps); return the last metrics."""
        steps_per_epoch = len(self.train_batches)
        if self.finished(state):
            return dict(self.tracker.latest)
        while True:
            self.model.train()
            epoch_start, evaluated = time.perf_counter(), {}
            batches = self.train_batches.epoch(state.epoch, start=state.batch_in_epoch)
            fetched = self.timer.fetch(batches)
            with closing(fetched, batches):  # however the epoch is left
                self.train_epoch(fetched, state, steps_per_epoch)
            if state.batch_in_epoch >= steps_per_epoch:
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            last = self.finished(state)
            self.log_train(state, steps_per_epoch)  # closes the timing window before evaluation
            if self.evaluator.due(state.epoch, last):
                evaluated = self.evaluator.run(interrupted=self.interrupted)
                if evaluated is None:
                    self.halt(state, steps_per_epoch)  # saves, then raises Preempted
                self.tracker.log(evaluated, state.step)
                self.callbacks.on_eval_end(evaluated, state.step)
            if self.checkpointer.due(state.epoch, last):
                self.save(state, self.tracker.latest)
            self.tracker.progress(state.step, state.epoch)
            self.epoch_line(state, evaluated, time.perf_counter() - epoch_start)
            if last:
                return dict(self.tracker.latest)

    def train_epoch(self, batches, state: TrainState, steps_per_epoch: int) -> None:
        """Train on the epoch's batches, from where `state` is, until they run out or a stop
        rule (max_steps, a measured trial) says so; a stop signal or a failed guard raises."""
        for batch in batches:
            with self.timer.phase("copy"):
                x, y = self.batch = self.to_device(batch, state.step + 1)
            with self.timer.phase("compute"):
                loss, applied, stepped = self.step(x, y, state.step + 1)
                if stepped:  # a step not taken (non-finite, fp16 overflow) keeps the LR where it is
                    self.scheduler.step()
            self.loss_sum += loss
            self.loss_count += applied
            self.timer.step_done(len(y))
            self.profiler.step()
            state.step += 1
            state.batch_in_epoch += 1
            if self.tracker.due(state.step):
                self.log_train(state, steps_per_epoch)
                self.measured_enough = self.measured is not None and self.measured.reached(self.timer)
            if self.checkpointer.due_step(state.step):
                self.save(state, self.tracker.latest)
            if self.halting(state.step):
                self.halt(state, steps_per_epoch)
            if 0 < self.max_steps <= state.step or self.measured_enough:
                return

    def to_device(self, batch, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch on the device, augmented and normalised; running out of memory here is
        a clear error (the step's own out-of-memory is recovered in smaller micro-batches)."""
        try:
            return self.train_batches.to_device(batch)
        except Exception as e:
            if not is_oom(e):
                raise
            free_device_memory()
            raise OutOfMemory(f"out of memory at step {step} copying the batch to the device and preparing it (augmentation, "
                              "normalisation), before the model ran: lower loader.batch_size") from None  # fmt: skip

    def log_train(self, state: TrainState, steps_per_epoch: int) -> None:
        """The one place the loop waits for the device: at log steps and epoch ends. Across
        ranks the loss and timings are averaged (samples/s summed) before they are logged."""
        window = self.timer.flush()
        if window is None:
            return
        self.guard.read()
        count = int(self.loss_count)  # steps applied (a device count when steps decide on the device)
        train_loss = self.loss_sum.item() / count if count else float("nan")
        shared = self.dist.mean({"train/loss": train_loss, **window.metrics()}, sum_keys=("perf/samples_per_s",))
        metrics = {
            **shared,
            "train/lr": self.scheduler.get_last_lr()[0],
            "progress/epoch": state.epoch + state.batch_in_epoch / steps_per_epoch,
            "progress/step": state.step,
            "memory/peak_mb": self.memory(),
            "time/wall_s": time.perf_counter() - self.start_time,
            **self.monitor.window(),  # gpu/*, cpu/*: averages of the samples in this window
            **self.changed_counts(),
        }
        self.loss_sum.zero_()
        self.loss_count = 0
        self._counts: dict[str, float] = {}  # the flat counters' last logged values
        self.tracker.log(metrics, state.step)
        self.callbacks.on_log(metrics, state.step)
        self.tracker.progress(state.step, state.epoch)

    def epoch_line(self, state: TrainState, evaluated: dict[str, float], seconds: float) -> None:
        """One line per epoch in the console and train.log, terminal or not (nohup, a
        scheduler's log, a pipe): where the run is, its losses and metrics, its speed."""
        if not self.dist.is_main:
            return
        latest = self.tracker.latest
        figures = [f"{k} {v:.4f}" for k, v in (("train/loss", latest.get("train/loss")), *evaluated.items()) if v is not None]
        speed = latest.get("perf/samples_per_s")
        log.info("epoch %d/%d, step %d: %s%s, %.1f s", state.epoch, self.max_epochs, state.step, ", ".join(figures),
                 f", {speed:,.0f} samples/s" if speed else "", seconds)  # fmt: skip

    def changed_counts(self) -> dict[str, float]:
        """Counters that are flat in a healthy run (non-finite steps, micro-batches per
        batch): logged at the first log step and then only when they change, so they do not
        clutter TensorBoard's train group with straight lines."""
        counts = {"train/nonfinite_steps": self.guard.count, "train/micro_batches": self.step.micro_batches}
        changed = {k: v for k, v in counts.items() if self._counts.get(k) != v}
        self._counts.update(changed)
        return changed

    def save(self, state: TrainState, metrics: dict[str, float]) -> float:
        seconds = self.checkpointer.save(state, metrics)
        if self.dist.is_main:
            self.callbacks.on_checkpoint(str(self.checkpointer.last_path), state.step)
        return seconds

    def interrupted(self) -> bool:
        """A preemption signal during evaluation, in one process. (Across ranks the flag is
        agreed at log steps; ranks evaluate different numbers of batches, so a collective
        between them cannot be placed inside evaluation.)"""
        return self.stop.requested is not None and self.dist.world_size == 1

    def halting(self, step: int) -> bool:
        """Whether to stop at this step boundary. Across ranks they must stop together, so the
        flags are agreed (a small collective) every `dist.check_every` steps, the log interval;
        in one process, every step."""
        if step % self.dist.check_every:
            return False
        return self.dist.any(self.stop.requested is not None or self.guard.failed)

    def nonfinite_data(self) -> str | None:
        """Which part of the last batch holds NaN or inf ("inputs", "targets"), if any: then the
        data, not the learning rate, made the steps non-finite. One host read, as the run stops."""
        if self.batch is None:
            return None
        for name, part in zip(("inputs", "targets"), self.batch, strict=False):
            if isinstance(part, torch.Tensor) and part.is_floating_point() and not bool(torch.isfinite(part).all()):
                return name
        return None

    def halt(self, state: TrainState, steps_per_epoch: int) -> None:
        """Stop at this step boundary: a preemption signal saves last.pt and exits; too many
        non-finite steps fail the run, pointing at the last good state."""
        self.log_train(state, steps_per_epoch)
        if self.dist.any(self.guard.failed):
            if self.guard.skip:  # every bad step was skipped: the weights are the last good state
                self.save(state, {})
            self.dist.barrier()  # no rank leaves before rank 0 has saved
            raise self.guard.error(state.step, self.checkpointer.last_good(), self.resume_hint, data=self.nonfinite_data())
        seconds = self.save(state, {})
        self.dist.barrier()  # torchrun kills the others as soon as one rank exits
        signum = self.stop.requested or signal.SIGTERM  # a rank that heard nothing follows the others
        name = signal.Signals(signum).name
        if self.dist.is_main:
            log.warning("%s at step %d (epoch %d, batch %d): saved %s in %.2fs; resume with: %s", name, state.step, state.epoch,
                        state.batch_in_epoch, self.checkpointer.last_path, seconds, self.resume_hint)  # fmt: skip
        raise Preempted(signum)
