"""trainer.checkpoint_interval: `auto` (the default) saves an epoch's end once a bounded stretch
of wall time has passed since the last save, decided on rank 0; an integer N every N-th epoch;
the last epoch always; best.pt holds the best evaluation whatever the interval."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import saturate
from saturate.checkpoint import checkpointer as checkpoint
from saturate.config.schema import CheckpointConfig
from saturate.errors import ConfigError
from saturate.trainer.build import UserObjects
from tests.checkpoint.test_checkpoint import at
from tests.trainer.test_run import events


class Clock:
    """Wall time the test sets."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def saver(directory: Path, interval, clock=None, *, enabled=True, agree=None, background=True):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = CheckpointConfig(monitor="val/acc", mode="max", background=background)
    return checkpoint.Checkpointer(
        directory,
        cfg,
        interval=interval,
        model=model,
        stateful={"optimizer": optimizer},
        config={},
        fingerprint={},
        enabled=enabled,
        agree=agree,
        clock=clock or Clock(),
    )


def test_auto_saves_an_epoch_end_once_a_minute_of_wall_time_has_passed_since_the_last_save(tmp_path):
    clock = Clock()
    saves = saver(tmp_path, "auto", clock)
    clock.now += checkpoint.AUTO_INTERVAL_S - 1
    assert not saves.due(1, last=False)
    assert saves.due(1, last=True)  # the last epoch always
    clock.now += 1
    assert saves.due(2, last=False)
    saves.save(at(20), {}, background=False)
    clock.now += 30
    assert not saves.due(3, last=False)  # counted from the save
    clock.now += checkpoint.AUTO_INTERVAL_S
    assert saves.due(4, last=False)


def test_a_save_the_loop_waited_long_for_spaces_the_next_one_to_keep_saves_a_small_share(tmp_path):
    clock = Clock()
    saves = saver(tmp_path, "auto", clock)
    saves.cadence.saved(waited=10.0)  # a save the loop waited 10 s for
    clock.now += checkpoint.AUTO_INTERVAL_S * 2
    assert not saves.due(1, last=False)
    clock.now = saves.cadence.saved_at + 10.0 / checkpoint.AUTO_SAVE_SHARE
    assert saves.due(2, last=False)


def test_an_integer_interval_keeps_every_nth_epoch_whatever_the_time(tmp_path):
    clock = Clock()
    every_epoch, every_third = saver(tmp_path / "a", 1, clock), saver(tmp_path / "b", 3, clock)
    assert all(every_epoch.due(epoch, last=False) for epoch in range(1, 7))
    assert [e for e in range(1, 10) if every_third.due(e, last=False)] == [3, 6, 9]
    clock.now += 10 * checkpoint.AUTO_INTERVAL_S
    assert not every_third.due(4, last=False) and every_third.due(4, last=True)


def test_rank_zero_decides_a_timed_save_and_every_rank_follows(tmp_path):
    """Each rank's clock differs; `agree` is Dist.any, with only rank 0 giving its decision:
    rank 1, its own clock short of the interval, saves when rank 0 does, and not otherwise."""
    flags: list[bool] = []

    def any_rank(flag: bool) -> bool:  # the collective, as both ranks see it once each has called it
        flags.append(flag)
        return any(flags[-2:])

    early, late = Clock(), Clock()
    rank0 = saver(tmp_path / "0", "auto", late, agree=any_rank)
    rank1 = saver(tmp_path / "1", "auto", early, enabled=False, agree=any_rank)
    assert not rank0.due(1, last=False) and not rank1.due(1, last=False)
    late.now += checkpoint.AUTO_INTERVAL_S
    assert rank0.due(2, last=False) and rank1.due(2, last=False)
    assert flags[-2:] == [True, False]  # rank 1 gives no decision of its own
    early.now += 10 * checkpoint.AUTO_INTERVAL_S  # rank 1's clock alone past the interval: nobody saves
    flags.clear()
    rank0.cadence.saved(0.0)
    assert not rank0.due(3, last=False) and not rank1.due(3, last=False)


@pytest.mark.parametrize("background", [True, False])
def test_best_pt_holds_the_best_evaluation_made_between_saves(tmp_path, background):
    saves = saver(tmp_path, "auto", background=background)
    weights = saves.model.weight.detach().clone()
    saves.hold(at(10), {"val/acc": 0.9})  # an epoch's end that saves nothing
    with torch.no_grad():
        saves.model.weight.add_(1.0)  # training goes on
    saves.hold(at(15), {"val/acc": 0.7})  # worse: the held one stays
    assert not (tmp_path / "best.pt").exists()  # nothing written before the next save
    saves.save(at(20), {"val/acc": 0.5}, background=True)
    saves.flush()
    best, last = checkpoint.load(tmp_path / "best.pt"), checkpoint.load(tmp_path / "last.pt")
    assert (best["step"], best["best"], best["best_at"]) == (10, 0.9, [1, 10])
    assert torch.equal(best["model"]["weight"], weights)
    assert last["step"] == 20 and last["best"] == 0.9 and saves.held is None
    saves.hold(at(25), {"val/acc": 0.95})
    saves.save(at(30), {"val/acc": 0.99}, background=True)  # better than the held one: best.pt is this save
    saves.flush()
    assert checkpoint.load(tmp_path / "best.pt")["step"] == 30


class Saves:
    """An on_checkpoint hook: the step of each save."""

    def __init__(self):
        self.steps: list[int] = []

    def on_checkpoint(self, run, path) -> None:
        self.steps.append(run.step)


@pytest.mark.parametrize(("interval", "saved_at"), [(None, [9]), ("1", [3, 6, 9]), ("2", [6, 9])])
def test_a_run_of_short_epochs_saves_by_the_interval_and_best_pt_is_its_best_evaluation(make_cfg, interval, saved_at):
    overrides = ["trainer.max_epochs=3", "checkpoint.monitor=val/loss"]
    cfg = make_cfg(*overrides, *([f"trainer.checkpoint_interval={interval}"] if interval else []))
    hook = Saves()
    saturate.train(cfg, objects=UserObjects(callbacks={"saves": hook}))
    assert hook.steps == saved_at  # auto: a run shorter than a minute saves at its end only
    losses = {e.step: e.value for e in events(cfg.run_dir).Scalars("val/loss")}
    best = checkpoint.load(Path(cfg.run_dir) / "checkpoints" / "best.pt")
    assert best["step"] == min(losses, key=losses.__getitem__)
    assert best["best"] == pytest.approx(min(losses.values()))
    report = (Path(cfg.run_dir) / "report.md").read_text()
    assert re.search(r"training loop [\d.]+ s: .*, checkpoint \d+%", report)  # its share, whatever the interval


@pytest.mark.parametrize("value", ["0", "soon", "1.5"])
def test_a_checkpoint_interval_that_is_neither_a_count_nor_auto_is_refused(make_cfg, value):
    with pytest.raises(
        ConfigError,
        match=rf"trainer.checkpoint_interval='?{value}'?: expected an integer >= 1 \(every N-th epoch\) or 'auto'",
    ):
        saturate.train(make_cfg(f"trainer.checkpoint_interval={value}"))
