"""A run directory never loses a run (issue 25, items 4 and 5): a fresh run into a finished
run's directory is refused (or told to start over), a mistake while resuming keeps the
finished run's record, and a second run into a directory in use is refused in one line."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from hydra.errors import CompactHydraException

import saturate
from saturate.checkpoint.rundir import RunDirTaken
from tests.conftest import ROOT, TINY, popen, read_metrics, run_cli


def finished(make_cfg):
    cfg = make_cfg("trainer.max_epochs=2")
    saturate.train(cfg)
    run_dir = Path(cfg.run_dir)
    saved = {p.name: p.read_bytes() for p in [*(run_dir / "checkpoints").glob("*.pt"), run_dir / "metrics.json"]}
    return run_dir, saved


def unchanged(run_dir: Path, saved: dict) -> bool:
    now = {p.name: p.read_bytes() for p in [*(run_dir / "checkpoints").glob("*.pt"), run_dir / "metrics.json"]}
    return now == saved


def test_a_fresh_run_into_a_finished_runs_dir_is_refused_and_changes_nothing(make_cfg):
    run_dir, saved = finished(make_cfg)
    with pytest.raises(RunDirTaken) as e:
        saturate.train(make_cfg(f"run_dir={run_dir}", "model.width=8"))  # trainer.resume forgotten
    message = str(e.value)
    assert message.startswith(f"run_dir: {run_dir} holds the checkpoints of an earlier run (completed, best val/acc ")
    assert "trainer.resume=auto" in message and "trainer.restart=true" in message and "\n" not in message
    assert unchanged(run_dir, saved)


def test_trainer_restart_starts_the_run_over(make_cfg):
    run_dir, _ = finished(make_cfg)
    (run_dir / "checkpoints" / "top-001-0000003.pt").write_bytes((run_dir / "checkpoints" / "last.pt").read_bytes())
    # what the trackers leave (logger=mlflow, logger=wandb; a TensorBoard session sub-run of older runs)
    (run_dir / "mlflow.json").write_text('{"run_id": "earlier"}')
    (run_dir / "wandb" / "offline-run-1-earlier").mkdir(parents=True)
    (run_dir / "wandb" / "run_id").write_text("earlier")
    (run_dir / "tb" / "hparams").mkdir(parents=True)  # the layout before events moved into the run dir
    (run_dir / "tb" / "hparams" / "events.out.tfevents.1.old").write_bytes(b"")
    (run_dir / "tb" / "events.out.tfevents.2.old").write_bytes(b"")
    metrics = saturate.train(make_cfg(f"run_dir={run_dir}", "trainer.restart=true"))
    assert not (run_dir / "mlflow.json").exists() and not (run_dir / "wandb").exists()
    assert not (run_dir / "tb").exists()  # emptied and removed
    # the earlier run's are gone
    assert metrics["progress/step"] == 3 and not (run_dir / "checkpoints" / "top-001-0000003.pt").exists()
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 3
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # this run's events only


def test_resume_and_restart_together_are_a_config_error(make_cfg):
    with pytest.raises(CompactHydraException, match="trainer.restart=True: expected false with trainer.resume=auto"):
        saturate.train(make_cfg("trainer.restart=true", "trainer.resume=auto"))


def test_a_mistake_while_resuming_keeps_the_finished_runs_record(make_cfg):
    run_dir, saved = finished(make_cfg)
    with pytest.raises(CompactHydraException):
        saturate.train(
            make_cfg(f"run_dir={run_dir}", "trainer.resume=auto", "trainer.max_epochs=4", "loader.num_workers=-1")
        )
    assert unchanged(run_dir, saved) and read_metrics(run_dir)["status"] == "completed"
    with pytest.raises(CompactHydraException, match="does not fit this run's model"):  # a mistake found while loading
        saturate.train(make_cfg(f"run_dir={run_dir}", "trainer.resume=auto", "trainer.max_epochs=4", "model.width=8"))
    assert unchanged(run_dir, saved)


def test_the_cli_refuses_in_one_line(tmp_path):
    first = run_cli(*TINY, "hydra.run.dir=r", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = run_cli(*TINY, "hydra.run.dir=r", cwd=tmp_path)
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert f"error: run_dir: {tmp_path / 'r'} holds the checkpoints of an earlier run" in again.stderr


def test_a_second_run_into_a_dir_in_use_is_refused(make_cfg, tmp_path):
    run_dir = tmp_path / "busy"
    args = [*TINY, "trainer.max_epochs=1000", "trainer.limit_train_batches=-1", "trainer.checkpoint_interval=1"]
    args.append(f"hydra.run.dir={run_dir}")
    proc = popen(ROOT / "train.py", *args, cwd=tmp_path, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / "last.pt").exists():  # training, lock held
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        with pytest.raises(RunDirTaken, match=rf"run_dir: {run_dir} is in use by another run \(process {proc.pid}\)"):
            saturate.train(make_cfg(f"run_dir={run_dir}", "trainer.resume=auto"))
        assert read_metrics_or_none(run_dir) is None  # nothing written into the other run's dir
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, proc.stderr.read()
    assert read_metrics(run_dir)["status"] == "preempted"  # the first run's own record


def read_metrics_or_none(run_dir: Path):
    path = run_dir / "metrics.json"
    return json.loads(path.read_text()) if path.exists() else None
