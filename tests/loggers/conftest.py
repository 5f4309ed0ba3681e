"""One tiny run with every logger (TensorBoard, CSV, MLflow into a store of its own, W&B
offline), shared by the loggers' tests: they read back what it left."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import saturate
from tests.conftest import TINY, compose_config

EVERY_LOGGER = "logger=[tensorboard,csv,mlflow,wandb]"


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """An empty MLflow sqlite store, made once: a new database runs some forty migrations (5-10 s here),
    a copy of this one costs nothing."""
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install -e '.[mlflow]')")
    from saturate.loggers.mlflow import open_store

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    open_store(f"sqlite:///{db}", "template")
    return db


@pytest.fixture
def mlflow_store(mlflow_template, tmp_path) -> str:
    """A store of this test's own (a copy of the template): its tracking URI."""
    folder = tmp_path / "mlflow"
    folder.mkdir()
    shutil.copy(mlflow_template, folder / "mlflow.db")
    return f"sqlite:///{folder / 'mlflow.db'}"


@pytest.fixture(scope="session")
def tracked_run(mlflow_template, tmp_path_factory):
    """(config, final metrics, tracking URI) of one tiny run with every logger."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[wandb]')")
    root = tmp_path_factory.mktemp("tracked")
    (root / "mlflow").mkdir()
    shutil.copy(mlflow_template, root / "mlflow" / "mlflow.db")
    uri = f"sqlite:///{root / 'mlflow' / 'mlflow.db'}"
    cfg = compose_config(
        [
            *(o for o in TINY if not o.startswith("trainer.max_epochs=")),
            "trainer.max_epochs=2",
            EVERY_LOGGER,
            f"logger.mlflow.tracking_uri={uri}",
            f"run_dir={root / 'run'}",
        ]
    )
    return cfg, saturate.train(cfg), uri
