"""TensorBoard shows each run once: its scalars and its HParams session in the same event
files (no `tb/hparams` sub-run), read back as `tensorboard --logdir` reads a folder of runs.
(A real run's: tests/trainer/test_run.py, test_hparams_hold_the_values_used_and_the_compared_metrics.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
from tensorboard.util import tensor_util

from saturate.loggers import TensorBoardLogger


def read_back(logdir) -> EventMultiplexer:
    """The runs under `logdir`, as `tensorboard --logdir` reads them."""
    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    return multiplexer.Reload()


def curve(multiplexer: EventMultiplexer, run: str, tag: str) -> list[tuple[int, float]]:
    return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in multiplexer.Tensors(run, tag)]


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
    multiplexer = read_back(tmp_path)
    assert sorted(multiplexer.Runs()) == ["a", "b"]  # each run once, named by its dir
    sessions = multiplexer.PluginRunToTagToContent("hparams")
    assert sorted(sessions) == ["a", "b"] and all("_hparams_/session_start_info" in s for s in sessions.values())
    for name, lr in runs.items():

        def values(tag: str, name: str = name) -> list[tuple[int, float]]:
            return curve(multiplexer, name, tag)

        assert values("val/acc")[-1] == (3, pytest.approx(3 * lr))
        # the HParams table's metric columns: compare/*, sorted before cpu/ and memory/ (it shows the first five)
        assert values("compare/gpu/mean") == [(3, 50.0)] and values("compare/val/acc") == [(3, pytest.approx(3 * lr))]
        assert [s for s, _ in values("train/loss")] == [1, 2, 3]  # no extra point from the session
        scalars = sorted(multiplexer.PluginRunToTagToContent("scalars")[name])
        assert scalars == ["compare/gpu/mean", "compare/val/acc", "train/loss", "val/acc"]


def test_a_log_steps_scalars_are_one_event_read_back_as_one_point_each(tmp_path):
    """One record per log step, holding each of its scalars (as tf.summary's merged summaries
    are written): one to serialise and queue instead of one per metric. TensorBoard reads each
    scalar as its own curve; the step and wall time, every chart's axes, are not plotted."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from saturate import names

    run = SimpleNamespace(run_dir=tmp_path / "run", start_step=0, step=0, metrics={})
    run.run_dir.mkdir()
    logger = TensorBoardLogger()
    logger.on_run_start(run)
    for step in (1, 2):
        logger.on_log(run, {"train/loss": 1.0 / step, "train/lr": 0.1, names.STEP: step, "epoch": step // 2}, step)
    logger.on_run_end(run, {})
    (path,) = run.run_dir.glob("events.out.tfevents.*")
    logged = [e for e in EventFileLoader(str(path)).Load() if e.HasField("summary") and e.step in (1, 2)]
    tags = [sorted(v.tag for v in e.summary.value) for e in logged]
    assert tags == [["epoch", "train/loss", "train/lr"]] * 2
    multiplexer = read_back(tmp_path)
    assert curve(multiplexer, "run", "train/loss") == [(1, 1.0), (2, 0.5)]
    assert curve(multiplexer, "run", "epoch") == [(1, 0.0), (2, 1.0)]
    assert names.STEP not in multiplexer.PluginRunToTagToContent("scalars")["run"]


def test_a_resumed_run_drops_what_the_earlier_attempt_wrote_after_its_checkpoint(tmp_path):
    run = SimpleNamespace(run_dir=tmp_path / "run", start_step=0, step=0, metrics={})
    run.run_dir.mkdir()
    for start, steps, value in ((0, (1, 2, 3), 1.0), (2, (3, 4), 2.0)):  # interrupted after step 3, saved at 2
        run.start_step = start
        logger = TensorBoardLogger()
        logger.on_run_start(run)
        for step in steps:
            logger.on_log(run, {"train/loss": value * step}, step)
        logger.on_run_end(run, {})
    drawn = curve(read_back(tmp_path), "run", "train/loss")
    assert drawn == [(1, 1.0), (2, 2.0), (3, 6.0), (4, 8.0)]  # step 3 once: the resumed attempt's


def test_a_run_resumed_within_the_second_its_earlier_file_was_made_is_read_after_it(tmp_path):
    """TensorBoard reads event files in name order: second, host, process, a per-process counter
    (not zero-padded: writer 10 sorts before writer 9). An earlier attempt's file named to sort
    after any made in the same second: the resumed attempt's file still comes after it."""
    import time

    run = SimpleNamespace(run_dir=tmp_path / "run", start_step=0, step=0, metrics={})
    run.run_dir.mkdir()
    logger = TensorBoardLogger()
    logger.on_run_start(run)
    for step in (1, 2, 3):
        logger.on_log(run, {"train/loss": float(step)}, step)
    logger.on_run_end(run, {})
    (earlier,) = run.run_dir.glob("events.out.tfevents.*")
    earlier.rename(run.run_dir / f"events.out.tfevents.{int(time.time()):010d}.zzzz.99999.9")
    run.start_step = 2
    logger = TensorBoardLogger()
    logger.on_run_start(run)
    logger.on_log(run, {"train/loss": 30.0}, 3)
    logger.on_run_end(run, {})
    assert curve(read_back(tmp_path), "run", "train/loss") == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_a_run_written_before_events_moved_into_the_run_dir_goes_on_in_its_tb_folder(tmp_path):
    """One run in TensorBoard's list whichever layout wrote it first: a resumed run of the old
    layout (`<run dir>/tb`) adds its events there, read after the earlier attempt's even when
    that one's file is named for a later second (made on a host whose clock ran ahead)."""
    import time

    from torch.utils.tensorboard import SummaryWriter

    run = SimpleNamespace(run_dir=tmp_path / "old", start_step=2, step=2, metrics={})
    with SummaryWriter(str(run.run_dir / "tb")) as earlier:  # the earlier attempt, as the old layout wrote it
        for step in (1, 2, 3):
            earlier.add_scalar("train/loss", float(step), step)
    (written,) = (run.run_dir / "tb").glob("events.out.tfevents.*")
    written.rename(written.with_name(f"events.out.tfevents.{int(time.time()) + 100:010d}.ahead.1.0"))
    logger = TensorBoardLogger()  # resumed from step 2
    logger.on_run_start(run)
    logger.on_log(run, {"train/loss": 4.0}, 4)
    logger.on_run_end(run, {})
    multiplexer = read_back(tmp_path)
    assert multiplexer.Runs().keys() == {"old/tb"}
    # in the order written (that layout started no session: nothing is dropped)
    assert curve(multiplexer, "old/tb", "train/loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
