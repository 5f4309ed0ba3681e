"""Numerical faults (non-finite steps, fp16 overflow) and data faults (a worker that hangs
or dies)."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F

import saturate
from saturate.checkpoint import files as checkpoint
from saturate.components.precision import Precision
from saturate.errors import DataError
from saturate.loop.faults import NonFiniteGuard, NotRequeued, Preempted, StopSignal, TrainingDiverged
from saturate.loop.step import TrainStep
from tests.conftest import TINY
from tests.trainer.test_run import events


class Snapshots:
    """A callback that keeps the weights and the optimizer's state before the first step and
    after each one."""

    taken: dict[int, list[torch.Tensor]] = {}

    def _take(self, run) -> None:
        state = [t.clone() for s in run.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        Snapshots.taken[run.step] = [p.detach().clone() for p in run.model.parameters()] + state

    def on_run_start(self, run) -> None:
        Snapshots.taken = {}
        self._take(run)

    def on_train_batch_end(self, run, loss) -> None:
        self._take(run)


class StepCount:
    """A callback that tells which training step runs now (the public protocol): 0 before
    the run starts (the start-up check of the loss is no step), then run.step + 1."""

    current = 0

    def on_run_start(self, run) -> None:
        StepCount.current = run.step + 1

    def on_train_batch_end(self, run, loss) -> None:
        StepCount.current = run.step + 1


class PoisonedLoss:
    """Cross-entropy, NaN at the (1-based) training steps in `bad_steps` (counted by StepCount)."""

    bad_steps: set[int] = set()

    def __call__(self, logits, y):
        loss = F.cross_entropy(logits, y)
        if logits.requires_grad and StepCount.current in PoisonedLoss.bad_steps:  # inside a poisoned training step
            return loss * float("nan")
        return loss


def poison_loss(bad_steps: set[int]) -> list[str]:
    """The overrides that make the training loss NaN at the given (1-based) steps: the task's
    loss is the user's own (task.loss), a callback counts the steps."""
    StepCount.current, PoisonedLoss.bad_steps = 0, set(bad_steps)
    return [
        "task.loss={_target_:tests.loop.test_faults.PoisonedLoss}",
        "+callbacks.count._target_=tests.loop.test_faults.StepCount",
    ]


@pytest.mark.parametrize("fused", [True, False], ids=["decided-on-the-device", "read-per-step"])
def test_a_non_finite_step_is_skipped_counted_and_leaves_the_weights_alone(make_cfg, fused):
    """The presets' fused optimizer skips on the device (the schedule advances over the
    skipped step, as over an fp16 overflow); another optimizer is told per step (the
    schedule holds)."""
    overrides = poison_loss({2})
    cfg = make_cfg(
        "trainer.max_epochs=2",
        "optim.warmup_epochs=0",
        f"optim.optimizer.fused={str(fused).lower()}",
        *overrides,
        "+callbacks.snapshots._target_=tests.loop.test_faults.Snapshots",
    )
    metrics = saturate.train(cfg)
    taken = Snapshots.taken
    unchanged = {
        step: all(torch.equal(a, b) for a, b in zip(taken[step - 1], taken[step], strict=True)) for step in (1, 2, 3)
    }
    assert unchanged == {1: False, 2: True, 3: False}  # weights and momentum untouched by the skipped step 2
    assert metrics["train/nonfinite_steps"] == 1 and math.isfinite(metrics["train/loss"])
    acc = events(cfg.run_dir)
    # logged once it leaves 0, not as a flat line
    assert [(e.step, e.value) for e in acc.Scalars("train/nonfinite_steps")][0] == (
        2,
        1,
    )
    lrs = [e.value for e in acc.Scalars("train/lr")]
    assert (lrs[1] < lrs[0]) if fused else (lrs[1] == lrs[0] and lrs[2] < lrs[1])


def test_consecutive_non_finite_steps_stop_with_the_last_good_state(make_cfg):
    overrides = poison_loss(set(range(3, 100)))
    cfg = make_cfg(
        "trainer.max_epochs=3", "trainer.max_nonfinite_steps=4", "trainer.limit_train_batches=-1", *overrides
    )
    with pytest.raises(TrainingDiverged) as err:
        saturate.train(cfg)
    last = Path(cfg.run_dir) / "checkpoints/last.pt"
    assert str(err.value).startswith("training stopped at step 6: 4 non-finite steps in a row (from step 3 to 6)")
    assert str(last) in str(err.value)
    saved = checkpoint.load(last)
    assert saved["step"] == 6 and all(torch.isfinite(v).all() for v in saved["model"].values() if v.is_floating_point())


def test_without_per_step_checks_non_finite_steps_fail_at_the_next_log_step(make_cfg):
    overrides = poison_loss({5})
    cfg = make_cfg(
        "trainer.skip_nonfinite=false", "trainer.log_interval=4", "trainer.limit_train_batches=-1", *overrides
    )
    with pytest.raises(TrainingDiverged, match="stopped at step 8: non-finite steps before step 8"):
        saturate.train(cfg)


def test_guard_without_skip_reads_nothing_per_step():
    guard = NonFiniteGuard(skip=False, check_grads=True, max_consecutive=3, device=torch.device("cpu"))
    assert guard.ok(torch.tensor(float("nan")), torch.tensor(1.0), step=1)  # applied; counted on the device
    assert guard.count == 0 and not guard.failed
    guard.read()
    assert guard.count == 1 and guard.failed


def test_steps_decided_on_the_device_are_counted_at_log_steps_with_their_longest_streak(caplog):
    """The device's per-step verdicts, read at log steps: the skipped steps, the longest run
    of them and where it began; a run that spans a log step is counted whole."""
    guard = NonFiniteGuard(skip=True, check_grads=True, max_consecutive=5, device=torch.device("cpu"))
    guard.on_device = True
    verdicts = {1: True, 2: False, 3: True, 4: False, 5: False, 6: False}  # step: finite
    for step, finite in verdicts.items():
        guard.skipped_on_device(torch.tensor(finite), step)
    assert guard.count == 0  # nothing read yet
    guard.read()
    assert (guard.count, guard.consecutive, guard.first_bad_step, guard.failed) == (4, 3, 4, False)
    assert "4 non-finite step(s) skipped" in caplog.text and "3 in a row from step 4" in caplog.text
    guard.skipped_on_device(torch.tensor(False), 7)  # the run from step 4 goes on
    guard.read()
    assert (guard.count, guard.consecutive, guard.first_bad_step) == (5, 4, 4)
    said = str(guard.error(7, "last.pt"))
    assert said.startswith("training stopped at step 7: 4 non-finite steps in a row (from step 4 to 7)")
    guard.skipped_on_device(torch.tensor(False), 8)  # and reaches max_consecutive inside the next window
    guard.skipped_on_device(torch.tensor(True), 9)
    guard.read()
    assert (guard.count, guard.consecutive, guard.first_bad_step, guard.failed) == (6, 5, 4, True)
    guard.skipped_on_device(torch.tensor(True), 10)
    guard.read()
    assert (guard.count, guard.consecutive, guard.failed) == (6, 0, False)
    for step in range(11, 11 + 3000):  # more steps between two log steps than one chunk holds
        guard.skipped_on_device(torch.tensor(step != 2000), step)
    guard.read()
    assert (guard.count, guard.consecutive, guard.first_bad_step) == (7, 1, 2000)


def fp16_precision() -> Precision:
    return Precision("fp16", "cpu", torch.float16, torch.amp.GradScaler("cpu", init_scale=1024.0))


def test_fp16_overflow_skipped_by_the_scaler_does_not_count_as_a_step():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = fp16_precision()
    before = model.weight.detach().clone()
    precision.scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")  # an overflow in the backward pass
    precision.scaler.unscale_(opt)
    assert precision.step(opt, apply=True) is False
    assert torch.equal(model.weight, before) and precision.scaler.get_scale() == 512.0
    opt.zero_grad()
    precision.scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    precision.scaler.unscale_(opt)
    assert precision.step(opt, apply=True) is True and not torch.equal(model.weight, before)


@pytest.mark.parametrize("fused", [False, True], ids=["read-per-step", "decided-on-the-device"])
def test_fp16_overflow_is_skipped_and_the_schedule_holds_unless_decided_on_the_device(make_cfg, monkeypatch, fused):
    """The scaler skips an overflow step. A fused optimizer takes the scaler's verdict on the
    device (no host read), so the host cannot hold the schedule: it advances, as in a plain
    torch.amp loop; another optimizer's step is skipped on the host and the schedule holds."""
    calls = []
    original = torch.amp.GradScaler.unscale_

    def unscale_(self, optimizer):
        calls.append(1)
        if len(calls) == 2:  # an fp16 overflow in the second step's backward pass
            optimizer.param_groups[0]["params"][0].grad.view(-1)[0] = float("inf")
        return original(self, optimizer)

    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", unscale_)
    cfg = make_cfg(
        "precision=fp16",
        "optim.warmup_epochs=0",
        "optim.schedule=cosine",
        f"optim.optimizer.fused={str(fused).lower()}",
    )
    metrics = saturate.train(cfg)
    lrs = [e.value for e in events(cfg.run_dir).Scalars("train/lr")]
    assert (lrs[1] < lrs[0]) if fused else (lrs[1] == lrs[0] and lrs[2] < lrs[1])  # without fused: step 2 kept the LR
    assert len(calls) == 3 and metrics["progress/step"] == 3
    assert metrics["train/nonfinite_steps"] == 0  # an overflow is the scaler's business, not a non-finite step


def test_the_fp16_loss_scale_is_logged_and_overflowing_first_steps_leave_a_finite_run(make_cfg):
    """precision.init_scale=3e38: the first steps' scaled loss is inf (the first step skipped,
    as fp16's first steps are in most runs); the scale halves on the device and is logged
    (train/loss_scale) at log steps only; the run goes on with finite losses."""
    cfg = make_cfg("precision=fp16", "precision.init_scale=3e38", "loader.batch_size=8", "trainer.log_interval=1")
    metrics = saturate.train(cfg)
    scales = [e.value for e in events(cfg.run_dir).Scalars("train/loss_scale")]
    assert scales[:3] == pytest.approx([1.5e38, 7.5e37, 3.75e37])  # halved at each of the three overflowing steps
    assert (
        math.isfinite(metrics["train/loss"])
        and math.isfinite(metrics["val/loss"])
        and metrics["train/loss_scale"] == scales[-1]
    )


class Stalls(torch.utils.data.Dataset):
    """Item 20 never comes back (a hung worker) or kills its worker, as asked ("fine": neither)."""

    classes = list(range(10))

    def __init__(self, how: str):
        self.how = how

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index):
        if index == 20 and self.how in ("hang", "die") and torch.utils.data.get_worker_info() is not None:
            if self.how == "hang":
                time.sleep(600)
            os._exit(1)
        return torch.zeros(1, 8, 8, dtype=torch.uint8), index % 10


@pytest.mark.parametrize("how", ["hang", "die"])
def test_a_worker_that_hangs_or_dies_is_a_clear_error_and_leaves_no_process(tmp_path, how):
    from saturate.models import SmallCNN

    overrides = [
        *TINY,
        "loader.num_workers=2",
        "loader.timeout_s=3",
        "loader.batch_size=8",
        "trainer.limit_train_batches=-1",
    ]
    # an xdist worker may hold other tests' children
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        saturate.fit(SmallCNN(1, 10, width=8), Stalls(how), Stalls(how), overrides=overrides, run_dir=tmp_path)
    assert time.monotonic() - start < 60
    expected = "no batch within loader.timeout_s=3 s" if how == "hang" else "a worker process died"
    assert str(err.value).startswith(f"loader: {expected}")
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["step"]  # the last completed step
    assert f"The last completed step ({saved}) is saved" in str(err.value)
    gc.collect()
    deadline = time.monotonic() + 15

    def left():
        return [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE
        ]

    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == []


class WorkerDeathInALogger:
    """torch's SIGCHLD handler raises a worker's death in whatever the main thread runs: here,
    as seen once in a fresh clone, inside TensorBoard's on_log."""

    def on_log(self, run, metrics, step):
        if step == 2:
            raise RuntimeError(
                "DataLoader worker (pid 17344) exited unexpectedly with exit code 1. Details are lost due to "
                "multiprocessing. Rerunning with num_workers=0 may give better error trace."
            )


def test_a_worker_death_surfacing_in_a_logger_is_the_loaders_failure_not_the_loggers(tmp_path):
    from saturate.models import SmallCNN

    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(DataError, match=r"^loader: a worker process died \(DataLoader worker \(pid 17344\) exited"):
        saturate.fit(
            SmallCNN(1, 10, width=8),
            Stalls("fine"),
            Stalls("fine"),
            overrides=[*TINY, "loader.num_workers=2", "loader.batch_size=8"],
            run_dir=tmp_path,
            loggers=[WorkerDeathInALogger()],
        )
    left = [p for p in psutil.Process().children() if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []  # the epoch's workers end with the run, not when the generator holding them is collected


def test_a_worker_dying_mid_send_is_the_same_clear_error():
    """The pipe's own error can reach the loop before the DataLoader sees its worker gone (seen
    once in a fresh-clone run of the test above); a dataset's own ConnectionError, re-raised
    from a worker ("Caught ... in DataLoader worker") or raised without workers, stays itself."""
    from saturate.data.loader import loader_failure

    died = loader_failure(ConnectionResetError(104, "Connection reset by peer"), 3, workers=2)
    assert str(died).startswith(
        "loader: a worker process died (ConnectionResetError: [Errno 104] Connection reset by peer)"
    )
    assert loader_failure(EOFError(), 3, workers=2) is not None
    assert loader_failure(ConnectionResetError(104, "Connection reset by peer"), 3, workers=0) is None
    assert (
        loader_failure(ConnectionError("Caught ConnectionError in DataLoader worker process 0."), 3, workers=2) is None
    )


class RefusesItem20(Stalls):
    """A data set whose own check refuses item 20 with a DataError, in a worker."""

    def __getitem__(self, index):
        if index == 20 and torch.utils.data.get_worker_info() is not None:
            raise DataError("data: item 20 is broken (the data set's own words)")
        return super().__getitem__(index)


def test_a_user_error_raised_in_a_worker_keeps_its_own_words(tmp_path):
    """DataLoader re-raises a worker's exception with the worker's traceback in its message;
    a UserError reaches the user as its own one-line message."""
    from saturate.models import SmallCNN

    overrides = [*TINY, "loader.num_workers=2", "loader.batch_size=8", "trainer.limit_train_batches=-1"]
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(DataError) as err:
        saturate.fit(
            SmallCNN(1, 10, width=8), RefusesItem20("die"), RefusesItem20("die"), overrides=overrides, run_dir=tmp_path
        )
    assert str(err.value) == "data: item 20 is broken (the data set's own words)"
    left = [p for p in psutil.Process().children() if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []  # its workers ended with the run, though err holds the traceback


# -- a skipped first step (issue 25, item 1): torch's fused SGD makes its momentum buffers with
# empty_like on the first step and, told found_inf, never writes them; step 2 then read garbage


@contextlib.contextmanager
def deterministic_mode(on: bool):
    """torch.use_deterministic_algorithms for the block: torch.empty then fills with NaN, so
    memory left unwritten shows."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


OPTIMIZERS = {
    "SGD": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4},
    "AdamW": {"_target_": "torch.optim.AdamW", "lr": 3e-3, "weight_decay": 0.05},
    "Adam": {"_target_": "torch.optim.Adam", "lr": 3e-3},
}


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "not-deterministic"])
@pytest.mark.parametrize("kind", ["fused", "foreach"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_skipped_first_step_leaves_the_optimizer_as_new(name, kind, deterministic):
    """Step 1 non-finite and skipped (on the device for a fused optimizer, by the host read
    otherwise), then step 2: weights and optimizer state exactly those of a new optimizer
    that only ever took step 2."""
    from saturate.components.optim import setup_optimizer
    from saturate.config.schema import OptimConfig

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
        node = {**OPTIMIZERS[name], "_partial_": True, kind: True}
        cfg = OptimConfig(optimizer=node, schedule="constant", warmup_epochs=0)
        return model, setup_optimizer(cfg, model, steps_per_epoch=10, total_steps=10, global_batch=8)[0]

    def train_step(model, optimizer):
        guard = NonFiniteGuard(skip=True, check_grads=True, max_consecutive=3, device=torch.device("cpu"))
        precision = Precision("fp32", "cpu", None, torch.amp.GradScaler("cpu", enabled=False))
        return TrainStep(
            model, optimizer, precision, guard, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]) * nan[0], grad_clip=0.0
        )

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]
    with deterministic_mode(deterministic):
        model, optimizer = build()
        step = train_step(model, optimizer)
        assert step.on_device == (kind == "fused")
        nan = [float("nan")]
        step(batches[0], 1)  # skipped
        nan[0] = 1.0
        step(batches[1], 2)
        fresh_model, fresh_optimizer = build()
        train_step(fresh_model, fresh_optimizer)(batches[1], 1)
    step.guard.read()
    assert step.guard.count == 1
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(p, q)
        state, fresh = optimizer.state[p], fresh_optimizer.state[q]
        assert state.keys() == fresh.keys()
        for key in state:
            assert torch.equal(torch.as_tensor(state[key]), torch.as_tensor(fresh[key])), key
    for b, c in zip(model.buffers(), fresh_model.buffers(), strict=True):
        assert torch.equal(b, c)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "not-deterministic"])
def test_a_run_whose_first_step_is_skipped_trains_on(make_cfg, deterministic):
    """The issue's run: the default fused SGD, step 1 non-finite. Before the fix, deterministic
    mode's NaN momentum made every later step non-finite; without it the garbage wrecked the
    weights. It now ends as the read-per-step run (which never calls the optimizer for a
    skipped step) does, up to the two kernels' rounding."""
    runs = {}
    overrides = poison_loss({1})
    for fused in ("true", "false"):
        cfg = make_cfg(
            "optim.warmup_epochs=0",
            "optim.schedule=constant",
            f"trainer.deterministic={str(deterministic).lower()}",
            "trainer.max_epochs=2",
            f"optim.optimizer.fused={fused}",
            *overrides,
        )
        metrics = saturate.train(cfg)
        assert (
            metrics["train/nonfinite_steps"] == 1
            and math.isfinite(metrics["train/loss"])
            and math.isfinite(metrics["val/loss"])
        )
        runs[fused] = torch.load(Path(cfg.run_dir) / "checkpoints" / "last.pt", weights_only=True)["model"]
    for name, value in runs["true"].items():
        torch.testing.assert_close(value, runs["false"][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "not-deterministic"])
def test_an_fp16_overflow_at_the_first_step_leaves_fused_sgd_momentum_clean(deterministic):
    """fp16's first step overflows in most runs (GradScaler starts at 2^16); GradScaler hands a
    fused optimizer `found_inf` on the device, the same path as the guard's."""
    from saturate.components.optim import setup_optimizer
    from saturate.config.schema import OptimConfig

    with deterministic_mode(deterministic):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 8)
        node = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "momentum": 0.9, "fused": True}
        cfg = OptimConfig(optimizer=node, schedule="constant", warmup_epochs=0)
        opt, _ = setup_optimizer(cfg, model, steps_per_epoch=10, total_steps=10, global_batch=8)
        precision = fp16_precision()
        precision.scaler.scale(model(torch.randn(3, 64)).sum()).backward()
        model.weight.grad[0, 0] = float("inf")  # the overflow of the first backward pass
        precision.scaler.unscale_(opt)
        weights = [p.detach().clone() for p in model.parameters()]
        precision.step(opt, apply=True)  # the fused optimizer takes the scaler's found_inf and skips on the device
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
        opt.zero_grad()
        precision.scaler.scale(model(torch.randn(3, 64)).sum()).backward()
        precision.scaler.unscale_(opt)
        grads = [p.grad.clone() for p in model.parameters()]
        precision.step(opt, apply=True)
        for p, g in zip(model.parameters(), grads, strict=True):
            # the first applied step: the buffer is that step's gradient
            assert torch.equal(opt.state[p]["momentum_buffer"], g)


@pytest.fixture
def submitit_usr2(monkeypatch, tmp_path):
    """submitit's own SIGUSR2 handler, as it is in a SLURM job of hydra/launcher=slurm with a
    2-minute limit, on the rank `rank(n)` names; the handler is put back after the test."""
    from submitit.core.job_environment import SignalHandler
    from submitit.core.utils import DelayedSubmission, JobPaths
    from submitit.slurm.slurm import SlurmJobEnvironment

    before = signal.getsignal(signal.SIGUSR2)

    def rank(n: int):
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        monkeypatch.setenv("SLURM_PROCID", str(n))
        submission = DelayedSubmission(print)  # nothing to checkpoint: submitit cannot requeue it
        submission.set_timeout(2, 3)
        handler = SignalHandler(SlurmJobEnvironment(), JobPaths(tmp_path, "4242"), submission)
        signal.signal(signal.SIGUSR2, handler.checkpoint_and_try_requeue)

    yield rank
    signal.signal(signal.SIGUSR2, before)


def stopped_by_usr2():
    """What the engine does with a stop signal: stop at a step boundary (here at once) with Preempted."""
    with StopSignal() as stop:
        signal.raise_signal(signal.SIGUSR2)
        assert stop.requested == signal.SIGUSR2  # only noted: submitit's handler has not run yet
        raise Preempted(stop.requested)


def test_submitits_usr2_handler_runs_after_the_stop_and_the_other_ranks_exit_as_preempted(submitit_usr2, caplog):
    submitit_usr2(1)
    with pytest.raises(Preempted) as stopped:
        stopped_by_usr2()
    assert stopped.value.code == 128 + signal.SIGUSR2
    assert "Not checkpointing nor requeuing since I am a slave (procid=1)" in caplog.text


def test_when_submitit_will_not_requeue_rank_0_says_why_in_one_line(submitit_usr2):
    submitit_usr2(0)
    with pytest.raises(NotRequeued) as refused:
        stopped_by_usr2()
    assert str(refused.value).startswith("SIGUSR2: the job was not requeued (Job not requeued because: timed-out")
    assert "hydra.launcher.max_num_timeout" in str(refused.value)


def test_a_stop_asked_after_the_loop_last_looked_goes_to_the_enclosing_watcher():
    """A signal that reaches a run once its loop has stopped looking (its final evaluation,
    report, records: a tune's trial spends a good part of its seconds there) is handed to the
    StopSignal around the run, if there is one (tune's, between its trials): else the tune
    ran every trial left after a Ctrl-C. A stop the run acted on (Preempted) is its own, and
    with no saturate watcher around the run nothing changes."""
    with StopSignal() as tune:
        with StopSignal() as run:
            signal.raise_signal(signal.SIGTERM)
            assert run.requested == signal.SIGTERM and tune.requested is None
        assert tune.requested == signal.SIGTERM
        tune.requested = None
        with pytest.raises(Preempted), StopSignal() as run:
            signal.raise_signal(signal.SIGTERM)
            raise Preempted(run.requested)
        assert tune.requested is None
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: pytest.fail("a handler not saturate's got a signal handled"))
    try:
        with StopSignal() as run:
            signal.raise_signal(signal.SIGTERM)
        assert run.requested == signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, before)


def test_before_the_loop_a_stop_ends_at_once_unless_an_outer_watcher_takes_it():
    """A run's own watcher, while its phase is set, ends the process at once (nothing to
    save); inside tune's (an outer watcher around its trials) the stop is only noted, so the
    trial stops at its first step and tune keeps what it measured."""
    from saturate.started import StoppedEarly

    with pytest.raises(StoppedEarly) as ended, StopSignal(phase="building the data"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here, long before this ends
    assert ended.value.code == 128 + signal.SIGTERM
    with StopSignal() as tune, StopSignal(phase="building the data") as trial:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert trial.requested == signal.SIGTERM and tune.requested is None


def test_a_stop_while_a_logger_starts_is_a_preemption_of_the_run_not_the_loggers_failure(tmp_path):
    from tests.hostile.test_bad_input import Samples, fit, mlp, windows

    class StopsWhileStarting:
        def on_run_start(self, run) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's stop while a tracker connects
            time.sleep(0.1)

    data = Samples(64, windows)
    with pytest.raises(Preempted):
        fit(mlp(), data, data, task="regression", callbacks={"tracker": StopsWhileStarting()}, run_dir=tmp_path)
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["status"] == "preempted" and (tmp_path / "checkpoints" / "last.pt").is_file()
