"""`python train.py` as a user runs it: the run directory it leaves, and how it answers
bad input (exit status, one short message, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, TINY, read_metrics, run_cli


def run_dirs(cwd):
    return sorted(p.parent for p in (cwd / "outputs" / "runs").glob("*/*/metrics.json"))


def test_cli_run_leaves_the_contract_run_dir(tmp_path):
    result = run_cli(*TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (run_dir,) = run_dirs(tmp_path)
    for path in (".hydra/config.yaml", ".hydra/overrides.yaml", "metrics.json", "checkpoints/last.pt", "checkpoints/best.pt"):
        assert (run_dir / path).is_file(), path
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert read_metrics(run_dir)["progress/step"] == 3


def test_two_runs_started_together_get_their_own_dirs(tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "trainer.limit_train_batches=1"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=240) == 0, p.stderr.read()
    assert len(run_dirs(tmp_path)) == 2


def assert_clean_failure(result, *named: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    for text in named:
        assert text in result.stderr, result.stderr


def test_bad_values_exit_with_every_problem_and_no_traceback(tmp_path):
    result = run_cli("loader.num_workers=-1", "trainer.eval_interval=0", "device.memory_fraction=2", cwd=tmp_path)
    assert_clean_failure(
        result,
        "invalid config (3 problems)",
        "loader.num_workers=-1: expected an integer >= 0 or 'auto'",
        "trainer.eval_interval=0: expected an integer >= 1",
        "device.memory_fraction=2.0: expected a number in (0, 1]",
    )
    (run_dir,) = run_dirs(tmp_path)  # a failed run still says so, for sweep reports
    assert read_metrics(run_dir)["status"] == "failed" and read_metrics(run_dir)["error"].startswith("ConfigError: invalid config")


def test_unknown_option_lists_the_available_ones(tmp_path):
    assert_clean_failure(run_cli("model=vgg", cwd=tmp_path), "model/vgg", "small_cnn", "resnet18")


def test_wrong_type_names_the_key(tmp_path):
    assert_clean_failure(run_cli("trainer.max_epochs=lots", cwd=tmp_path), "trainer.max_epochs", "lots")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_an_error_not_a_fallback(tmp_path):
    assert_clean_failure(run_cli("device=cuda", *TINY, cwd=tmp_path), "device.type='cuda'", "no CUDA device")
