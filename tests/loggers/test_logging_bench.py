"""scripts/bench_logging.py runs both ways and prints its table (a short run: that it works and
that TensorBoard reads the same points from both ways, not its figures)."""

from __future__ import annotations

import re

from tests.conftest import ROOT, python


def test_the_logging_bench_times_both_ways_and_reads_the_same_points_back():
    result = python(ROOT / "scripts" / "bench_logging.py", "--scalars", "6", "--steps", "50", "--rounds", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"^\| one event \| \d+ \|$", result.stdout, re.M)
    assert re.search(r"^\| an event per scalar \| \d+ \|$", result.stdout, re.M)
    assert re.search(r"paired by round: [\d.]+$", result.stdout, re.M)
    assert "TensorBoard reads the same points from both: True" in result.stdout
