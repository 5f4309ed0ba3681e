"""The loggers against a hostile run dir and a broken tracker: no file of theirs is written
through a planted link, a store that cannot work is one warning before any of MLflow's work,
MLflow's own error records never reach the console, a bad logger value stops the run before it
starts, a sweep's parent MLflow run ends with the sweep's status however the sweep ends, and a
run dir deleted under TensorBoard's writer is one line, not a thread's traceback."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import signal
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest

import saturate
from saturate.errors import ConfigError, UserError
from tests.conftest import TINY, compose_config, run_cli
from tests.diagnostics.test_sweep import QUICK
from tests.loggers.conftest import mlflow_store, mlflow_template  # noqa: F401 (fixtures)

needs_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="the mlflow extra is not installed (pip install -e '.[mlflow]')"
)


def plant_link(at: Path, tmp_path: Path) -> Path:
    """A link at `at` to a user's file outside the run dir; the file."""
    victim = tmp_path / f"victim-{at.name}"
    victim.write_text("precious user file\n")
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(victim)
    return victim


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


@pytest.mark.parametrize("start_step", [0, 2], ids=["fresh", "resumed"])
def test_the_csv_logger_never_writes_through_a_link_planted_in_the_run_dir(start_step, tmp_path):
    from saturate.loggers import CSVLogger

    run = SimpleNamespace(run_dir=tmp_path / "run", info={}, start_step=start_step, step=0, metrics={})
    victim = plant_link(run.run_dir / "metrics.csv", tmp_path)
    logger = CSVLogger()
    logger.on_run_start(run)
    logger.on_log(run, {"train/loss": 0.5}, 3)
    logger.on_run_end(run, {})
    rows = run.run_dir / "metrics.csv"
    assert victim.read_text() == "precious user file\n" and not rows.is_symlink()
    assert rows.read_text().splitlines() == ["step,name,value", "3,train/loss,0.5"]


@needs_mlflow
@pytest.mark.slow  # a new MLflow store: some forty migrations
def test_mlflow_never_writes_its_run_record_through_a_link(mlflow_store, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    victim = plant_link(run_dir / "mlflow.json", tmp_path)
    loggers = ["logger=[mlflow]", f"logger.mlflow.tracking_uri={mlflow_store}", f"run_dir={run_dir}"]
    saturate.train(compose_config([*TINY, *loggers]))
    saved = run_dir / "mlflow.json"
    assert victim.read_text() == "precious user file\n" and not saved.is_symlink()
    assert client(mlflow_store).get_run(json.loads(saved.read_text())["run_id"]).info.status == "FINISHED"


def test_wandb_never_writes_its_run_id_through_a_link(tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[wandb]')")
    from saturate.loggers import WandbLogger

    run = SimpleNamespace(run_dir=tmp_path / "run", info={}, start_step=0, step=0, metrics={})
    victim = plant_link(run.run_dir / "wandb" / "run_id", tmp_path)
    logger = WandbLogger(mode="disabled")
    logger.on_run_start(run)
    logger.on_run_end(run, {"status": "completed"})
    assert victim.read_text() == "precious user file\n"
    assert not (run.run_dir / "wandb" / "run_id").is_symlink()


@needs_mlflow
@pytest.mark.parametrize("store", ["a folder", "not a database"])
def test_an_mlflow_store_that_cannot_be_a_database_is_one_warning_before_mlflow_is_asked(
    store, tmp_path, caplog, capfd
):
    """A folder where the database goes has MLflow retry its engine for over a minute; a file of
    other bytes costs seconds of MLflow's work: both are seen before MLflow is handed the path."""
    from saturate.loggers.mlflow import MLflowLogger

    db = tmp_path / "mlflow" / "mlflow.db"
    if store == "a folder":
        db.mkdir(parents=True)
    else:
        db.parent.mkdir()
        db.write_bytes(b"\x00not sqlite\xff" * 100)
    run = SimpleNamespace(run_dir=tmp_path, info={}, start_step=0, step=0, metrics={})
    logger = MLflowLogger(tracking_uri=f"sqlite:///{db}")
    with caplog.at_level(logging.DEBUG):
        logger.on_run_start(run)
        logger.on_run_end(run, {"status": "completed"})
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and said[0].name == "saturate.loggers.mlflow", [r.getMessage() for r in said]
    assert f"cannot use the store sqlite:///{db}" in said[0].getMessage() and store in said[0].getMessage()
    assert not any(r.name.startswith(("mlflow", "alembic", "sqlalchemy")) for r in caplog.records)
    assert "SQLAlchemy" not in capfd.readouterr().err  # MLflow's own records (they do not propagate)


@needs_mlflow
@pytest.mark.slow  # a new MLflow store
def test_mlflow_own_error_records_never_reach_the_console(mlflow_store, tmp_path, capfd, caplog):  # noqa: F811
    """A store that fails a call mid-run (here a table gone; a store locked or made read-only
    does the same): MLflow logs an ERROR with the SQL and a traceback; the user sees saturate's
    one warning line only."""
    from saturate.loggers.mlflow import MLflowLogger

    run = SimpleNamespace(run_dir=tmp_path, info={}, start_step=0, step=0, metrics={})
    logger = MLflowLogger(tracking_uri=mlflow_store)
    logger.on_run_start(run)
    with sqlite3.connect(mlflow_store.removeprefix("sqlite:///")) as db:
        db.execute("DROP TABLE metrics")
    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="saturate.loggers.mlflow"):
        logger.on_log(run, {"train/loss": 1.0}, 1)
        logger.on_run_end(run, {"status": "completed"})
    console = capfd.readouterr().err
    assert "Traceback" not in console and "SQL" not in console and "ERROR mlflow" not in console, console[-2000:]
    assert "mlflow: log metrics failed (" in caplog.text


def test_a_bad_mlflow_timeout_stops_the_run_before_it_starts(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        saturate.train(compose_config([*TINY, "logger=[mlflow]", "logger.mlflow.timeout_s=-1", f"run_dir={run_dir}"]))
    assert "logger.mlflow.timeout_s=-1: expected a number > 0 (seconds)" in str(refused.value)
    assert not (run_dir / "checkpoints").exists()  # nothing trained


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (lambda L: L.MLflowLogger(timeout_s=float("nan")), "logger.mlflow.timeout_s=nan: expected a number > 0"),
        (lambda L: L.MLflowLogger(timeout_s="30"), "logger.mlflow.timeout_s='30': expected a number > 0"),
        (lambda L: L.MLflowLogger(log_checkpoint="yes"), "logger.mlflow.log_checkpoint='yes': expected true or false"),
        (lambda L: L.MLflowLogger(experiment=""), "logger.mlflow.experiment='': expected null or a name"),
        (lambda L: L.MLflowLogger(experiment="x" * 501), "expected null or a name of at most 500 characters"),
        (lambda L: L.MLflowLogger(tracking_uri=3), "logger.mlflow.tracking_uri=3: expected null or a URI"),
        (lambda L: L.WandbLogger(mode="offlne"), "logger.wandb.mode='offlne': expected offline, online or disabled"),
        (lambda L: L.CSVLogger(filename="../m.csv"), "logger.csv.filename='../m.csv': expected a file name"),
    ],
)
def test_a_bad_logger_value_is_refused_when_the_logger_is_built(build, said):
    import saturate.loggers

    with pytest.raises(ConfigError) as refused:
        build(saturate.loggers)
    assert said in str(refused.value)


# -- a sweep's parent run ends with the sweep's status


def parent_and_children(uri: str):
    experiment = client(uri).get_experiment_by_name("train")
    runs = client(uri).search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("saturate.role") == "sweep"]
    return parent, [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]


@needs_mlflow
@pytest.mark.slow
def test_a_sweep_with_a_failed_job_ends_its_parent_run_failed(mlflow_store, tmp_path):  # noqa: F811
    """The sweep raises at its end (a job failed its config): Hydra's on_multirun_end is not
    called; the parent is ended anyway. Its record is never written through a planted link."""
    sweep = tmp_path / "sweep"
    victim = plant_link(sweep / "mlflow_parent.json", tmp_path)
    done = run_cli(
        "-m", "optim.optimizer.lr=0.05,-1", "logger=[mlflow]", f"logger.mlflow.tracking_uri={mlflow_store}",
        f"hydra.sweep.dir={sweep}", *QUICK, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0
    parent, children = parent_and_children(mlflow_store)
    assert parent.info.status == "FAILED"
    assert [c.info.status for c in children] == ["FINISHED"]  # the job that failed its config made no run
    assert victim.read_text() == "precious user file\n" and not (sweep / "mlflow_parent.json").is_symlink()


@needs_mlflow
@pytest.mark.slow
def test_a_sweep_interrupted_ends_its_parent_run_killed(mlflow_store, tmp_path):  # noqa: F811
    done = run_cli(
        "-m", "trainer.seed=1,2", "logger=[mlflow]", f"logger.mlflow.tracking_uri={mlflow_store}",
        "+callbacks.signal._target_=tests.checkpoint.test_resume.SignalAt", "+callbacks.signal.step=2",
        f"+callbacks.signal.signum={int(signal.SIGINT)}", f"hydra.sweep.dir={tmp_path / 'sweep'}", *QUICK,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0
    parent, children = parent_and_children(mlflow_store)
    assert parent.info.status == "KILLED" and "KILLED" in {c.info.status for c in children}


# -- TensorBoard's writer thread


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's report, caught
def test_a_run_dir_deleted_under_tensorboard_is_one_line_without_a_thread_traceback(tmp_path, capfd):
    from saturate.loggers import TensorBoardLogger

    run = SimpleNamespace(run_dir=tmp_path / "run", start_step=0, step=0, metrics={})
    run.run_dir.mkdir()
    logger = TensorBoardLogger()
    logger.on_run_start(run)
    logger.on_log(run, {"train/loss": 1.0}, 1)
    shutil.rmtree(run.run_dir)
    with pytest.raises(UserError) as ended:  # the writer's thread opens the file at each write
        for step in range(2, 5):
            logger.on_log(run, {"train/loss": 1.0}, step)
        logger.on_run_end(run, {})  # waits for the thread
    assert "tensorboard: cannot write" in str(ended.value) and "the run dir is gone" in str(ended.value)
    assert "\n" not in str(ended.value)
    logger.on_run_end(run, {})  # the end after that failure says nothing more
    console = capfd.readouterr().err
    assert "Exception in thread" not in console and "Traceback" not in console, console
