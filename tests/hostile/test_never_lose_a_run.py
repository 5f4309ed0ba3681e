"""Never lose a run, round two: nothing read from disk runs code, a skipped step leaves every
buffer alone, no checkpoint holds NaN or inf, resume respects the config, no hangs."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import saturate
from saturate.errors import CheckpointError, DataError
from saturate.loop.faults import TrainingDiverged
from tests.conftest import ROOT, TINY, python, read_metrics, run_cli
from tests.trainer.test_run import events


class Payload:
    """What an attacker drops in a folder: unpickling it runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def all_finite(path: Path) -> bool:
    ckpt = torch.load(path, weights_only=True)
    return all(torch.isfinite(t).all() for t in ckpt["model"].values() if t.is_floating_point())


def test_a_checkpoint_that_would_run_code_is_refused_and_others_are_never_opened(make_cfg, tmp_path):
    marker = tmp_path / "pwned"
    cfg = make_cfg()
    saturate.train(cfg)
    checkpoints = Path(cfg.run_dir) / "checkpoints"
    torch.save({"model": {}, "step": 99, "payload": Payload(marker)}, checkpoints / "dropped.pt")  # beside last.pt
    resumed = saturate.train(make_cfg(f"run_dir={cfg.run_dir}", "trainer.resume=auto", "trainer.max_epochs=2"))
    assert resumed["progress/step"] == 6 and not marker.exists()  # resumed from last.pt; dropped.pt never opened

    torch.save({"model": {}, "step": 99, "payload": Payload(marker)}, checkpoints / "last.pt")
    with pytest.raises(
        CheckpointError, match="refusing .*last.pt: it holds objects that only arbitrary unpickling could load"
    ):
        saturate.train(make_cfg(f"run_dir={cfg.run_dir}", "trainer.resume=auto", "trainer.max_epochs=3"))
    with pytest.raises(CheckpointError, match="refusing"):
        saturate.train(make_cfg(f"trainer.resume={checkpoints / 'dropped.pt'}"))
    assert not marker.exists()


def test_a_cifar_batch_that_would_run_code_is_refused(make_cfg, tmp_path):
    marker = tmp_path / "pwned"
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (10, 3072), dtype=np.uint8), "labels": rng.integers(0, 10, 10).tolist()}
        if name == "data_batch_3":
            batch["filenames"] = Payload(marker)
        (root / name).write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match=r"data_batch_3 is not a CIFAR-10 python batch .*refused to load posix.system"):
        saturate.train(make_cfg("data=cifar10", f"data.root={root}", "model.width=8"))
    assert not marker.exists()
    good = tmp_path / "good" / "cifar-10-batches-py"
    good.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (40, 3072), dtype=np.uint8), "labels": (np.arange(40) % 10).tolist()}
        (good / name).write_bytes(pickle.dumps(batch, protocol=2))
    assert saturate.train(make_cfg("data=cifar10", f"data.root={good}", "model.width=8"))["progress/step"] == 3


class Readings(Dataset):
    """Float rows; sample 70 is inf (a sensor glitch): it lands in one training batch."""

    def __len__(self):
        return 128

    def __getitem__(self, i):
        x = np.full(4, (i % 5) / 5, dtype=np.float32)
        if i == 70:
            x[:] = np.inf
        return x, float(i % 5) / 5


class Clean(Readings):
    def __getitem__(self, i):
        return np.full(4, (i % 5) / 5, dtype=np.float32), float(i % 5) / 5


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def test_a_skipped_step_leaves_batchnorm_statistics_and_every_checkpoint_finite(tmp_path):
    overrides = [
        "trainer.max_epochs=2",
        "trainer.log_interval=1",
        "trainer.progress=false",
        "loader.batch_size=16",
        "loader.num_workers=0",
    ]
    metrics = saturate.fit(bn_model(), Readings(), Clean(), task="regression", overrides=overrides, run_dir=tmp_path)
    assert metrics["train/nonfinite_steps"] == 2  # the inf sample's batch, once per epoch
    assert np.isfinite(metrics["val/loss"]) and read_metrics(tmp_path)["status"] == "completed"
    for path in (tmp_path / "checkpoints").glob("*.pt"):
        assert all_finite(path), path


def test_divergence_never_writes_non_finite_weights(make_cfg):
    cfg = make_cfg(
        "optim.optimizer.lr=1e10",
        "trainer.max_nonfinite_steps=3",
        "trainer.limit_train_batches=-1",
        "trainer.max_epochs=3",
        "checkpoint.every_n_steps=1",
    )
    with pytest.raises(TrainingDiverged) as err:
        saturate.train(cfg)
    saved = list((Path(cfg.run_dir) / "checkpoints").glob("*.pt"))
    assert saved and all(all_finite(p) for p in saved)
    last = Path(cfg.run_dir) / "checkpoints" / "last.pt"
    expected = f"{last} (step {torch.load(last, weights_only=True)['step']})" if last.exists() else "not saved yet"
    assert f"the last good state is {expected}" in str(err.value)


def test_a_model_holding_nan_is_never_saved(tmp_path, caplog):
    from saturate.checkpoint.checkpointer import Checkpointer
    from saturate.config.schema import CheckpointConfig
    from saturate.loop.engine import TrainState

    model = bn_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    parts = {"optimizer": optimizer, "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)}
    cp = Checkpointer(
        tmp_path,
        CheckpointConfig(monitor="val/loss", mode="min"),
        interval=1,
        model=model,
        stateful=parts,
        config={},
        fingerprint={},
    )
    cp.save(TrainState(epoch=1, step=10), {"val/loss": 0.5})
    model[1].running_var.fill_(float("nan"))
    with caplog.at_level(logging.ERROR, logger="saturate"):
        cp.save(TrainState(epoch=2, step=20), {"val/loss": 0.1})
    assert "step 20: not saving a checkpoint: 1 tensor(s) of the model hold NaN or inf (1.running_var)" in caplog.text
    assert f"the last good state is {tmp_path / 'last.pt'} (step 10)" in caplog.text
    assert torch.load(tmp_path / "last.pt", weights_only=True)["step"] == 10 and all_finite(tmp_path / "best.pt")
    model[1].running_var.fill_(1.0)
    cp.save(TrainState(epoch=3, step=30), {"val/loss": float("nan")})  # a NaN metric is never the best
    assert torch.load(tmp_path / "best.pt", weights_only=True)["step"] == 10


def test_a_finished_run_resumed_trains_nothing(make_cfg, caplog):
    first = make_cfg("trainer.limit_train_batches=-1")  # 1 epoch: 44 steps of 32
    saturate.train(first)
    again = make_cfg(f"run_dir={first.run_dir}", "trainer.limit_train_batches=-1", "trainer.resume=auto")
    with caplog.at_level(logging.WARNING, logger="saturate"):
        metrics = saturate.train(again)
    assert "nothing to train" in caplog.text
    assert max(e.step for e in events(first.run_dir).Scalars("train/loss")) == 44
    assert metrics["progress/step"] == 44
    shorter = make_cfg(
        f"run_dir={first.run_dir}",
        "trainer.limit_train_batches=-1",
        "trainer.max_epochs=3",
        "trainer.max_steps=5",
        "trainer.resume=auto",
    )
    assert saturate.train(shorter)["progress/step"] == 44  # past max_steps already: no step more


def test_a_changed_learning_rate_on_resume_is_applied_and_said(make_cfg, caplog):
    common = ["optim.schedule=constant", "optim.warmup_epochs=0", "trainer.log_interval=1"]
    first = make_cfg(*common)
    saturate.train(first)
    resumed = make_cfg(
        *common, f"run_dir={first.run_dir}", "trainer.max_epochs=2", "trainer.resume=auto", "optim.optimizer.lr=0.01"
    )
    with caplog.at_level(logging.WARNING, logger="saturate"):
        saturate.train(resumed)
    lrs = {e.step: e.value for e in events(first.run_dir).Scalars("train/lr")}
    assert lrs[3] == pytest.approx(0.1) and lrs[4] == pytest.approx(0.01) and lrs[6] == pytest.approx(0.01)
    assert "applied from step 3" in caplog.text and "group 0 lr 0.1 -> 0.01" in caplog.text


def test_resuming_with_another_optimizer_is_a_clear_error(make_cfg):
    first = make_cfg()
    saturate.train(first)
    with pytest.raises(CheckpointError, match="was trained with SGD, this run's optimizer is AdamW"):
        saturate.train(
            make_cfg(f"run_dir={first.run_dir}", "trainer.max_epochs=2", "trainer.resume=auto", "optim=adamw")
        )


def test_resuming_another_model_names_what_does_not_fit(make_cfg):
    first = make_cfg()
    saturate.train(first)
    with pytest.raises(CheckpointError) as err:
        saturate.train(
            make_cfg(f"run_dir={first.run_dir}", "trainer.max_epochs=2", "trainer.resume=auto", "model.width=16")
        )
    assert "does not fit this run's model" in str(err.value) and "size mismatch for" in str(err.value)


class SlowValidation(Dataset):
    """A validation set whose 40th sample brings a SIGTERM (a scheduler preempting a long
    evaluation); counts the samples read."""

    read = 0

    def __len__(self):
        return 320

    def __getitem__(self, i):
        SlowValidation.read += 1
        if i == 40:
            signal.raise_signal(signal.SIGTERM)
        return np.full(4, (i % 5) / 5, dtype=np.float32), float(i % 5) / 5


def test_sigterm_during_evaluation_saves_and_stops_between_batches(tmp_path):
    from saturate.loop.faults import Preempted

    # evaluation reading its batches from the DataLoader: held resident (loader.resident=auto takes such a
    # set on a CPU), the set would be read whole at start-up instead
    overrides = [*TINY, "trainer.limit_val_batches=-1", "loader.resident=false"]
    with pytest.raises(Preempted) as stopped:
        saturate.fit(bn_model(), Clean(), SlowValidation(), task="regression", overrides=overrides, run_dir=tmp_path)
    assert stopped.value.code == 143
    assert SlowValidation.read < 100  # 2 of 10 batches, then stopped
    assert read_metrics(tmp_path)["status"] == "preempted"
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["step"] == 3


FREEZES = """
import os, signal, threading, time
import numpy as np
from torch import nn
from torch.utils.data import Dataset, get_worker_info

class Freezes(Dataset):
    '''In a worker, sample 90 freezes its process (kill -STOP) 50 ms after it is read: after the
    batch is queued, while the main process (busy with a 0.2 s step) has yet to take over its
    shared memory from the frozen worker.'''
    classes = [0, 1]

    def __len__(self):
        return 256

    def __getitem__(self, i):
        if i == 90 and get_worker_info() is not None:
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        return np.full(4, i % 2, dtype=np.float32), i % 2

class Slow(nn.Linear):
    def forward(self, x):
        if self.training:
            time.sleep(0.2)
        return super().forward(x)

def load():
    return Freezes(), Freezes()
"""


@pytest.mark.slow
def test_a_frozen_worker_fails_the_run_within_the_timeout_and_saves(tmp_path):
    (tmp_path / "freezes.py").write_text(FREEZES)
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "freezes.yaml").write_text("_target_: freezes.load\n")
    args = [
        sys.executable,
        str(ROOT / "train.py"),
        f"hydra.searchpath=[file://{tmp_path}/conf]",
        "data=freezes",
        "model._target_=freezes.Slow",
        "~model.width",
        "~model.norm",
        "+model.in_features=4",
        "+model.out_features=2",
        "loader.num_workers=2",
        "loader.timeout_s=5",
        "loader.batch_size=16",
        "trainer.max_epochs=2",
        "trainer.progress=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    start = time.monotonic()
    proc = subprocess.Popen(
        args,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            child.kill()
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        for p in psutil.process_iter(["cmdline"]):  # the frozen worker, if the run left it behind
            if p.info["cmdline"] and str(tmp_path / "run") in " ".join(p.info["cmdline"]) and p.pid != os.getpid():
                p.kill()
    assert time.monotonic() - start < 60
    assert proc.returncode == 1, err[-2000:]
    assert "no batch within loader.timeout_s=5 s" in err and "Traceback" not in err
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    assert last.is_file() and 0 < torch.load(last, weights_only=True)["step"] < 16


# -- round four (issue 36): the report scripts treat a sweep dir as untrusted


def a_sweep(root: Path, jobs: int = 3) -> Path:
    """A sweep dir as `train.py -m` leaves it: numbered job dirs with `.hydra/overrides.yaml`
    and `metrics.json`."""
    for n in range(jobs):
        job = root / f"{n}_batch_size-{16 << n}"
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- loader.batch_size={16 << n}\n- trainer.max_epochs=1\n")
        metrics = {"status": "completed", "perf/samples_per_s": 100.0 * (n + 1), "perf/data_wait_frac": 0.1}
        (job / "metrics.json").write_text(json.dumps({**metrics, "batch_size": 16 << n, "val/acc": 0.5}))
    return root


def sweep_report(directory: Path) -> subprocess.CompletedProcess:
    return python("-m", "saturate", "sweep-report", directory, timeout=120)


def test_a_report_never_writes_through_a_symlink_nor_copies_lines_from_a_run(tmp_path):
    """A planted sweep.md -> a file outside: the file outside stays as it was, the link is
    refused by name; a job's error text with newlines stays one table cell."""
    sweep = a_sweep(tmp_path / "sweep")
    victim = tmp_path / "victim.sh"
    victim.write_text("original\n")
    (sweep / "sweep.md").symlink_to(victim)
    (sweep / "sweep.csv").symlink_to(tmp_path / "elsewhere.csv")
    job = next(sweep.glob("1_*"))
    (job / "metrics.json").write_text(json.dumps({"status": "failed", "error": "x\ntouch /tmp/pwned\n| a | b |"}))
    done = sweep_report(sweep)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert victim.read_text() == "original\n" and not (tmp_path / "elsewhere.csv").exists()
    assert f"sweep_report: refusing to write {sweep / 'sweep.md'}: it is a symbolic link" in done.stderr
    assert f"sweep_report: refusing to write {sweep / 'sweep.csv'}: it is a symbolic link" in done.stderr
    assert not any(line.startswith("touch") for line in done.stdout.splitlines())
    assert "x\\ntouch /tmp/pwned\\n\\| a \\| b \\|" in done.stdout
    assert not list(sweep.glob(".*tmp*"))  # no temporary left behind

    (sweep / "sweep.md").unlink()
    assert sweep_report(sweep).returncode == 1  # sweep.csv still refused ...
    text = (sweep / "sweep.md").read_text()  # ... but sweep.md written, whole
    assert not any(line.startswith("touch") for line in text.splitlines()) and "3 jobs, 2 completed" in text


def test_a_report_does_not_follow_a_job_dir_or_file_out_of_the_sweep(tmp_path):
    sweep = a_sweep(tmp_path / "sweep")
    outside = a_sweep(tmp_path / "outside", jobs=1) / "0_batch_size-16"
    (sweep / "7_root").symlink_to(outside)
    job = next(sweep.glob("0_*"))
    (job / "metrics.json").unlink()
    (job / "metrics.json").symlink_to(outside / "metrics.json")
    (next(sweep.glob("2_*")) / "metrics.json").unlink()
    (next(sweep.glob("2_*")) / "metrics.json").symlink_to("/dev/zero")
    done = sweep_report(sweep)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert f"sweep_report: passing over {sweep / '7_root'}: a symbolic link" in done.stderr
    assert f"sweep_report: passing over {job / 'metrics.json'}: a symbolic link" in done.stderr
    assert "3 jobs, 1 completed" in (sweep / "sweep.md").read_text()


@pytest.mark.parametrize(
    "mistake",
    ["model.width=-3", "optim.optimizer.lr=-1"],  # found building the model; building the optimizer
)
def test_trainer_restart_with_a_mistake_deletes_nothing(make_cfg, mistake):
    from tests.checkpoint.test_rundir import finished, unchanged

    run_dir, saved = finished(make_cfg)
    with pytest.raises(saturate.errors.UserError):
        saturate.train(make_cfg(f"run_dir={run_dir}", "trainer.restart=true", mistake))
    assert unchanged(run_dir, saved) and read_metrics(run_dir)["status"] == "completed"
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1


def test_trainer_restart_deletes_everything_of_the_earlier_run_and_lists_it(make_cfg, caplog):
    cfg = make_cfg("trainer.predict=val")
    saturate.train(cfg)
    run_dir = Path(cfg.run_dir)
    (run_dir / "checkpoints" / "my_notes.txt").write_text("mine")
    earlier_events = set(run_dir.glob("events.out.tfevents.*"))  # its scalars and HParams session
    assert (run_dir / "predictions" / "val.npz").is_file() and len(earlier_events) == 1
    with caplog.at_level(logging.WARNING, logger="saturate"):
        saturate.train(make_cfg(f"run_dir={run_dir}", "trainer.restart=true", "data.val_fraction=0.5"))
    assert not (run_dir / "predictions").exists()  # the earlier run's predictions of another split
    events = set(run_dir.glob("events.out.tfevents.*"))
    assert len(events) == 1 and not events & earlier_events  # this run's events (and session) only
    assert (run_dir / "checkpoints" / "my_notes.txt").read_text() == "mine"  # not saturate's: kept
    (said,) = [r.getMessage() for r in caplog.records if "trainer.restart=true: deleted" in r.getMessage()]
    first_events = next(iter(earlier_events)).relative_to(run_dir)
    for name in ("checkpoints/last.pt", "checkpoints/best.pt", "predictions/val.npz", "metrics.json", "report.md"):
        assert name in said, said
    assert str(first_events) in said


# -- a user's hook that exits, interrupts or will not return (round four: c04, c05, c07, c124)


class Leaves:
    """A hook that ends the process its own way: sys.exit, a KeyboardInterrupt no signal sent,
    a GeneratorExit."""

    def __init__(self, hook: str, error: BaseException):
        self.error = error
        setattr(self, hook, self.leave)

    def leave(self, run, *args):
        raise self.error


@pytest.mark.parametrize(
    ("hook", "error", "says"),
    [
        ("on_eval_end", SystemExit(0), "Leaves.on_eval_end raised SystemExit (exit status 0)"),
        ("on_train_batch_end", KeyboardInterrupt(), "Leaves.on_train_batch_end raised KeyboardInterrupt"),
        ("on_log", GeneratorExit("closed"), "Leaves.on_log raised GeneratorExit: closed"),
    ],
    ids=["SystemExit", "KeyboardInterrupt", "GeneratorExit"],
)
def test_a_hook_that_exits_is_the_hooks_failure_saved_and_recorded(tmp_path, hook, error, says):
    from saturate.callbacks import CallbackError
    from tests.hostile.test_bad_input import Samples, fit, mlp, windows

    with pytest.raises(CallbackError) as failed:
        data = Samples(64, windows)
        fit(mlp(), data, data, task="regression", callbacks={"Leaves": Leaves(hook, error)}, run_dir=tmp_path)
    assert str(failed.value).startswith(says), failed.value
    assert "a hook may not end the run" in str(failed.value)
    assert read_metrics(tmp_path)["status"] == "failed" and (tmp_path / "checkpoints" / "last.pt").is_file()


LEAVING = """
import sys, time

class Raise:
    def __init__(self, exc="ValueError"):
        self.exc = exc

    def on_eval_end(self, run, metrics):
        if self.exc == "SystemExit":
            sys.exit(0)
        raise ValueError("boom")


class Swallows:
    def on_log(self, run, metrics, step):
        import os, signal
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            while True:
                try:
                    time.sleep(0.2)
                except BaseException:
                    pass
"""


@pytest.mark.slow
def test_a_sweep_whose_hook_exits_fails_that_job_runs_the_others_and_says_so(tmp_path):
    (tmp_path / "leaving.py").write_text(LEAVING)
    args = ["-m", *TINY, "+callbacks.bad._target_=leaving.Raise", "+callbacks.bad.exc=SystemExit,ValueError"]
    done = run_cli(*args, "hydra.sweep.dir=sweep", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    jobs = sorted((tmp_path / "sweep").glob("[0-9]*"))
    assert len(jobs) == 2
    assert [read_metrics(j)["status"] for j in jobs] == ["failed", "failed"]
    assert "bad.on_eval_end raised SystemExit (exit status 0)" in read_metrics(jobs[0])["error"]


@pytest.mark.slow
def test_a_hook_that_swallows_the_interrupt_is_abandoned_at_sigterm(tmp_path):
    from saturate.callbacks.dispatch import HANG_S

    (tmp_path / "leaving.py").write_text(LEAVING)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *TINY, "+callbacks.sw._target_=leaving.Swallows", "hydra.run.dir=r"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 143, done.stderr[-3000:]
    assert time.monotonic() - start < 2 * HANG_S + 60
    out = done.stdout + done.stderr
    assert "sw.on_log did not return within 5 s of the stop signal and swallowed the interrupt: abandoned" in out, out
    assert torch.load(tmp_path / "r" / "checkpoints" / "last.pt", weights_only=True)["step"] == 2
    assert read_metrics(tmp_path / "r")["status"] == "preempted"


# -- SIGINT at odd moments (round four: c119b, c121, c122b)


@pytest.mark.usefixtures("ctrl_c_reaches_us")
@pytest.mark.parametrize("where", ["torch.save", "gathering the state"])
def test_ctrl_c_twice_while_a_checkpoint_is_written_leaves_it_whole(tmp_path, monkeypatch, where):
    """The second Ctrl-C (which interrupts at once) arrives inside torch.save, or while the
    checkpoint's state is gathered: it waits for the file to be whole, then interrupts."""
    import saturate.checkpoint.checkpointer as checkpoint
    from tests.hostile.test_bad_input import Samples, fit, mlp, windows

    module, name = (torch, "save") if where == "torch.save" else (checkpoint, "rng_state")
    real = getattr(module, name)

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C twice while the checkpoint is being made
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        fit(mlp(), Samples(64, windows), Samples(32, windows), task="regression", run_dir=tmp_path)
    monkeypatch.undo()
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["step"] >= 1
    assert not list((tmp_path / "checkpoints").glob(".*.tmp"))
    recorded = read_metrics(tmp_path)
    assert recorded["status"] == "failed" and "interrupted: a second Ctrl-C" in recorded["error"]


class CtrlCTwice:
    def on_eval_end(self, run, metrics):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)


@pytest.mark.usefixtures("ctrl_c_reaches_us")
def test_ctrl_c_twice_during_an_evaluation_is_recorded_not_a_hooks_failure(tmp_path):
    from tests.hostile.test_bad_input import Samples, fit, mlp, windows

    with pytest.raises(KeyboardInterrupt):
        fit(
            mlp(),
            Samples(64, windows),
            Samples(32, windows),
            task="regression",
            callbacks=[CtrlCTwice()],
            run_dir=tmp_path,
        )
    recorded = read_metrics(tmp_path)
    assert recorded["status"] == "failed" and "interrupted: a second Ctrl-C" in recorded["error"]


def test_an_interrupt_the_run_did_not_catch_is_one_line_and_exit_130(capsys):
    """SIGINT while torch is imported (before the run's own handler): no traceback."""
    from saturate.cli import run_hydra_app

    def main():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exited:
        run_hydra_app(main)
    assert exited.value.code == 130
    err = capsys.readouterr().err
    assert err.strip().startswith("interrupted (Ctrl-C): stopped at once") and "Traceback" not in err


# -- what metrics.json says after a failure that came after training (round four: c02, c111)


def test_a_resume_that_trained_and_then_failed_records_its_failure(make_cfg, monkeypatch, caplog):
    cfg = make_cfg()
    saturate.train(cfg)  # a finished run: metrics.json says completed
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) > 2:  # the disk fills up as the resumed run saves
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CheckpointError):
        saturate.train(make_cfg(f"run_dir={cfg.run_dir}", "trainer.resume=auto", "trainer.max_epochs=3"))
    monkeypatch.undo()
    recorded = read_metrics(cfg.run_dir)
    assert recorded["status"] == "failed" and "No space left on device" in recorded["error"]
    assert "failed before it trained" not in caplog.text


def test_a_hook_failing_after_the_run_completed_says_so(tmp_path, caplog):
    from saturate.callbacks import CallbackError
    from tests.hostile.test_bad_input import Samples, fit, mlp, windows

    class EndsBadly:
        def on_run_end(self, run, metrics):
            raise ValueError("upload refused")

    data = Samples(64, windows)
    with pytest.raises(CallbackError, match="EndsBadly.on_run_end raised ValueError: upload refused"):
        fit(mlp(), data, data, task="regression", callbacks=[EndsBadly()], run_dir=tmp_path)
    recorded = read_metrics(tmp_path)
    assert recorded["status"] == "failed" and "after the run completed" in recorded["error"]
    assert "val/loss" in recorded and (tmp_path / "checkpoints" / "best.pt").is_file()
    assert "failed before it trained" not in caplog.text


class Meddles:
    """Hooks that change the dicts they are given (c08): what the others record stays as measured."""

    def on_eval_end(self, run, metrics):
        metrics["acc"] = float("nan")
        metrics.clear()

    def on_log(self, run, metrics, step):
        metrics.clear()


def test_a_hook_that_changes_its_metrics_changes_nothing_recorded(tmp_path):
    from tests.hostile.test_bad_input import Samples, fit, mlp, windows

    data = Samples(64, windows)
    metrics = fit(mlp(), data, data, task="regression", callbacks={"meddles": Meddles()}, run_dir=tmp_path)
    assert np.isfinite(metrics["val/mae"]) and np.isfinite(read_metrics(tmp_path)["val/mae"])
    assert "val/mae" in events(tmp_path).Tags()["scalars"] and read_metrics(tmp_path)["best"]["value"] is not None


def test_run_leaves_the_process_environment_as_it_found_it(capsys, monkeypatch):
    """run_hydra_app() sets HYDRA_FULL_ERROR for itself: left set in a process that goes on, every
    train.py started from it after showed Hydra's traceback instead of one line (seen as 7 CLI
    tests failing after this file's interrupt test ran in the same pytest worker)."""
    from saturate.cli import run_hydra_app

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def main():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit):
        run_hydra_app(main)
    assert "HYDRA_FULL_ERROR" not in os.environ
