"""SLURM through hydra/launcher=slurm, without a cluster: the job's side (its threads, its
resume command) and the launcher's checks."""

from __future__ import annotations

import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from saturate.config.invocation import SCRIPT, from_hydra
from saturate.config.schema import DeviceConfig
from saturate.parts.device import setup_device
from saturate.scale.launch import resume_hint
from tests.conftest import CONF, run_cli


@pytest.fixture
def threads():
    """torch's intra-op thread count, put back after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_slurm_task_trains_with_the_cpus_slurm_gave_it(monkeypatch, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    torch.set_num_threads(2)
    setup_device(DeviceConfig(type="cpu"))
    assert torch.get_num_threads() == 1


def test_omp_num_threads_wins_over_slurms_cpus(monkeypatch, threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    torch.set_num_threads(2)
    setup_device(DeviceConfig(type="cpu"))
    assert torch.get_num_threads() == 2


@pytest.fixture
def in_a_slurm_job(monkeypatch, tmp_path):
    """Hydra's runtime config and the environment as a job of `python train.py -m
    hydra/launcher=slurm ...` has them (submitit's entry point as the script run)."""
    before = HydraConfig.instance().cfg

    def job(hydra_overrides: list[str], overrides: list[str]):
        with initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[*hydra_overrides, *overrides], return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.mode = "MULTIRUN"
            cfg.hydra.overrides.hydra = [*hydra_overrides, "hydra.mode=MULTIRUN"]
            cfg.hydra.overrides.task = overrides
        HydraConfig.instance().set_config(cfg)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["/venv/lib/python3.11/site-packages/submitit/core/_submit.py", "/x/.submitit"])
    monkeypatch.setenv(SCRIPT, str(tmp_path / "train.py"))  # what train.py's command exported for its jobs
    yield job
    HydraConfig.instance().cfg = before


def test_a_slurm_jobs_resume_command_submits_it_again_into_its_own_run_dir(in_a_slurm_job, tmp_path):
    launcher = ["hydra/launcher=slurm", "hydra.launcher.partition=debug", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    in_a_slurm_job(launcher, ["loader.batch_size=64", "trainer.resume=auto"])
    invocation = from_hydra()
    assert invocation.launcher == "slurm" and invocation.app == str(tmp_path / "train.py")
    hint = resume_hint(str(tmp_path / "sweep" / "1_bs64"), world_size=2, invocation=invocation)
    assert hint == (
        "python train.py -m hydra/launcher=slurm hydra.launcher.partition=debug loader.batch_size=64 "
        f"hydra.sweep.dir={tmp_path / 'sweep'} hydra.sweep.subdir=1_bs64 trainer.resume=auto"
    )


def test_a_launcher_without_multirun_is_one_line_naming_the_fix(tmp_path):
    result = run_cli("hydra/launcher=slurm", "trainer.max_epochs=1", cwd=tmp_path, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: hydra/launcher=slurm: Hydra starts a launcher's jobs in a multirun only; add -m (python train.py -m "
        "hydra/launcher=slurm ...: one job, or one per swept value)"
    )
    assert not list(tmp_path.glob("outputs/runs/*/*/checkpoints"))  # nothing trained here


def test_a_signal_delay_that_leaves_no_time_to_train_is_refused_before_anything_is_submitted(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    args = ["hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=60", "trainer.resume=auto"]
    result = run_cli("-m", "hydra/launcher=slurm", *args, cwd=tmp_path, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: hydra.launcher.signal_delay_s=60: expected less than timeout_min x 60 - 60 = 60 s (SLURM may send the "
        "signal up to 60 s early: every attempt would be signalled before it trains); lower it, or raise "
        "hydra.launcher.timeout_min"
    )
