"""The style CI enforces, run here too so that a change that breaks it fails the suite a
developer runs: ruff's rules and format over the repository, mypy over src/ (pyproject.toml
configures all three)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_ruff_finds_nothing_and_the_code_is_formatted():
    lint = _run("ruff", "check", "--no-cache", ".")
    assert lint.returncode == 0, lint.stdout[-3000:]
    style = _run("ruff", "format", "--check", "--no-cache", ".")
    assert style.returncode == 0, style.stdout[-3000:]


def test_mypy_finds_no_type_error_in_src():
    done = _run("mypy", "--no-incremental")
    assert done.returncode == 0, done.stdout[-3000:]
    assert "Success: no issues found" in done.stdout


def test_a_type_error_fails_the_check(tmp_path):
    """The check can fail: the same configuration on a file with a type error."""
    broken = tmp_path / "broken.py"
    broken.write_text("def f(x: int) -> str:\n    return x\n")
    done = _run("mypy", "--no-incremental", "--check-untyped-defs", str(broken))
    assert done.returncode == 1 and "Incompatible return value type" in done.stdout
