"""A trial times what it claims: no compilation inside its timed window (the first step's, a
short last batch's, a new shape's), so that a compile trial is not judged by its recompiles."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from saturate import names
from saturate.diagnostics.timing import StepTimer, Window
from saturate.tune import Measured
from tests.conftest import run_cli


def test_a_window_that_compiled_restarts_the_timed_window():
    """Dynamo's graph count moves between two log steps (a shape compiled for the first time):
    that window and those before it leave the steady state, which starts again after it."""
    from saturate.tune.trials import compiled_graphs

    compiled = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
    compiled(torch.ones(3))
    stops: list[str] = []
    run = SimpleNamespace(timer=StepTimer(torch.device("cpu")), request_stop=stops.append)
    measured = Measured(seconds=1.0, steps=10)
    log = lambda rate: measured.on_log(run, {names.SAMPLES_PER_S: rate}, 0)
    log(50.0)  # the first window: the warm-up
    before = compiled_graphs()
    run.timer.rest.add(Window(steps=5, samples=500, wall_s=0.5))
    log(1000.0)
    run.timer.rest.add(Window(steps=5, samples=50, wall_s=0.5))
    compiled(torch.ones(4))  # a new shape, as an epoch's short last batch
    log(100.0)
    assert run.timer.rest.steps == 0 and measured.rates == []  # the windows before it no longer count
    assert measured.compiles == {"first_window": before, "window_start": before + 1, "window_end": before + 1}
    for _ in range(2):
        run.timer.rest.add(Window(steps=5, samples=500, wall_s=0.5))
        compiled(torch.ones(3))  # shapes compiled already: nothing moves
        log(1000.0)
    assert measured.rates == [1000.0, 1000.0] and measured.compiles["window_end"] == before + 1
    assert stops == ["tune: the trial's steady state is measured"]  # 1 s over 10 steps since the recompile


@pytest.mark.slow
def test_a_compile_trials_timed_window_holds_no_compilation(tmp_path):
    """A compiled model on digits, its short last batch kept (a shape compiled when the first
    epoch ends, in the middle of a trial): the trial's
    timed window starts after the last compilation, by Dynamo's own count."""
    done = run_cli(
        "data=digits",
        "trainer.compile=true",
        "loader.batch_size=100",
        "loader.drop_last=false",  # a short last batch every epoch: a shape of its own
        "tune=true",
        "tune.budget_s=150",  # compilation takes tens of seconds on a CPU
        "tune.trial_s=1",
        f"tune.preset={tmp_path / 't.yaml'}",
        "tune.cache=",
        "hydra.run.dir=t",
        cwd=tmp_path,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    start = json.loads((tmp_path / "t" / "tune.json").read_text())["results"][0]
    assert start["status"] == "ok" and start["rates"], start
    compiles = start["compiles"]
    assert compiles["first_window"] < compiles["window_start"]  # it did recompile after its first window
    assert compiles["window_start"] == compiles["window_end"]  # and none of it was timed
