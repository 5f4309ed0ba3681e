"""The README's examples, run as a user runs them: each workload from its own config dir
(hydra.searchpath) through train.py, one through saturate.fit, and one under torchrun."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY, read_metrics, run_cli
from tests.test_distributed import torchrun

EXAMPLES = [
    ("timeseries", "co2", "regression", "val/rmse"),
    ("sequences", "digit_rows", "classification", "val/acc"),
    ("my_images", "my_images", "classification", "val/acc"),
]


@pytest.mark.slow  # three end-to-end CLI runs
@pytest.mark.parametrize(("folder", "experiment", "kind", "metric"), EXAMPLES, ids=[e[1] for e in EXAMPLES])
def test_example_trains_from_its_config_dir(tmp_path, folder, experiment, kind, metric):
    result = run_cli(f"hydra.searchpath=[file://{ROOT / 'examples' / folder / 'conf'}]", f"experiment={experiment}", *TINY,
                     f"hydra.run.dir={tmp_path / 'run'}", cwd=ROOT, env={"PYTHONPATH": str(ROOT)})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert metrics["status"] == "completed" and metrics["task"] == kind and metric in metrics


def test_fit_example(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "timeseries" / "fit_co2.py"), *TINY, f"run_dir={tmp_path / 'run'}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "val/rmse" in result.stdout and read_metrics(tmp_path / "run")["data"] == "Windows"


@pytest.mark.slow
def test_a_user_dataset_under_ddp(tmp_path):
    """Two gloo processes on the sequence example: one run dir, identical parameters."""
    conf = ROOT / "examples" / "sequences" / "conf"
    result = torchrun(f"hydra.searchpath=[file://{conf}]", "experiment=digit_rows", "trainer.max_epochs=4", "trainer.progress=false",
                      f"hydra.run.dir={tmp_path / 'run'}", cwd=ROOT, env={"PYTHONPATH": str(ROOT)})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert metrics["distributed/params_identical"] == 1.0 and metrics["world_size"] == 2 and metrics["val/acc"] > 0.5
