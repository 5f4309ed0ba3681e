"""logger=mlflow, read back through MLflow's own client: a run's params, metrics at their steps,
tags and artifacts; a tracker that is down or refuses a value only warns; a resumed run
continues its MLflow run (slow); a real 3-job multirun is one parent with three children (slow)."""

from __future__ import annotations

import importlib.util
import json
import logging
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

import saturate
from tests.conftest import TINY, compose_config, run_cli
from tests.diagnostics.test_sweep import QUICK, sweep_dir

# find_spec, not importorskip: collecting (every xdist worker does) should not pay for importing mlflow
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="the mlflow extra is not installed (pip install -e '.[mlflow]')"
)


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


@pytest.mark.slow
def test_a_run_leaves_its_params_metrics_tags_and_artifacts(tracked_run):
    cfg, metrics, uri = tracked_run
    run_dir = Path(cfg.run_dir)
    run_id = json.loads((run_dir / "mlflow.json").read_text())["run_id"]
    run = client(uri).get_run(run_id)
    experiment = client(uri).get_experiment_by_name("train")  # the Hydra job's name (train.py's)
    assert run.info.status == "FINISHED" and run.info.experiment_id == experiment.experiment_id
    # every setting, as the HParams session has them
    params = run.data.params
    assert params["loader.batch_size"] == "32" and params["model"] == "SmallCNN" and params["trainer.max_epochs"] == "2"
    assert params["optim.lr"] == str(cfg.optim.optimizer.lr) and "overrides" in params
    # metrics at their steps: every training step (log_interval=1), the evaluations, the final values
    history = client(uri).get_metric_history(run_id, "train/loss")
    assert sorted({m.step for m in history}) == [1, 2, 3, 4, 5, 6]
    assert run.data.metrics["val/acc"] == pytest.approx(metrics["val/acc"])
    assert sorted({m.step for m in client(uri).get_metric_history(run_id, "val/acc")}) == [3, 6]  # each evaluation
    # tags: fingerprint, status, verdict; what ran
    record = json.loads((run_dir / "metrics.json").read_text())
    tags = run.data.tags
    assert tags["saturate.status"] == "completed" and tags["saturate.verdict"] == record["verdict"]
    assert "torch" in tags["saturate.fingerprint"] and tags["saturate.model"] == "SmallCNN"
    assert "mlflow.parentRunId" not in tags
    artifacts = {a.path for a in client(uri).list_artifacts(run_id)}
    assert {"report.md", "config.md", "metrics.json"} <= artifacts
    local = client(uri).download_artifacts(run_id, "report.md", str(run_dir.parent))
    assert Path(local).read_text() == (run_dir / "report.md").read_text()


class Refusing:
    """A tracker client that is down (every call raises) or refuses one value."""

    def __init__(self, *, down: bool = False, refused: str = ""):
        self.down, self.refused, self.sent = down, refused, []

    def log_batch(self, run_id, metrics=(), params=()):
        if self.down:
            raise ConnectionError("Connection refused")
        if any(m.key == self.refused for m in metrics):
            raise ValueError(f"Invalid value for metric {self.refused}")
        self.sent += [(m.key, m.step) for m in metrics]

    def set_tag(self, *args):
        if self.down:
            raise ConnectionError("Connection refused")


def test_a_tracker_that_is_down_or_refuses_a_value_only_warns(caplog):
    from saturate.loggers.mlflow import Sender

    with caplog.at_level(logging.WARNING, logger="saturate.loggers.mlflow"):
        down = Sender(Refusing(down=True), "run")
        for step in range(1, 20):
            down.metrics({"train/loss": 1.0 / step}, step)
            down.call("set a tag", down.client.set_tag, "run", "k", "v")
        assert down.close(timeout_s=10)
        refusing = Sender(Refusing(refused="bad"), "run")
        refusing.metrics({"train/loss": 0.5, "bad": 1.0, "val/acc": 0.9}, 3)
        assert refusing.close(timeout_s=10)
    # the one refused value lost, the others sent
    assert sorted(refusing.client.sent) == [("train/loss", 3), ("val/acc", 3)]
    said = [r.getMessage() for r in caplog.records]
    assert any("ConnectionError" in s and "the run goes on" in s for s in said)
    assert any("sends nothing more" in s for s in said)  # a dead tracker is not called for ever
    assert any("log bad failed" in s for s in said)


def test_a_store_that_cannot_be_reached_at_the_start_only_warns(tmp_path, caplog):
    from saturate.loggers.mlflow import MLflowLogger

    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    (tmp_path / "a_file").write_text("")
    run = SimpleNamespace(run_dir=tmp_path, info={}, start_step=0, step=0, metrics={})
    for uri in (f"http://127.0.0.1:{port}", f"sqlite:///{tmp_path / 'a_file' / 'mlflow.db'}"):
        logger = MLflowLogger(tracking_uri=uri)
        with caplog.at_level(logging.WARNING, logger="saturate.loggers.mlflow"):
            logger.on_run_start(run)
            logger.on_log(run, {"train/loss": 1.0}, 1)
            logger.on_run_end(run, {"status": "completed"})
        assert f"cannot use the store {uri}" in caplog.text and "not tracked there" in caplog.text
        caplog.clear()


@pytest.mark.slow
def test_a_resumed_run_continues_its_mlflow_and_wandb_runs(mlflow_store, tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    loggers = ["logger=[mlflow,wandb]", f"logger.mlflow.tracking_uri={mlflow_store}", f"run_dir={run_dir}"]
    saturate.train(compose_config([*TINY, *loggers]))
    first = json.loads((run_dir / "mlflow.json").read_text())["run_id"]
    wandb_id = (run_dir / "wandb" / "run_id").read_text()
    saturate.train(compose_config([*TINY, *loggers, "trainer.max_epochs=2", "trainer.resume=auto"]))
    assert json.loads((run_dir / "mlflow.json").read_text())["run_id"] == first
    runs = client(mlflow_store).search_runs([client(mlflow_store).get_experiment_by_name("train").experiment_id])
    assert [r.info.run_id for r in runs] == [first]  # the same run, not a second one
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["saturate.resumed_from_step"] == "3"
    assert max(m.step for m in client(mlflow_store).get_metric_history(first, "train/loss")) == 6
    # W&B: offline, each attempt writes its own directory, both with the run's one id (wandb sync joins them)
    assert (run_dir / "wandb" / "run_id").read_text() == wandb_id
    attempts = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and all((p / f"run-{wandb_id.strip()}.wandb").is_file() for p in attempts)


@pytest.mark.slow
def test_a_three_job_sweep_is_one_parent_run_with_three_children(tmp_path):
    """A real `python train.py -m` with logger=[tensorboard,mlflow]: the default store under
    outputs/, read back through MLflow's client from this process."""
    done = run_cli("-m", "optim.optimizer.lr=0.01,0.02,0.05", "logger=[tensorboard,mlflow]", *QUICK, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert "Traceback" not in said and "[WARNING] - mlflow:" not in said
    assert said.count("mlflow ui --backend-store-uri sqlite:///") == 3  # each job says where it went
    uri = f"sqlite:///{tmp_path / 'outputs' / 'mlflow' / 'mlflow.db'}"
    experiment = client(uri).get_experiment_by_name("train")  # the Hydra job's name
    runs = client(uri).search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("saturate.role") == "sweep"]
    assert len(parents) == 1 and len(runs) == 4
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.info.run_name == "optim.optimizer.lr=0.01,0.02,0.05"
    assert parent.data.tags["saturate.sweep_dir"] == str(sweep_dir(tmp_path))
    children = client(uri).search_runs(
        [experiment.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    assert len(children) == 3
    assert sorted(c.data.params["optim.lr"] for c in children) == ["0.01", "0.02", "0.05"]  # the swept params differ
    assert sorted(c.info.run_name for c in children) == [
        "lr-0.01",
        "lr-0.02",
        "lr-0.05",
    ]
    for child in children:
        assert child.info.status == "FINISHED" and child.data.tags["saturate.status"] == "completed"
        assert {"val/acc", "val/loss", "train/loss", "perf/samples_per_s"} <= set(child.data.metrics)  # final metrics
        job = Path(child.data.tags["saturate.run_dir"])
        final = json.loads((job / "metrics.json").read_text())
        assert child.data.metrics["val/acc"] == pytest.approx(final["val/acc"])
        assert {"report.md", "config.yaml"} <= {a.path for a in client(uri).list_artifacts(child.info.run_id)}
