"""Never lose a run: a stopped run resumed equals the uninterrupted one bit for bit, on the
CPU with trainer.deterministic=true; checkpoints survive crashes and kills mid-save."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import saturate
from saturate.checkpoint import files as checkpoint
from saturate.loop.faults import Preempted
from tests.conftest import popen, read_metrics, run_cli, stopped_after_first_save
from tests.trainer.test_run import events

# digits, 11 steps per epoch, every step's loss logged; a narrow small_cnn (width 8): what a resume restores is the
# same, its arithmetic a sixteenth
EXACT = [
    "device=cpu",
    "trainer.deterministic=true",
    "trainer.max_epochs=3",
    "trainer.log_interval=1",
    "trainer.limit_train_batches=-1",
    "trainer.limit_val_batches=-1",
    "loader.batch_size=128",
    "model.width=8",
]


def step_losses(*run_dirs) -> list[float]:
    """train/loss of every step, in step order, across a run and its resumption(s)."""
    by_step = {}
    for run_dir in run_dirs:
        by_step.update({e.step: e.value for e in events(run_dir).Scalars("train/loss")})
    return [by_step[s] for s in sorted(by_step)]


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "checkpoints" / "last.pt", weights_only=False)["model"]


class SignalAt:
    """A callback (the public protocol) that delivers a real signal to this process as the
    run finishes step `step`: a scheduler preempting it at a known point."""

    def __init__(self, step: int, signum: int = int(signal.SIGUSR1)):
        self.step, self.signum = step, signum

    def on_train_batch_end(self, run, loss) -> None:
        if run.step == self.step:
            signal.raise_signal(self.signum)


def signal_at(step: int, signum: int = signal.SIGUSR1) -> list[str]:
    """The overrides that add a SignalAt callback to a run."""
    return [
        "+callbacks.signal._target_=tests.checkpoint.test_resume.SignalAt",
        f"+callbacks.signal.step={step}",
        f"+callbacks.signal.signum={int(signum)}",
    ]


def interrupted_then_resumed(make_cfg, monkeypatch, overrides, at_step, signum=signal.SIGUSR1):
    first = make_cfg(*EXACT, *overrides, *signal_at(at_step, signum))
    with pytest.raises(Preempted) as stopped:
        saturate.train(first)
    assert stopped.value.code == 128 + signum
    record = read_metrics(first.run_dir)
    assert (record["status"], record["stopped_by"]) == ("preempted", signal.Signals(signum).name)
    assert record["resume_with"].endswith(f"hydra.run.dir={first.run_dir} trainer.resume=auto")
    assert torch.load(Path(first.run_dir) / "checkpoints/last.pt", weights_only=False)["step"] == at_step
    second = make_cfg(*EXACT, *overrides, f"trainer.resume={first.run_dir}")
    saturate.train(second)
    return first.run_dir, second.run_dir


SCENARIOS = {
    "epoch-boundary": ([], 11),
    # SIGTERM in epoch 2 under checkpoint_interval=auto: no epoch-end save before it (a run under a minute)
    "mid-epoch-sigterm": ([], 16),
    "mid-epoch-2-workers": (["loader.num_workers=2"], 16),
    "mid-epoch-gpu-augmentation": (["augmentation=gpu"], 16),
    "mid-epoch-cpu-augmentation-2-workers": (["augmentation=cpu", "loader.num_workers=2"], 16),
    "mid-epoch-resident": (["loader=resident", "augmentation=gpu"], 16),
    # the epoch's order drawn from torch's generator: the checkpoint keeps the seed drawn when the epoch began
    "mid-epoch-global-order-resident": (["loader.order=global", "loader=resident"], 16),
    "mid-epoch-global-order-2-workers": (["loader.order=global", "loader.num_workers=2"], 16),
    # persistent iterators, reused, draw nothing; the resumed run's are fresh (its validation's too)
    "mid-epoch-global-order-persistent-worker": (
        ["loader.order=global", "loader.num_workers=1", "loader.persistent_workers=true"],
        16,
    ),
    # evaluations every 4 steps (12 and 16 around the stop), the LR stepped per step
    "between-evaluations-one-cycle-per-step": (
        [
            "trainer.eval_every=4",
            "optim.scheduler={_target_:torch.optim.lr_scheduler.OneCycleLR,_partial_:true,max_lr:0.2,total_steps:33}",
            "optim.scheduler_interval=step",
        ],
        14,
    ),
    # ReduceLROnPlateau fed val/acc at each evaluation (its counters in the checkpoint)
    "between-evaluations-reduce-on-plateau": (
        [
            "trainer.eval_every=4",
            "optim.scheduler={_target_:torch.optim.lr_scheduler.ReduceLROnPlateau,_partial_:true,patience:0,factor:0.5}",
        ],
        14,
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resumed_run_equals_the_uninterrupted_one(make_cfg, monkeypatch, name):
    overrides, at_step = SCENARIOS[name]
    full = make_cfg(*EXACT, *overrides)
    saturate.train(full)
    signum = signal.SIGTERM if name.endswith("sigterm") else signal.SIGUSR1
    first, second = interrupted_then_resumed(make_cfg, monkeypatch, overrides, at_step, signum)

    expected = step_losses(full.run_dir)
    assert len(expected) == 33
    assert step_losses(first, second) == expected  # zero tolerance
    weights, resumed = final_weights(full.run_dir), final_weights(second)
    assert weights.keys() == resumed.keys()
    for key in weights:
        assert torch.equal(weights[key], resumed[key]), key


def test_a_run_stopped_at_its_last_step_resumes_to_its_last_evaluation(make_cfg, monkeypatch):
    """Stopped after the last step but before the last evaluation (a slow-suite failure: the
    report read a peak memory that no training window had logged): the resumed run trains
    nothing, evaluates, reports and ends as the uninterrupted one did."""
    full = make_cfg(*EXACT)
    expected = saturate.train(full)
    first, second = interrupted_then_resumed(make_cfg, monkeypatch, [], 33)
    resumed = read_metrics(second)
    assert resumed["status"] == "completed" and resumed["progress/step"] == 33
    assert resumed["val/acc"] == expected["val/acc"] and "Verdict" in (Path(second) / "report.md").read_text()


def test_resume_auto_in_the_same_run_dir_continues_and_keeps_tensorboard_consistent(make_cfg):
    cfg = make_cfg(*EXACT, *signal_at(16))
    with pytest.raises(Preempted):
        saturate.train(cfg)
    again = make_cfg(*EXACT, "trainer.resume=auto")
    again.run_dir = cfg.run_dir
    metrics = saturate.train(again)
    assert metrics["progress/step"] == 33
    steps = [e.step for e in events(cfg.run_dir).Scalars("train/loss")]
    assert sorted(set(steps)) == list(range(1, 34))


def test_resume_auto_without_a_checkpoint_starts_fresh(make_cfg):
    metrics = saturate.train(make_cfg("trainer.resume=auto"))
    assert metrics["progress/step"] == 3


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_the_resumed_run_equals_the_uninterrupted_one(tmp_path):
    args = [*EXACT, "trainer.max_epochs=4", "trainer.progress=false"]
    run_dir = tmp_path / "interrupted"
    returncode, out = stopped_after_first_save(args, run_dir, tmp_path)
    assert returncode == 143, out
    assert "SIGTERM at step" in out and f"saved {run_dir / 'checkpoints' / 'last.pt'} in" in out
    stopped_at = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["step"]
    assert 11 <= stopped_at < 44

    hint = out.split("resume with: ", 1)[1].splitlines()[0]  # the command the run printed, run as printed
    assert hint.startswith("python ") and hint.endswith("trainer.resume=auto")
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # "python" is this test's interpreter
    resumed = subprocess.run(
        hint, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=240, env={**os.environ, "PATH": path}
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {run_dir / 'checkpoints'}" in resumed.stdout
    full = run_cli(*args, f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    assert step_losses(run_dir) == step_losses(tmp_path / "full")
    for key, value in final_weights(tmp_path / "full").items():
        assert torch.equal(value, final_weights(run_dir)[key]), key


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    checkpoint.atomic_save({"model": {}, "step": 5}, path)

    def broken_save(obj, f):
        f.write(b"half a checkpoint")
        raise RuntimeError("injected failure during torch.save")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(RuntimeError, match="injected"):
        checkpoint.atomic_save({"model": {}, "step": 6}, path)
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 5
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no partial file left behind


SAVER = """
import sys, torch
from pathlib import Path
from saturate.checkpoint.files import atomic_save
out = Path(sys.argv[1])
big = torch.randn(16, 1024, 1024)  # 64 MB: a save takes long enough to be killed in the middle
for step in range(1, 10_000):
    atomic_save({"model": {"w": big}, "step": step}, out / "last.pt")
    print(step, flush=True)
"""


def test_sigkill_during_a_save_never_leaves_a_partial_checkpoint(tmp_path):
    proc = popen("-c", SAVER, tmp_path)
    saved = int(proc.stdout.readline())  # one complete save
    time.sleep(0.15)  # somewhere inside a later one
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    newest = checkpoint.newest(tmp_path)
    assert newest == tmp_path / "last.pt"
    ckpt = checkpoint.load(newest)
    assert ckpt["step"] >= saved and ckpt["model"]["w"].shape == (16, 1024, 1024)
    assert all(p.name in ("last.pt", ".last.pt.tmp") for p in tmp_path.iterdir())


def test_top_k_and_step_checkpoints(make_cfg):
    cfg = make_cfg(
        "trainer.max_epochs=4",
        "checkpoint.top_k=2",
        "checkpoint.every_n_steps=2",
        "checkpoint.monitor=val/loss",
        "checkpoint.mode=min",
    )
    saturate.train(cfg)
    folder = Path(cfg.run_dir) / "checkpoints"
    tops = sorted(p.name for p in folder.glob("top-*.pt"))
    assert len(tops) == 2
    best = checkpoint.load(folder / "best.pt")
    kept = [checkpoint.load(folder / name) for name in tops]
    assert best["best"] == min(k["best"] for k in kept)  # best.pt is the best of the kept ones
    assert checkpoint.load(folder / "last.pt")["step"] == 12


def test_checkpoints_carry_the_fingerprint_and_config(make_cfg):
    cfg = make_cfg()
    saturate.train(cfg)
    ckpt = checkpoint.load(Path(cfg.run_dir) / "checkpoints/last.pt")
    assert ckpt["fingerprint"]["torch"] == str(torch.__version__) and ckpt["fingerprint"]["world_size"] == 1
    assert ckpt["config"]["run_dir"] == cfg.run_dir
    assert {"python", "numpy", "torch"} <= ckpt["rng"].keys()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux")
def test_sigint_once_stops_cleanly(make_cfg, monkeypatch):
    # as in a terminal, even if this runs in the background
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cfg = make_cfg(*EXACT, *signal_at(5, signal.SIGINT))
        with pytest.raises(Preempted) as stopped:
            saturate.train(cfg)
        assert stopped.value.code == 130
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers are put back
    finally:
        signal.signal(signal.SIGINT, before)


def test_an_ignored_signal_stays_ignored(make_cfg):
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # e.g. a background job of a non-interactive shell
    try:
        saturate.train(make_cfg())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_preempted_run_leaves_no_worker_processes_behind(make_cfg, monkeypatch):
    """Stopped mid-epoch with two workers, while the exception (and its traceback, which
    holds the loop's frames) is still alive: the workers are gone already, not left for the
    garbage collector (which, finalising a reference cycle, waited 5 s per worker)."""
    import psutil

    before = {p.pid for p in psutil.Process().children()}  # an xdist worker may hold other tests' children
    with pytest.raises(Preempted) as stopped:
        saturate.train(make_cfg(*EXACT, "loader.num_workers=2", *signal_at(16)))
    assert stopped.value.__traceback__ is not None
    assert [p for p in psutil.Process().children() if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE] == []


def test_a_checkpoint_from_before_loader_order_resumes_as_before(make_cfg):
    """Checkpoints written before loader.order have no "order" entry (the epoch's drawn seed):
    they resume, in the seeded order they were written with, as the uninterrupted run."""
    full = make_cfg(*EXACT)
    saturate.train(full)
    first = make_cfg(*EXACT, *signal_at(16))
    with pytest.raises(Preempted):
        saturate.train(first)
    path = Path(first.run_dir) / "checkpoints" / "last.pt"
    older = torch.load(path, weights_only=False)
    del older["order"]
    torch.save(older, path)
    second = make_cfg(*EXACT, f"trainer.resume={path}")
    saturate.train(second)
    assert step_losses(first.run_dir, second.run_dir) == step_losses(full.run_dir)
