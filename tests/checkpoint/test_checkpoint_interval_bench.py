"""scripts/bench_checkpoint.py runs and prints its table (its quick mode: that it works, not
its figures)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT, python


@pytest.mark.slow
def test_the_checkpoint_bench_runs_both_ways_and_prints_each_round_and_the_median_ratio():
    result = python(ROOT / "scripts" / "bench_checkpoint.py", "--quick", timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| round | default s | off s | ratio | epoch s |" in result.stdout
    assert len(re.findall(r"^\| \d \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", result.stdout, re.M)) == 2
    assert re.search(r"median ratio [\d.]+ \((within|over) the target 1.05\)", result.stdout)
