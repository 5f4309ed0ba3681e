"""The training loop, and only the loop.

It receives built objects, grouped by what they are for: what it trains (`Training`: the
model, the step, the schedule, the batches), the evaluator and the checkpointer, what
measures and records the run (`Instruments`: the tracker with its loggers and progress bar,
the step timer, the resource monitor, the peak-memory reader), the observers (callbacks), the
`Run` they see, and how the run may end (`Limits`: epochs and steps, the stop signal, the
ranks, the target). It never asks
which options built them.

It touches the host only at log steps (the loss is summed on the device and read there),
apart from the non-finite guard's one scalar per step with an optimizer that cannot skip a
step on the device (saturate.loop.faults.NonFiniteGuard). Callbacks steer it only through the
requests the Run offers: a stop (agreed across ranks at the next point where they already
communicate: a stop-flag check at a log step, or the end of an evaluation), a learning-rate
scale, the model to evaluate.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch
from torch import nn

from saturate import names
from saturate.components.device import OutOfMemory, free_device_memory, is_oom
from saturate.components.schedule import ScheduleError
from saturate.loop.faults import Preempted
from saturate.loop.protocols import (
    Batches,
    Checkpoints,
    Clock,
    Evaluation,
    Monitor,
    Observers,
    Ranks,
    RunView,
    Schedule,
    StopRequest,
    Timer,
    Tracker,
)
from saturate.loop.step import TrainStep
from saturate.loop.target import Target

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
class TrainState:
    epoch: int = 0  # epochs completed
    step: int = 0  # training steps completed (batches trained on)
    batch_in_epoch: int = 0  # batches of epoch `epoch` already trained on


@dataclass
class Training:
    """What the loop trains."""

    model: nn.Module  # what the step calls: DDP-wrapped and/or compiled
    step: TrainStep
    scheduler: Schedule
    batches: Batches
    reset: Callable[[str], None] | None = None  # the task's: a training epoch starts (a carried state starts afresh)


@dataclass
class Instruments:
    """What measures and records the run, read at log steps only."""

    tracker: Tracker  # loggers (through the observers), progress bar, latest metrics
    timer: Timer
    monitor: Monitor
    memory: Callable[[], float]  # peak memory in MB
    clock: Clock  # seconds in evaluation, checkpoints, logging


@dataclass
class Limits:
    """How the run may end: its limits, the stop signal, the ranks, and the command that resumes it."""

    max_epochs: int
    max_steps: int
    stop: StopRequest
    dist: Ranks
    start_time: float
    resume_hint: str = "trainer.resume=auto"
    target: Target | None = None  # target.metric and target.value: the time they were met (and maybe a stop)
    origin: float | None = None  # what time/eval_at_s and time/to_target_s count from (None: start_time)


@dataclass
class Summary:
    """What the loop reports once it ends: the latest value of every metric it logged, the
    counters, the steady state's figures (averaged over the ranks, samples/s summed), the
    resources it used and where its time went, and the best monitored value checkpointed."""

    last: dict[str, float]
    counts: dict[str, float]
    steady: dict[str, float]
    steady_steps: int  # steps in the steady state
    gpu: dict[str, float] | None  # None: no GPU sampled
    cpu: dict[str, float]
    loop: dict[str, float]  # time/*_s: the loop, evaluation, checkpoints, logging
    best: float | None
    best_at: tuple[int, int] | None  # (epoch, step)

    def metrics(self) -> dict[str, float]:
        return {**self.last, **self.counts, **self.steady, **(self.gpu or {}), **self.cpu, **self.loop}


class Engine:
    def __init__(
        self,
        training: Training,
        evaluator: Evaluation,
        checkpointer: Checkpoints,
        instruments: Instruments,
        observers: Observers,
        run: RunView,
        limits: Limits,
    ):
        self.training, self.evaluator, self.checkpointer = training, evaluator, checkpointer
        self.instruments, self.observers, self.run, self.limits = instruments, observers, run, limits
        self.guard, self.dist = training.step.guard, limits.dist
        self.tracker, self.timer = instruments.tracker, instruments.timer
        # summed on the device, read at log steps
        self.loss_sum = torch.zeros((), device=next(training.model.parameters()).device)
        self.loss_count: int | torch.Tensor = 0  # a device count when steps decide on the device
        self.logged = False  # a training window logged in this process
        self.batch = None  # the last device batch (a reference: what a failed guard looks at)
        self.per_step = observers.has("on_train_batch_end") or observers.has("on_after_optimizer_step")
        self.clock = instruments.clock  # evaluation, checkpoints, logging: the run's time besides the steps
        self.evaluated_at: int | None = None  # the step of the last evaluation (saved with it)
        self.evaluated_inside: dict[str, float] = {}  # this epoch's last evaluation inside it (trainer.eval_every)
        training.step.on_host_read = instruments.timer.host_read  # where the step waits for the device

    def finished(self, state: TrainState) -> bool:
        """Whether `state` is already at max_epochs or max_steps (a finished run resumed)."""
        limits = self.limits
        return state.epoch >= limits.max_epochs or 0 < limits.max_steps <= state.step

    def stopping(self) -> bool:
        """Whether a callback asked the run to stop, on any rank (one small collective)."""
        return self.dist.any(self.run.stop_reason is not None)

    def fit(self, state: TrainState) -> Summary:
        """Train from `state` to max_epochs (or max_steps, or a callback's stop); return what
        the run did."""
        steps_per_epoch = len(self.training.batches)
        if state.step and self.evaluator.due_step(state.step):  # resumed from the save of an evaluation inside an epoch
            self.evaluated_at = state.step
        if not self.finished(state):
            with self.clock.timing("loop"):
                try:
                    self._fit(state, steps_per_epoch)
                except ScheduleError as e:
                    self.schedule_failed(state, e)
                with self.phase("checkpoint"):
                    self.checkpointer.flush()  # the last save's files on disk before anything reads them
        return self.summary()

    def summary(self) -> Summary:
        """The loop's figures (once every rank is done: the steady state is averaged)."""
        for batches in (self.training.batches, self.evaluator.batches):  # what every rank skipped, now all are done
            poll = getattr(batches, "poll", None)
            if poll is not None:
                poll()
        window = self.timer.run_window()
        monitor = self.instruments.monitor
        return Summary(
            last=dict(self.tracker.latest),
            counts=self.counts(),
            steady=self.dist.mean(window.metrics(), sum_keys=(names.SAMPLES_PER_S,)),
            steady_steps=window.steps,
            gpu=monitor.gpu_summary(),
            cpu=monitor.cpu_summary(),
            loop=self.clock.metrics(),
            best=self.checkpointer.best,
            best_at=self.checkpointer.best_at,
        )

    def _fit(self, state: TrainState, steps_per_epoch: int) -> None:
        while True:
            self.training.model.train()
            epoch_start, evaluated, self.evaluated_inside = time.perf_counter(), {}, {}
            if state.batch_in_epoch == 0 and self.training.reset is not None:  # not an epoch resumed part-way
                self.training.reset("train")
            batches = self.training.batches.epoch(state.epoch, start=state.batch_in_epoch)
            fetched = self.timer.fetch(batches)
            with closing(fetched, batches):  # however the epoch is left
                self.train_epoch(fetched, state, steps_per_epoch)
            if state.batch_in_epoch >= steps_per_epoch:
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
                self.training.scheduler.epoch_done()
            last = self.finished(state) or self.stopping()
            self.log_train(state, steps_per_epoch)  # closes the timing window before evaluation
            fresh = self.evaluated_at != state.step  # not evaluated (and saved) at this step inside the epoch
            if fresh and self.evaluator.due(state.epoch, last):
                evaluated = self.evaluate(state, steps_per_epoch)
                last = last or self.stopping()  # a stop asked for at this evaluation (early stopping)
            if fresh and self.checkpointer.due(state.epoch, last):
                self.save(state, self.tracker.latest, background=True)
            elif evaluated:  # no save at this epoch's end: an improved best held for the next one
                with self.phase("checkpoint"):
                    self.checkpointer.hold(state, self.tracker.latest, self.run)
            self.tracker.progress(state.step, state.epoch)
            evaluated = evaluated or self.evaluated_inside
            inside = self.evaluated_at if evaluated and self.evaluated_at != state.step else None
            max_steps = self.limits.max_steps
            at = state.epoch + state.batch_in_epoch / steps_per_epoch if max_steps > 0 else state.epoch
            self.tracker.epoch_line(at, self.limits.max_epochs, state.step, evaluated, inside, epoch_start, max_steps)
            if last:
                if self.run.stop_reason is not None or self.stopping():
                    self.run.request_stop("another rank's callback asked the run to stop")  # keeps rank 0's own reason
                    log.info("stopped at step %d: %s", state.step, self.run.stop_reason)
                return

    def evaluate(self, state: TrainState, steps_per_epoch: int) -> dict[str, float]:
        with self.phase("evaluation"):
            evaluated = self.evaluator.run(self.run.eval_model, interrupted=self.interrupted, key=state.step)
        if evaluated is None:
            self.halt(state, steps_per_epoch)  # saves, then raises Preempted
        self.tracker.log(evaluated, state.step)
        test = self.evaluator.test_evaluator
        if test is not None:
            with self.phase("evaluation"):
                tested = test.run(self.run.eval_model)
            self.tracker.log(tested or {}, state.step)
        estimate = self.evaluator.estimate_evaluator
        if estimate is not None:  # trainer.train_est_batches: training batches drawn anew at each evaluation
            with self.phase("evaluation"):
                self.tracker.log(estimate.run(self.run.eval_model, key=state.step) or {}, state.step)
        self.training.scheduler.evaluated(evaluated)
        self.timed_evaluation(evaluated, state.step)
        self.observers.call("on_eval_end", self.run, evaluated)
        if self.tracker.pictures_due(self.at_end(state, steps_per_epoch)):  # after the hooks: a stop here is the last
            self.tracker.matrices(self.evaluator.matrices, state.step, self.evaluator.class_names)
            if self.evaluator.preview is not None:
                self.tracker.images(f"{self.evaluator.split}/preview", self.evaluator.preview, state.step)
        self.evaluated_at = state.step
        return evaluated

    def at_end(self, state: TrainState, steps_per_epoch: int) -> bool:
        """Whether this is the run's last evaluation: at max_epochs or max_steps, or a stop asked
        for at it (early stopping, the target)."""
        return (
            self.finished(state)
            or (state.batch_in_epoch >= steps_per_epoch and state.epoch + 1 >= self.limits.max_epochs)
            or self.run.stop_reason is not None
        )

    def timed_evaluation(self, evaluated: dict[str, float], step: int) -> None:
        """When the evaluation ended, and whether it met the target (target.stop: the run stops)."""
        origin = self.limits.origin if self.limits.origin is not None else self.limits.start_time
        seconds, target = time.perf_counter() - origin, self.limits.target
        timed = {names.EVAL_AT_S: seconds}
        if target is not None and target.met(evaluated, step, seconds):
            timed.update(target.metrics())
            log.info("target %s met at step %d, %.1f s after the start", target, step, seconds)
            if target.stop:
                self.run.request_stop(f"target {target} met")
        self.tracker.log(timed, step)

    def evaluate_inside(self, state: TrainState, steps_per_epoch: int) -> bool:
        """An evaluation inside the epoch (trainer.eval_every): logged, saved (last.pt, best.pt),
        and whether a callback asked the run to stop at it."""
        self.log_train(state, steps_per_epoch)  # the timing window closes before the evaluation
        self.evaluated_inside = self.evaluate(state, steps_per_epoch)
        self.save(state, self.tracker.latest, background=True)
        self.training.model.train()
        return self.stopping()

    def train_epoch(self, batches, state: TrainState, steps_per_epoch: int) -> None:
        """Train on the epoch's batches, from where `state` is, until they run out or a stop
        rule (max_steps, a callback's request) says so; a stop signal or a failed guard raises."""
        step, scheduler, timer, run = self.training.step, self.training.scheduler, self.timer, self.run
        for batch in batches:
            with timer.phase("copy"):
                batch = self.batch = self.to_device(batch, state.step + 1)
            with timer.phase("compute"):
                loss, applied, stepped = step(batch, state.step + 1)
                state.step += 1  # the step is finished (and saved as such if the schedule then fails)
                state.batch_in_epoch += 1
                if stepped:  # a step not taken (non-finite, fp16 overflow) keeps the LR where it is
                    scheduler.step()
                if self.per_step:  # device work (an average of the weights): timed with the step
                    self.observers.call("on_after_optimizer_step", run)
                    self.observers.call("on_train_batch_end", run, loss)
            self.loss_sum += loss
            self.loss_count += applied
            timer.step_done(step.size(batch))
            if self.tracker.due(state.step):
                self.log_train(state, steps_per_epoch)
            if self.checkpointer.due_step(state.step):
                self.save(state, self.tracker.latest, background=True)
            if self.evaluator.due_step(state.step) and self.evaluate_inside(state, steps_per_epoch):
                return
            signalled, failed, requested = self.halting(state.step)
            if signalled or failed:
                self.halt(state, steps_per_epoch)
            if requested or 0 < self.limits.max_steps <= state.step:
                return

    def to_device(self, batch, step: int):
        """The batch on the device, augmented and normalised; running out of memory here is
        a clear error (the step's own out-of-memory is recovered in smaller micro-batches)."""
        try:
            return self.training.batches.to_device(batch)
        except Exception as e:
            if not is_oom(e):
                raise
            free_device_memory()
            raise OutOfMemory(
                f"out of memory at step {step} copying the batch to the device and preparing it (augmentation, "
                "normalisation), before the model ran: lower loader.batch_size"
            ) from None

    def log_train(self, state: TrainState, steps_per_epoch: int) -> None:
        """The one place the loop waits for the device: at log steps and epoch ends. Across
        ranks the loss and timings are averaged (samples/s summed) before they are logged."""
        window = self.timer.flush()
        if window is None:
            if not self.logged:  # resumed after the last step of an epoch: no step here, where the run is still told
                self.tracker.log(self.progress(state, steps_per_epoch), state.step)
                self.logged = True
            return
        if (
            self.instruments.monitor.phase == "start-up"
        ):  # the first window (workers starting, caches, compilation) is over
            self.instruments.monitor.phase = "train"
        self.guard.read()
        count = int(self.loss_count)  # steps applied (a device count when steps decide on the device)
        train_loss = self.loss_sum.item() / count if count else float("nan")
        shared = self.dist.mean({names.TRAIN_LOSS: train_loss, **window.metrics()}, sum_keys=(names.SAMPLES_PER_S,))
        metrics = {
            **shared,
            **self.progress(state, steps_per_epoch),
            **self.instruments.monitor.window(),  # gpu/*, cpu/*: averages of the samples in this window
            **self.tracker.changed(self.counts()),
        }
        self.loss_sum.zero_()
        self.loss_count = 0
        self.logged = True
        with self.clock.timing("logging"):
            self.tracker.log(metrics, state.step)
            self.tracker.progress(state.step, state.epoch)

    def progress(self, state: TrainState, steps_per_epoch: int) -> dict[str, float]:
        """Where the run is: its LR (and each optimizer's, with several), epoch, step, peak
        memory and time since the start."""
        named = getattr(self.training.scheduler, "named_lrs", None)
        return {
            names.TRAIN_LR: self.training.scheduler.get_last_lr()[0],
            **({f"{names.TRAIN_LR}/{k}": lr for k, lr in named().items()} if named is not None else {}),
            names.EPOCH: state.epoch + state.batch_in_epoch / steps_per_epoch,
            names.STEP: state.step,
            names.PEAK_MB: self.instruments.memory(),
            names.WALL_S: time.perf_counter() - self.limits.start_time,
        }

    def counts(self) -> dict[str, float]:
        """The counters' values now (metrics.json holds them all, healthy or not)."""
        counts = {names.NONFINITE_STEPS: self.guard.count, names.MICRO_BATCHES: self.training.step.micro_batches}
        scaler = self.training.step.precision.scaler
        if scaler.is_enabled():  # fp16: the loss scale, halved at each overflowing (skipped) step, as fairseq logs it
            counts[names.LOSS_SCALE] = scaler.get_scale()
        return counts

    def save(self, state: TrainState, metrics: dict[str, float], *, background: bool = False) -> float:
        """last.pt (and best.pt): `background`, written beside training (checkpoint.background),
        unless an on_checkpoint hook is to read the files now."""
        hooked = self.dist.is_main and self.observers.has("on_checkpoint")
        with self.phase("checkpoint"):
            seconds = self.checkpointer.save(state, metrics, self.run, background=background and not hooked)
        if hooked:
            self.observers.call("on_checkpoint", self.run, str(self.checkpointer.last_path))
        return seconds

    @contextlib.contextmanager
    def phase(self, name: str):
        """Evaluation or a checkpoint: its time counted apart (RunClock), and the resource
        samples taken meanwhile kept out of the steady state's figures."""
        monitor = self.instruments.monitor
        before, monitor.phase = monitor.phase, name
        try:
            with self.clock.timing(name):
                yield
        finally:
            monitor.phase = before

    def interrupted(self) -> bool:
        """A preemption signal during evaluation, in one process. (Across ranks the flag is
        agreed at log steps; ranks evaluate different numbers of batches, so a collective
        between them cannot be placed inside evaluation.)"""
        return self.limits.stop.requested is not None and self.dist.world_size == 1

    def halting(self, step: int) -> tuple[bool, bool, bool]:
        """(a stop signal, too many non-finite steps, a callback's stop request), agreed across
        ranks so that they stop together: in one small collective every `dist.check_every`
        steps (the log interval), in one process every step."""
        if step % self.dist.check_every:
            return False, False, False
        flags = (self.limits.stop.requested is not None, self.guard.failed, self.run.stop_reason is not None)
        signalled, failed, asked = self.dist.any_of(flags)
        return signalled, failed, asked

    def nonfinite_data(self) -> str | None:
        """Which part of the last batch holds NaN or inf ("inputs", "targets"), if any: then the
        data, not the learning rate, made the steps non-finite. One host read, as the run stops."""
        if self.batch is None:
            return None
        for name, part in self.training.step.parts(self.batch):
            if isinstance(part, torch.Tensor) and part.is_floating_point() and not bool(torch.isfinite(part).all()):
                return name
        return None

    def schedule_failed(self, state: TrainState, error: ScheduleError) -> NoReturn:
        """optim.scheduler failed after a finished step (every rank alike: the schedule is the
        same on each): the run is saved there, as a failed hook leaves it, and stops."""
        self.checkpointer.close()  # a save in flight on disk first
        self.save(state, {})
        self.dist.barrier()  # no rank leaves before rank 0 has saved
        raise ScheduleError(
            f"{error}; the last finished step ({state.step}) is saved: {self.checkpointer.last_good()} (it holds this "
            "scheduler's state: after fixing optim.scheduler, go on from its weights with pretrained.path=<it>)"
        ) from None

    def halt(self, state: TrainState, steps_per_epoch: int) -> NoReturn:
        """Stop at this step boundary: a preemption signal saves last.pt and exits; too many
        non-finite steps fail the run, pointing at the last good state."""
        self.checkpointer.close()  # a save in flight on disk before any rank leaves (its failure logged)
        self.log_train(state, steps_per_epoch)
        if self.dist.any(self.guard.failed):
            if self.guard.skip:  # every bad step was skipped: the weights are the last good state
                self.save(state, {})
            self.dist.barrier()  # no rank leaves before rank 0 has saved
            raise self.guard.error(
                state.step, self.checkpointer.last_good(), self.limits.resume_hint, data=self.nonfinite_data()
            )
        seconds = self.save(state, {})
        self.dist.barrier()  # torchrun kills the others as soon as one rank exits
        signum = self.limits.stop.requested or signal.SIGTERM  # a rank that heard nothing follows the others
        name = signal.Signals(signum).name
        if self.dist.is_main:
            log.warning(
                "%s at step %d (epoch %d, batch %d): saved %s in %.2fs; resume with: %s",
                name,
                state.step,
                state.epoch,
                state.batch_in_epoch,
                self.checkpointer.last_path,
                seconds,
                self.limits.resume_hint,
            )
        raise Preempted(signum)
