"""The loop as such: built by hand from real parts (a small model, in-memory batches, a real
step, evaluator, checkpointer, tracker and timer), it trains to its limits, evaluates and
saves on their cadence, stops when a callback asks, resumes mid-epoch where its state says,
and reports what it did in one summary."""

from __future__ import annotations

import time

import torch
from torch import nn

from saturate.callbacks import Observers, Plan, Run
from saturate.checkpoint.checkpointer import Checkpointer
from saturate.components.precision import setup_precision
from saturate.components.schedule import Schedule
from saturate.config.schema import CheckpointConfig, LoaderConfig, PrecisionConfig
from saturate.data.base import InMemory
from saturate.data.loader import PlainPipeline, ResidentLoader
from saturate.diagnostics.monitor import ResourceMonitor
from saturate.diagnostics.timing import RunClock, StepTimer
from saturate.diagnostics.tracking import Tracker
from saturate.loop.engine import Engine, Instruments, Limits, Training, TrainState
from saturate.loop.evaluate import Evaluator
from saturate.loop.faults import NonFiniteGuard, StopSignal
from saturate.loop.step import TrainStep
from saturate.scale.distributed import Dist
from saturate.tasks.classification import Classification

CPU = torch.device("cpu")


class Recorder:
    """A callback that records the hooks it sees, with the step each came at."""

    def __init__(self):
        self.calls: list[str] = []

    def on_train_batch_end(self, run, loss) -> None:
        self.calls.append(f"step{run.step}")

    def on_eval_end(self, run, metrics) -> None:
        self.calls.append(f"eval@{run.step}")

    def on_checkpoint(self, run, path) -> None:
        self.calls.append(f"save@{run.step}")


def engine(tmp_path, *, max_epochs: int, eval_interval: int = 1, state: TrainState | None = None, callback=None):
    """An engine over 64 training and 32 validation samples of 8 features, batches of 16."""
    torch.manual_seed(0)
    x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))
    cfg = LoaderConfig(batch_size=16, num_workers=0)
    train = ResidentLoader(InMemory(x[:64], y[:64]), cfg, PlainPipeline(CPU, non_blocking=False), train=True)
    val = ResidentLoader(InMemory(x[64:], y[64:]), cfg, PlainPipeline(CPU, non_blocking=False), train=False)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = Schedule(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    precision, task = setup_precision(PrecisionConfig(mode="fp32"), CPU), Classification(num_classes=3)
    guard = NonFiniteGuard(skip=True, check_grads=True, max_consecutive=3, device=CPU)
    step = TrainStep(model, optimizer, precision, guard, loss=lambda m, b: task.forward(m, b)[0], grad_clip=0.0)
    observers = Observers({"recorder": callback} if callback else {})
    checkpoints = CheckpointConfig(monitor="val/acc", mode="max")
    checkpointer = Checkpointer(
        tmp_path,
        checkpoints,
        interval=1,
        model=model,
        stateful={"optimizer": optimizer, "scheduler": scheduler},
        config={},
        fingerprint={},
    )
    state = state or TrainState()
    timer = StepTimer(CPU)
    view = Run(
        Plan(tmp_path, "val/acc", "max", 4 * max_epochs),
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        position=state,
        timer=timer,
    )
    tracker = Tracker(observers, log_interval=2, progress=False)
    tracker.attach(view, 4 * max_epochs, state.step)
    instruments = Instruments(tracker, timer, ResourceMonitor(1.0, CPU, enabled=False), lambda: 0.0, RunClock())
    limits = Limits(max_epochs, -1, StopSignal(), Dist(None), time.perf_counter())
    evaluator = Evaluator(val, precision, task, interval=eval_interval)
    return Engine(
        Training(model, step, scheduler, train), evaluator, checkpointer, instruments, observers, view, limits
    ), state


def test_the_loop_trains_to_its_limit_and_evaluates_and_saves_on_their_cadence(tmp_path):
    recorder = Recorder()
    loop, state = engine(tmp_path, max_epochs=3, eval_interval=2, callback=recorder)
    summary = loop.fit(state)
    assert (state.epoch, state.step, state.batch_in_epoch) == (3, 12, 0)
    steps = [c for c in recorder.calls if c.startswith("step")]
    assert steps == [f"step{i}" for i in range(1, 13)]
    assert [c for c in recorder.calls if c.startswith("eval")] == ["eval@8", "eval@12"]  # every 2nd epoch, and the last
    assert [c for c in recorder.calls if c.startswith("save")] == ["save@4", "save@8", "save@12"]
    assert torch.load(tmp_path / "last.pt", weights_only=True)["step"] == 12
    assert "val/acc" in summary.last and summary.last["progress/step"] == 12
    assert summary.best is not None and summary.best_at[1] in (8, 12)
    assert summary.steady_steps > 0 and summary.steady["perf/samples_per_s"] > 0


def test_a_callbacks_stop_request_ends_the_run_at_that_evaluation_with_its_reason(tmp_path):
    class StopAtFirstEval(Recorder):
        def on_eval_end(self, run, metrics) -> None:
            super().on_eval_end(run, metrics)
            run.request_stop("enough")

    loop, state = engine(tmp_path, max_epochs=5, callback=StopAtFirstEval())
    loop.fit(state)
    assert state.step == 4 and loop.run.stop_reason == "enough"
    assert torch.load(tmp_path / "last.pt", weights_only=True)["step"] == 4  # the stop is saved


def test_the_loop_continues_mid_epoch_where_its_state_says(tmp_path):
    recorder = Recorder()
    loop, state = engine(tmp_path, max_epochs=2, state=TrainState(epoch=0, step=3, batch_in_epoch=3), callback=recorder)
    loop.fit(state)
    assert [c for c in recorder.calls if c.startswith("step")] == [f"step{i}" for i in range(4, 9)]
    assert (state.epoch, state.step) == (2, 8)


def test_a_finished_state_trains_nothing(tmp_path):
    recorder = Recorder()
    loop, state = engine(tmp_path, max_epochs=2, state=TrainState(epoch=2, step=8), callback=recorder)
    assert loop.finished(state)
    loop.fit(state)
    assert recorder.calls == [] and state.step == 8
