"""saturate selftest: every check runs or is skipped with its reason on the CPU; a check that
hangs, raises or dies is one row and the others still run; the table and JSON read back.
The whole CPU self-test and the measurements' dry run are slow tests (CI runs them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from saturate.selftest import REGISTRY
from saturate.selftest.base import Context
from saturate.selftest.runner import skip_reason
from tests.conftest import ROOT, python


def selftest(*args: str, out, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m saturate.selftest --device cpu --out OUT ARGS`. Run past `timeout`, it is
    killed with every process under it (tests/zygote.py): each check runs in a child in a
    session of its own, and one left running measures into the tests after it (a timed-out dry
    run's compile-gain made a tune test choose workers on a 2-core machine)."""
    return python("-m", "saturate.selftest", "--device", "cpu", "--out", out, *args, cwd=ROOT, timeout=timeout)


def rows(out) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads((out / "selftest.json").read_text())["rows"]}


def test_on_the_cpu_every_check_runs_or_is_skipped_with_its_reason(tmp_path):
    """No check is left out silently: each has a CPU meaning or says why not; the measurements
    are the GPU's, and run at toy sizes with --dry."""
    cpu = Context("cpu", tmp_path)
    for check in REGISTRY.values():
        why = skip_reason(check, cpu, left_s=None)
        assert why is None or len(why) > 20, check.name
        if check.kind == "measure":
            assert why  # measured on a GPU only
            assert skip_reason(check, Context("cpu", tmp_path, dry=True), None) == (check.needs_cuda or None)
    assert {c.name for c in REGISTRY.values() if c.needs_cuda} == {
        "resident-host-staged",
        "out-of-memory",
        "nvml",
        "copy-bandwidth",
        "guard-launches",
        "augmentation-syncs",
        "cudnn-shapes",
        "ddp-agreement",
        "nvml-uuids",
    }


def test_a_check_that_hangs_raises_or_dies_is_one_row_and_the_rest_still_run(tmp_path):
    out = tmp_path / "st"
    done = selftest(
        "--checks",
        "tests.selftest.selftest_checks",
        "--only",
        "user-hangs,user-raises,user-dies,user-skips,precision-fp32,user-passes",
        out=out,
        timeout=240,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    found = rows(out)
    # in the order asked
    assert list(found) == [
        "user-hangs",
        "user-raises",
        "user-dies",
        "user-skips",
        "precision-fp32",
        "user-passes",
    ]
    assert found["user-hangs"]["status"] == "FAIL" and found["user-hangs"]["detail"].startswith(
        "no answer within 4 s (killed"
    )
    hung = int((out / "work" / "hung-child.pid").read_text())
    # its process group went with it
    assert not psutil.pid_exists(hung) or psutil.Process(hung).status() == psutil.STATUS_ZOMBIE
    assert found["user-raises"]["detail"] == "ValueError: the model's head has 7 outputs"
    assert (
        found["user-dies"]["status"] == "FAIL"
        and "exited 3 without an answer: about to die" in found["user-dies"]["detail"]
    )
    assert found["user-skips"] == {**found["user-skips"], "status": "SKIP", "detail": "needs a TPU"}
    assert found["precision-fp32"]["status"] == "PASS" and found["precision-fp32"]["detail"].startswith(
        "precision fp32"
    )
    # its process did not import torch: the runner passed the device and its GPU count, and most
    # checks run train.py commands, whose own processes import it
    assert found["user-passes"]["status"] == "PASS" and found["user-passes"]["detail"] == "fine (no torch)"
    table = (out / "selftest.md").read_text()
    assert (
        "**2 passed, 3 failed, 1 skipped.**" in table
        and "| user-raises | FAIL | ValueError: the model's head has 7 outputs |" in table
    )
    # the whole story is in the check's log
    assert "Traceback" in (out / "work" / "logs" / "user-raises.log").read_text()
    assert "3 failed: user-hangs, user-raises, user-dies" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cuda"], "saturate selftest: --device cuda: no CUDA device is visible"),
        (
            ["--only", "precision-fp8"],
            "saturate selftest: --only precision-fp8: no such check; the checks are device, ",
        ),
    ],
)
def test_a_mistake_on_its_command_line_is_one_line(tmp_path, args, message):
    done = selftest(*args, out=tmp_path, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith(message) and "Traceback" not in done.stderr


def test_the_saturate_command_names_its_subcommands_and_its_version():
    from saturate import __version__
    from saturate.cli import COMMANDS

    command = os.path.join(os.path.dirname(sys.executable), "saturate")
    bare = subprocess.run([command], capture_output=True, text=True)
    assert bare.returncode == 1 and "usage: saturate <command> [--help]" in bare.stderr
    helped = subprocess.run([command, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "usage: saturate <command> [--help]" in helped.stdout
    assert all(f"  saturate {name}  " in helped.stdout for name in COMMANDS)
    assert {"train", "selftest", "eval", "export", "init", "sweep-report", "check-env"} <= set(COMMANDS)
    version = subprocess.run([command, "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout == f"saturate {__version__}\n"
    unknown = subprocess.run([command, "trian"], capture_output=True, text=True)
    assert unknown.returncode == 1 and unknown.stderr.startswith("saturate: no command 'trian'")


@pytest.mark.slow
def test_the_whole_cpu_selftest_passes_and_skips_only_what_needs_a_gpu(tmp_path):
    out = tmp_path / "st"
    done = selftest(out=out)
    assert done.returncode == 0, done.stdout + done.stderr
    found = rows(out)
    assert set(found) == set(REGISTRY)
    for name, row in found.items():
        check = REGISTRY[name]
        if check.kind == "measure" or check.needs_cuda:
            assert row["status"] == "SKIP" and row["detail"] == skip_reason(check, Context("cpu", out), None), name
        else:
            assert row["status"] == "PASS", (name, row["detail"])
    assert "| sigterm-resume | PASS | stopped with 143, resumed to step 128 |" in (out / "selftest.md").read_text()


@pytest.mark.slow
def test_a_selftest_past_its_time_leaves_no_process_behind(tmp_path):
    """The helper above: the runner and the check it started are gone once it times out."""
    with pytest.raises(subprocess.TimeoutExpired):  # mid-check: the dry compile-gain took 20 s on an AVX-512 EPYC
        selftest("--dry", "--only", "compile-gain", out=tmp_path, timeout=8)
    left = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"] for p in left]


@pytest.mark.slow
def test_the_measurements_dry_run_on_the_cpu_reads_every_figure(tmp_path):
    out = tmp_path / "st"
    measures = [c.name for c in REGISTRY.values() if c.kind == "measure"]
    done = selftest("--dry", "--only", ",".join(measures), out=out, timeout=1200)  # over 600 s on a slower 2-core CPU
    assert done.returncode == 0, done.stdout + done.stderr
    found = rows(out)
    assert found["copy-bandwidth"]["status"] == "SKIP"
    for name in set(measures) - {"copy-bandwidth"}:
        assert found[name]["status"] == "PASS" and found[name]["detail"].startswith("dry (toy sizes"), (
            name,
            found[name]["detail"],
        )
    assert {"fp32", "amp", "gain"} <= set(found["amp-gain"]["figures"]) and found["amp-gain"]["figures"]["amp"][
        "samples_per_s"
    ] > 0
    assert found["compile-gain"]["figures"]["compiled"]["verdict"]
    assert found["engine-overhead"]["figures"]["default"]["saturate"]["paired"] > 0
    assert found["augmentation-224"]["figures"]["step"]["augmentation_share"] > 0
    assert found["tune-vs-hand"]["figures"]["ratio"] > 0


@pytest.mark.slow
def test_the_bundle_installs_offline_on_a_python_with_only_torch_and_runs_the_selftest(tmp_path):
    """A fresh venv with nothing but a CPU torch stands for the GPU machine; pip reads no
    config (no index, no find-links of this machine's): only the bundle's wheels."""
    import torch

    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    bundle = tmp_path / "bundle"
    made = subprocess.run(
        [sys.executable, "-m", "saturate", "selftest-bundle", str(bundle), "--python-version", version]
        + ["--checkout", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    assert "hydra-core==" in (bundle / "requirements.txt").read_text() and not list((bundle / "wheels").glob("torch-*"))
    fresh = tmp_path / "fresh"
    subprocess.run(
        [getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(fresh)], check=True, timeout=120
    )
    subprocess.run(
        [str(fresh / "bin" / "python"), "-m", "pip", "install", "--quiet", f"torch=={torch.__version__.split('+')[0]}"],
        check=True,
        timeout=900,
    )
    env = {
        **os.environ,
        "PYTHON": str(fresh / "bin" / "python"),
        "PIP_CONFIG_FILE": os.devnull,
        "OUT": str(tmp_path / "out"),
    }
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        ["bash", str(bundle / "run-selftest.sh"), "--device", "cpu", "--only", "precision-fp32,augmentation-gpu"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "run-selftest: installing hydra-core==" in done.stdout
    found = rows(tmp_path / "out")
    assert [r["status"] for r in found.values()] == ["PASS", "PASS"]


def test_checks_given_as_a_file_path_are_imported_and_a_broken_one_is_one_line(tmp_path):
    """--checks path/to/file.py imports the file (c89), here and in each check's process; a
    module that raises at import, or is not there, is one line."""
    mine = tmp_path / "my_checks.py"
    mine.write_text(
        "from saturate.selftest.base import check\n\n@check('mine-passes', 'a check from a file')\ndef ok(ctx):\n"
        "    return 'fine'\n"
    )
    done = selftest("--checks", str(mine), "--list", out=tmp_path, timeout=60)
    assert done.returncode == 0 and "mine-passes" in done.stdout, done.stderr
    (tmp_path / "broken.py").write_text("raise ValueError('bad import')\n")
    for given, says in (
        (
            tmp_path / "broken.py",
            f"saturate selftest: --checks {tmp_path / 'broken.py'}: importing it raised ValueError: ",
        ),
        (tmp_path / "absent.py", f"saturate selftest: --checks {tmp_path / 'absent.py'}: no such file"),
        ("no_such_module_anywhere", "saturate selftest: --checks no_such_module_anywhere: no module of that name"),
    ):
        done = selftest("--checks", str(given), "--list", out=tmp_path, timeout=60)
        assert done.returncode == 1 and done.stderr.startswith(says) and "Traceback" not in done.stderr, done.stderr


HOSTILE_CHECKS = """
import os, shutil, subprocess, sys
from pathlib import Path
from saturate.selftest.base import check

@check("rt-daemon", "leaves a detached process behind")
def daemon(ctx):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    Path(os.environ["DAEMON_PID"]).write_text(str(p.pid))
    return "left"

@check("rt-huge-detail", "a result of 10,000 lines")
def huge(ctx):
    return ("| pipe |\\n" * 10000) + "\\x1b[31m"

@check("rt-chdir-rm", "removes its work dir")
def chdir_rm(ctx):
    os.chdir("/")
    shutil.rmtree(ctx.work, ignore_errors=True)
    return "removed"
"""


def test_checks_that_misbehave_with_the_os_leave_a_table_and_no_process(tmp_path):
    """A check that removes the work dir, returns 10,000 lines or detaches a process (c91b):
    the table is written, one line per check, and the detached process is ended."""
    (tmp_path / "hostile_checks.py").write_text(HOSTILE_CHECKS)
    pid_file = tmp_path / "daemon.pid"
    command = [sys.executable, "-m", "saturate.selftest", "--device", "cpu", "--out", str(tmp_path / "out")]
    command += ["--checks", str(tmp_path / "hostile_checks.py"), "--only", "rt-daemon,rt-huge-detail,rt-chdir-rm"]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "DAEMON_PID": str(pid_file)}
    )
    daemon = int(pid_file.read_text())
    alive = psutil.pid_exists(daemon) and psutil.Process(daemon).status() != psutil.STATUS_ZOMBIE
    if alive:
        psutil.Process(daemon).kill()
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not alive, "the detached process outlived the self-test"
    table = (tmp_path / "out" / "selftest.md").read_text()
    huge = next(line for line in table.splitlines() if line.startswith("| rt-huge-detail"))
    assert len(huge) < 500 and "\x1b" not in table
    assert "| rt-chdir-rm |" in table
