"""Fixtures compose the real conf/ (as train.py does), shrink it to tiny sizes and point
the outputs at tmp_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import saturate

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
saturate.register()  # the schema and resolvers, before anything composes conf/


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    """Each test's image-folder index cache (XDG_CACHE_HOME) is its own, never the user's;
    CLI subprocesses inherit it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))


# A run of a few steps: seconds on a 2-core CPU.
TINY = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=2",
    "trainer.log_interval=1",
    "trainer.progress=false",
    "loader.batch_size=32",
    "loader.num_workers=0",
]


def compose_config(overrides: list[str]):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.fixture
def make_cfg(tmp_path):
    """make_cfg(*overrides, tiny=True) -> composed config whose run_dir is a new folder."""
    count = iter(range(1000))

    def make(*overrides: str, tiny: bool = True):
        run_dir = tmp_path / f"run{next(count)}"
        return compose_config([*(TINY if tiny else []), f"run_dir={run_dir}", *overrides])

    return make


def read_metrics(run_dir) -> dict:
    return json.loads((Path(run_dir) / "metrics.json").read_text())


def run_cli(*args: str, cwd: Path, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in `cwd` (its outputs/ lands there), as a user runs it."""
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


# two workers on two cores: one thread each, for runs and the CLI processes they start
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
