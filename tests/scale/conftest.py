"""The local SLURM cluster of the slow SLURM tests (scripts/local_slurm.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from scripts.local_slurm import start_cluster, unavailable

REQUIRE = "SATURATE_REQUIRE_SLURM"  # "1" (CI): a missing or broken SLURM fails the tests instead of skipping them


def _unusable(reason: str):
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{REQUIRE}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running one-node cluster (partition `debug`) for the session; see SlurmCluster."""
    reason = unavailable()
    if reason:
        _unusable(reason)
    try:
        cluster = start_cluster()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        _unusable(f"the local SLURM cluster did not start: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
