"""SLURM through hydra/launcher=slurm. Without a cluster: the job's side (its threads, its
resume command, submitit's signal) and the launcher's checks. With one (slow): a real
one-node cluster on localhost (tests/scale/slurm_cluster.py) runs sweeps of 2-task jobs that
are requeued, time out and are cancelled."""

from __future__ import annotations

import pytest
import torch

from saturate.config.schema import DeviceConfig
from saturate.parts.device import setup_device


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
