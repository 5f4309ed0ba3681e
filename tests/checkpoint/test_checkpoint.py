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
from saturate.checkpoint import checkpointer as checkpoint
from saturate.checkpoint import files
from saturate.config.schema import CheckpointConfig
from saturate.trainer.build import UserObjects
from tests.conftest import read_metrics


def checkpointer(directory: Path, background: bool = True, top_k: int = 1):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    cfg = CheckpointConfig(monitor="val/acc", mode="max", background=background, top_k=top_k)
    parts = {"optimizer": optimizer}
    return checkpoint.Checkpointer(directory, cfg, interval=1, model=model, stateful=parts, config={}, fingerprint={})


def at(step: int):
    return SimpleNamespace(epoch=1, step=step, batch_in_epoch=0)


@pytest.fixture
def held_writes(monkeypatch):
    """The thread's writes wait for `release.set()` (a slow disk); `started` is set as one begins."""
    started, release, real = threading.Event(), threading.Event(), files._atomic_save

    def slow(obj, path):
        started.set()
        assert release.wait(30), "the test never released the write"
        real(obj, path)

    monkeypatch.setattr(files, "_atomic_save", slow)
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
    assert saver.saved_step == 2 and saver.last_good().endswith("(step 2)")  # the failed saves claim nothing


def test_a_stop_save_after_a_failed_background_write_is_still_made(tmp_path, caplog):
    """The save of a stop (in the loop) logs the failure of the write before it and saves."""
    saver = checkpointer(tmp_path)
    (tmp_path / "best.pt").mkdir()  # the first save's best.pt fails in the thread
    saver.save(at(1), {"val/acc": 0.5}, background=True)
    saver.save(at(2), {}, background=False)
    assert "best.pt: Is a directory" in caplog.text
    assert checkpoint.load(tmp_path / "last.pt")["step"] == 2 and saver.saved_step == 2


def test_a_top_k_file_that_drops_out_is_removed_only_once_its_replacement_is_written(tmp_path, held_writes):
    started, release = held_writes
    release.set()
    saver = checkpointer(tmp_path, top_k=2)
    for step, acc in ((1, 0.5), (2, 0.6)):
        saver.save(at(step), {"val/acc": acc}, background=True)
    saver.flush()
    first, second = "top-001-0000001.pt", "top-001-0000002.pt"
    assert {p.name for p in tmp_path.glob("top-*.pt")} == {first, second}
    release.clear()
    started.clear()
    saver.save(at(3), {"val/acc": 0.7}, background=True)  # step 1's file drops out
    assert started.wait(30)
    assert (tmp_path / first).exists()  # still there while its replacement is written
    release.set()
    saver.flush()
    assert {p.name for p in tmp_path.glob("top-*.pt")} == {second, "top-001-0000003.pt"}
    assert [name for _, name in saver.top] == ["top-001-0000003.pt", second]


def test_without_background_the_files_are_written_before_save_returns(tmp_path):
    saver = checkpointer(tmp_path, background=False)
    saver.save(at(7), {"val/acc": 0.5}, background=True)  # checkpoint.background=false wins
    assert checkpoint.load(tmp_path / "last.pt")["step"] == 7 and saver.writer.thread is None


class ReadsItsCheckpoint:
    """A user's on_checkpoint hook that reads the file it is given (to upload it, say)."""

    def __init__(self):
        self.steps: list[tuple[int, int]] = []

    def on_checkpoint(self, run, path):
        self.steps.append((run.step, checkpoint.load(Path(path))["step"]))


def test_an_on_checkpoint_hook_reads_the_file_of_its_step(make_cfg, monkeypatch):
    """With such a hook every save is written before it runs (never handed to the thread)."""

    def never(*args):
        raise AssertionError("a save with an on_checkpoint hook went to the thread")

    monkeypatch.setattr(checkpoint.Writer, "submit", never)
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
        assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
        for i, state in a["optimizer"]["state"].items():
            assert all(torch.equal(v, b["optimizer"]["state"][i][k]) for k, v in state.items())
        assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    assert not [p for r in runs for p in (r / "checkpoints").glob(".*.tmp")]


def test_a_callback_subclass_that_does_not_override_on_checkpoint_keeps_saves_in_the_background():
    """Callback's own hooks do nothing: a subclass that overrides only on_eval_end is not given
    on_checkpoint (which would make every save wait for its files)."""
    from saturate.callbacks import Callback
    from saturate.callbacks.dispatch import Observers

    class Evaluations(Callback):
        def on_eval_end(self, run, metrics):
            pass

    observers = Observers({"mine": Evaluations()})
    assert observers.has("on_eval_end") and not observers.has("on_checkpoint")
    assert not observers.has("on_train_batch_end")  # no call per step either


def test_a_failed_top_k_file_says_which_files_of_the_step_were_written(tmp_path):
    from saturate.checkpoint.files import write_files

    (tmp_path / "top-001.pt").mkdir()
    (tmp_path / "top-001.pt" / "kept").write_text("")  # a folder in the top-k file's place
    paths = [tmp_path / "last.pt", tmp_path / "best.pt", tmp_path / "top-001.pt"]
    with pytest.raises(files.CheckpointError) as err:
        write_files({"model": {}, "step": 7}, paths, removed=[])
    assert "top-001.pt" in str(err.value) and "last.pt and best.pt of step 7 written" in str(err.value)
    assert (tmp_path / "last.pt").is_file() and (tmp_path / "best.pt").is_file()
