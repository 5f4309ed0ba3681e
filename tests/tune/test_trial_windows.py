"""A trial times what it claims: no compilation inside its timed window (the first step's, a
short last batch's), so that a compile trial is not judged by its recompiles."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from saturate import fit, names
from saturate.diagnostics.timing import StepTimer, Window
from saturate.tune import Measured


def test_a_trials_rates_are_its_windows_after_the_first_and_it_stops_once_measured():
    """The first log window holds the first step (and a compiled model's first call): never
    timed. The windows after it are the trial's rates, and it stops once they hold enough."""
    stops: list[str] = []
    run = SimpleNamespace(timer=StepTimer(torch.device("cpu")), request_stop=stops.append)
    measured = Measured(seconds=1.0, steps=10)
    measured.on_log(run, {names.SAMPLES_PER_S: 50.0}, 1)  # the warm-up window
    for step in (6, 11):
        run.timer.rest.add(Window(steps=5, samples=500, wall_s=0.5))
        measured.on_log(run, {names.SAMPLES_PER_S: 1000.0}, step)
    assert measured.rates == [1000.0, 1000.0]
    assert stops == ["tune: the trial's steady state is measured"]


@pytest.mark.slow  # torch.compile writes C++ on a CPU: tens of seconds
def test_a_compiled_runs_training_windows_hold_no_compilation(tmp_path):
    """250 samples in batches of 64 with the short last batch kept (58 samples: a shape of its
    own, which would compile again at the end of the first epoch): it is compiled with the
    warm-up, before the first step, so Dynamo's own count of compiled graphs (the counter torch's
    tests read; saturate does not import it) does not move from the first log step on."""
    from torch._dynamo.utils import counters

    class Counted:
        def __init__(self):
            self.graphs: list[int] = []

        def on_log(self, run, metrics, step):
            self.graphs.append(int(counters["stats"]["unique_graphs"]))

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(250, 16, generator=g), torch.randint(0, 4, (250,), generator=g))
    counted = Counted()
    overrides = ["trainer.compile=true", "loader.batch_size=64", "loader.drop_last=false", "trainer.max_epochs=2"]
    overrides += ["trainer.log_interval=1", "trainer.progress=false", "device=cpu"]
    model = lambda in_features, num_classes: nn.Sequential(
        nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, num_classes)
    )
    metrics = fit(model, data, data, overrides=overrides, callbacks=[counted], run_dir=tmp_path)
    assert metrics["progress/step"] == 8 and len(counted.graphs) >= 8  # 4 batches an epoch, the last of 58
    assert len(set(counted.graphs)) == 1, counted.graphs
