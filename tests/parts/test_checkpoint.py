"""Checkpoints written beside training (checkpoint.background): the loop waits only for a copy
of the state, the files are what the state was at the save, and they are on disk before
anything reads them."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import saturate
from saturate.compose.build import UserObjects
from saturate.config.schema import CheckpointConfig
from saturate.parts import checkpoint
from tests.conftest import read_metrics


def checkpointer(directory: Path, background: bool = True):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    cfg = CheckpointConfig(monitor="val/acc", mode="max", background=background)
    parts = {"optimizer": optimizer}
    return checkpoint.Checkpointer(directory, cfg, interval=1, model=model, stateful=parts, config={}, fingerprint={})


def at(step: int):
    return SimpleNamespace(epoch=1, step=step, batch_in_epoch=0)


@pytest.fixture
def held_writes(monkeypatch):
    """The thread's writes wait for `release.set()` (a slow disk); `started` is set as one begins."""
    started, release, real = threading.Event(), threading.Event(), checkpoint._atomic_save

    def slow(obj, path):
        started.set()
        assert release.wait(30), "the test never released the write"
        real(obj, path)

    monkeypatch.setattr(checkpoint, "_atomic_save", slow)
    yield started, release
    release.set()


def test_a_background_save_returns_before_the_write_and_keeps_the_state_of_its_step(tmp_path, held_writes):
    started, release = held_writes
    saver = checkpointer(tmp_path)
    weights = saver.model.weight.detach().clone()
    momentum = saver.stateful["optimizer"].state[saver.model.weight]["momentum_buffer"].clone()
    saver.save(at(5), {"val/acc": 0.5}, background=True)
    assert started.wait(30)
    assert not (tmp_path / "last.pt").exists()  # returned while the file is still being written
    with torch.no_grad():  # training goes on meanwhile, in place
        saver.model.weight.add_(1.0)
        saver.stateful["optimizer"].state[saver.model.weight]["momentum_buffer"].mul_(3.0)
    release.set()
    saver.flush()
    for name in ("last.pt", "best.pt"):
        saved = checkpoint.load(tmp_path / name)
        assert saved["step"] == 5 and torch.equal(saved["model"]["weight"], weights)
        assert torch.equal(saved["optimizer"]["state"][0]["momentum_buffer"], momentum)
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_next_save_waits_for_the_one_in_flight_and_a_failed_write_is_raised_there(tmp_path, monkeypatch):
    saver = checkpointer(tmp_path)
    saver.save(at(1), {"val/acc": 0.5}, background=True)
    saver.save(at(2), {"val/acc": 0.4}, background=True)  # waits for step 1's files first
    saver.flush()
    assert checkpoint.load(tmp_path / "last.pt")["step"] == 2 and checkpoint.load(tmp_path / "best.pt")["step"] == 1

    (tmp_path / "last.pt").unlink()
    (tmp_path / "last.pt").mkdir()  # a folder in its place: the thread's write fails
    saver.save(at(3), {"val/acc": 0.3}, background=True)  # returns: the failure is the thread's
    with pytest.raises(checkpoint.CheckpointError, match="last.pt: Is a directory; a folder is in its place"):
        saver.save(at(4), {"val/acc": 0.3}, background=True)
    saver.flush()  # said once, not again


def test_without_background_the_files_are_written_before_save_returns(tmp_path, held_writes):
    started, release = held_writes
    release.set()
    saver = checkpointer(tmp_path, background=False)
    saver.save(at(7), {"val/acc": 0.5}, background=True)  # checkpoint.background=false wins
    assert checkpoint.load(tmp_path / "last.pt")["step"] == 7 and saver.writer.thread is None


class ReadsItsCheckpoint:
    """A user's on_checkpoint hook that reads the file it is given (to upload it, say)."""

    def __init__(self):
        self.steps: list[tuple[int, int]] = []

    def on_checkpoint(self, run, path):
        self.steps.append((run.step, checkpoint.load(Path(path))["step"]))


def test_an_on_checkpoint_hook_reads_the_file_of_its_step(make_cfg):
    hook = ReadsItsCheckpoint()
    cfg = make_cfg("trainer.max_epochs=3", "trainer.eval_every=2")
    saturate.train(cfg, objects=UserObjects(callbacks={"reads": hook}))
    assert len(hook.steps) >= 3 and all(run_step == saved for run_step, saved in hook.steps), hook.steps


def test_background_saves_leave_the_run_and_its_files_as_synchronous_ones(make_cfg):
    """The same seed, with and without background writes: the same metrics, the same last.pt
    and best.pt (weights, optimizer, step), and no temporary file left."""
    runs = []
    for background in ("true", "false"):
        cfg = make_cfg("trainer.max_epochs=3", "trainer.eval_every=2", f"checkpoint.background={background}")
        saturate.train(cfg)
        runs.append(Path(cfg.run_dir))
    first, second = (read_metrics(r) for r in runs)
    for key in ("val/acc", "val/loss", "train/loss", "progress/step"):
        assert first[key] == second[key], key
    for name in ("last.pt", "best.pt"):
        a, b = (checkpoint.load(r / "checkpoints" / name) for r in runs)
        assert a["step"] == b["step"] and a["best"] == b["best"]
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    assert not [p for r in runs for p in (r / "checkpoints").glob(".*.tmp")]
