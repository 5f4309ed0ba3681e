"""TensorBoard shows each run once: its scalars and its HParams session in the same event
files (no `tb/hparams` sub-run), read back as `tensorboard --logdir` reads a folder of runs.
(A real run's: tests/compose/test_run.py, test_hparams_hold_the_values_used_and_the_compared_metrics.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
from tensorboard.util import tensor_util

from saturate.loggers import TensorBoardLogger


def test_a_run_is_one_run_in_tensorboard_holding_its_hparams_session(tmp_path):
    runs = {}
    for name, lr in (("a", 0.1), ("b", 0.2)):  # two runs under one logdir, as a sweep's jobs
        run = SimpleNamespace(run_dir=tmp_path / name, start_step=0, step=0, metrics={})
        run.run_dir.mkdir()
        logger = TensorBoardLogger()
        logger.on_run_start(run)
        for step in (1, 2, 3):
            run.step, run.metrics = step, {"train/loss": 1.0 / step, "val/acc": lr * step}
            logger.on_log(run, run.metrics, step)
        # the final values: those plotted already, and one the run never plotted (a GPU's mean utilisation)
        logger.on_hparams(
            run, {"optim.lr": lr, "overrides": f"optim.lr={lr}"}, {"val/acc": 3 * lr, "gpu/mean": 50.0}, []
        )
        logger.on_log(run, {"val/acc": 3 * lr}, 3)  # the tracker logs the plotted ones' final values after
        logger.on_run_end(run, {"status": "completed"})
        runs[name] = lr
    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    assert sorted(multiplexer.Runs()) == ["a/tb", "b/tb"]  # each run once
    sessions = multiplexer.PluginRunToTagToContent("hparams")
    assert sorted(sessions) == ["a/tb", "b/tb"] and all("_hparams_/session_start_info" in s for s in sessions.values())
    for name, lr in runs.items():

        def values(tag: str, name: str = name) -> list[tuple[int, float]]:
            return [
                (e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                for e in multiplexer.Tensors(f"{name}/tb", tag)
            ]

        assert values("val/acc")[-1] == (3, pytest.approx(3 * lr))
        # the HParams table's metric columns: compare/*, sorted before cpu/ and memory/ (it shows the first five)
        assert values("compare/gpu/mean") == [(3, 50.0)] and values("compare/val/acc") == [(3, pytest.approx(3 * lr))]
        assert [s for s, _ in values("train/loss")] == [1, 2, 3]  # no extra point from the session
        scalars = sorted(multiplexer.PluginRunToTagToContent("scalars")[f"{name}/tb"])
        assert scalars == ["compare/gpu/mean", "compare/val/acc", "train/loss", "val/acc"]
