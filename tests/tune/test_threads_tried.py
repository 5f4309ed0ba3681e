"""On a CPU, tune measures torch's intra-op thread counts whatever the verdict: beside other
processes holding cores, torch's default of one thread per core can be many times slower than
fewer threads, and a compute-bound run would otherwise never try it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from saturate.tune import candidates, side_order
from tests.conftest import run_cli
from tests.test_tune import FACTS, tried


def test_a_compute_bound_cpu_run_tries_thread_counts():
    facts = {**FACTS, "cpus": 8, "cores": 8, "threads": 8, "other_cpu": 0.0}
    options = tried("compute-bound", facts)
    assert "threads" in side_order("compute-bound")
    threads = [o for o in options if o[0].startswith("device.threads=")]
    assert threads == [["device.threads=1"], ["device.threads=4"]]  # one, half; all is what it ran with


def test_the_cores_other_processes_left_free_are_tried():
    """Facts that say other processes held 3 of 8 cores: 5 threads is a candidate beside 1, 4
    and 8 (the run used 2)."""
    facts = {**FACTS, "cpus": 8, "cores": 8, "threads": 2, "other_cpu": 37.5}
    counts = [c[0] for c in candidates("threads", facts, allow=[], cuda=False)]
    assert counts == ["device.threads=1", "device.threads=4", "device.threads=5", "device.threads=8"]
    busy_two_cores = {**FACTS, "cpus": 2, "cores": 2, "threads": 2, "other_cpu": 50.0}
    assert candidates("threads", busy_two_cores, allow=[], cuda=False) == [["device.threads=1"]]


def test_an_oversubscribed_run_tries_its_thread_counts_first():
    assert side_order("oversubscribed")[0] == "threads"
    assert sorted(side_order("oversubscribed")) == sorted(side_order("input-bound"))


def test_threads_are_not_tried_on_cuda_or_with_one_cpu():
    assert candidates("threads", {**FACTS, "cpus": 8}, allow=[], cuda=True) == []
    assert candidates("threads", {**FACTS, "cpus": 1, "cores": 1, "threads": 1}, allow=[], cuda=False) == []


SPIN = "import time\nwhile True:\n    pass\n"


@pytest.mark.slow
def test_beside_a_process_holding_a_core_tune_keeps_the_thread_count_that_measures_fastest(tmp_path):
    """A process spinning on one core beside a compute-bound run: the thread counts are trials
    of their own, each a ratio beside the default's in the table, and what tune keeps is the
    count that measured fastest (the default when none beat it)."""
    cores = len(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        done = run_cli(
            "data=digits",
            "tune=true",
            "loader.batch_size=32",  # steps of a fraction of a second even oversubscribed
            "tune.budget_s=240",
            "tune.trial_s=1",
            f"tune.preset={tmp_path / 't.yaml'}",
            "tune.cache=",
            "hydra.run.dir=t",
            cwd=tmp_path,
            timeout=400,
            env={"OMP_NUM_THREADS": str(cores)},  # torch's default, a thread per core (the test workers set one)
        )
    finally:
        spinner.kill()
        spinner.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "t" / "tune.json").read_text())
    rows = result["results"]
    start = rows[0]
    threads = [r for r in rows if r["changes"] and r["changes"][0].startswith("device.threads=")]
    assert threads, [r["changes"] for r in rows]  # tried though the run is compute-bound
    assert start["facts"]["threads"] == cores  # the default: torch's, a thread per core
    table = (tmp_path / "t" / "tune.md").read_text()
    for r in threads:  # each beside the default, as a ratio of its samples/s (or undecided)
        line = next(line for line in table.splitlines() if line.startswith(f"| {r['number']} |"))
        ratio = r["samples_per_s"] / start["samples_per_s"]
        assert f"{ratio:.2f}x" in line or "undecided" in line, line
    fastest = max([start, *threads], key=lambda r: r["samples_per_s"])
    assert fastest is not start  # a thread per core beside a spinning one: many times slower
    kept = [c for c in result["changes"] if c.startswith("device.threads=")]
    assert kept == [c for c in fastest["changes"] if c.startswith("device.threads=")]  # and kept, confirmed
    assert result["confirmed"] and result["speedup"] > 1.5
