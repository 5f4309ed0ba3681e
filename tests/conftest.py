"""Fixtures compose the real conf/ (as train.py does), shrink it to tiny sizes and point
the outputs at tmp_path."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import saturate
from tests.zygote import Zygote, kill_family

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "src" / "saturate" / "conf"  # saturate's own config groups, shipped in the package
# the browser that the real-browser tests (TensorBoard, the MLflow UI) drive
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
saturate.register()  # the schema and resolvers, before anything composes conf/


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    """Each test's image-folder index cache (XDG_CACHE_HOME) is its own, never the user's;
    CLI subprocesses inherit it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))


# A run of a few steps: seconds on a 2-core CPU.
TINY = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=2",
    "trainer.log_interval=1",
    "trainer.progress=false",
    "loader.batch_size=32",
    "loader.num_workers=0",
]


def compose_config(overrides: list[str]):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.fixture
def make_cfg(tmp_path):
    """make_cfg(*overrides, tiny=True) -> composed config whose run_dir is a new folder."""
    count = iter(range(1000))

    def make(*overrides: str, tiny: bool = True):
        run_dir = tmp_path / f"run{next(count)}"
        return compose_config([*(TINY if tiny else []), f"run_dir={run_dir}", *overrides])

    return make


def read_metrics(run_dir) -> dict:
    return json.loads((Path(run_dir) / "metrics.json").read_text())


def run_cli(
    *args: str, cwd: Path, timeout: float = 240, env: dict | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in `cwd` (its outputs/ lands there), as a user runs it (`python`)."""
    return python(ROOT / "train.py", *args, cwd=cwd, timeout=timeout, env=env, fresh=fresh)


def python(
    *argv, cwd: Path | str = ROOT, timeout: float = 240, env: dict | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`python ARGV` (a script, -m MODULE or -c CODE, then arguments) in `cwd`, its output
    captured as text: a process of its own, forked from one that has imported torch and the other
    heavy modules already (tests/zygote.py); `fresh` (and in a slow test): a new interpreter, for
    what the imports themselves decide. `env` adds to this process's environment."""
    env = {**os.environ, **(env or {})}
    if ZYGOTE.enabled and not (fresh or ZYGOTE.needs_fresh(argv, cwd, env)):
        return ZYGOTE.run(argv, cwd=cwd, env=env, timeout=timeout)
    command = [sys.executable, *map(str, argv)]
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:  # past the timeout, or interrupted: with every process under it, as the zygote's
            kill_family(proc.pid)
            proc.wait()  # as subprocess.run does: not the pipes' end, which a process outside the family may hold
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def popen(*argv, cwd: Path | str = ROOT, env: dict | None = None, stdout: int = subprocess.PIPE):
    """`python ARGV` started as subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True) would
    start it, from the zygote where `python` would run it there (tests/zygote.py's Child: pid,
    poll, wait, send_signal, kill, communicate, stdout and stderr)."""
    env = {**os.environ, **(env or {})}
    if ZYGOTE.enabled and not ZYGOTE.needs_fresh(argv, cwd, env):
        return ZYGOTE.popen(argv, cwd=cwd, env=env, stdout=stdout)
    command = [sys.executable, *map(str, argv)]
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE, text=True
    )


def stopped_after_first_save(args: list[str], run_dir: Path, cwd: Path) -> tuple[int, str]:
    """`python train.py ARGS hydra.run.dir=RUN_DIR`, sent SIGTERM once its first last.pt exists
    (a save at every epoch's end, unless ARGS say otherwise): (its exit status, its output:
    Hydra logs to stdout)."""
    import signal
    import time

    proc = popen(ROOT / "train.py", "trainer.checkpoint_interval=1", *args, f"hydra.run.dir={run_dir}", cwd=cwd)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "last.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = "".join(proc.communicate(timeout=120))
    return proc.returncode, out


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The slow end-to-end checks start every command in a fresh interpreter, as a user does;
    the default suite forks them from the zygote (`python`). Set before any fixture of the
    test is: a module's fixture may start commands too."""
    ZYGOTE.enabled = item.get_closest_marker("slow") is None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


# two workers on two cores: one thread each, for runs and the CLI processes they start
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
# the commands' zygote (tests/zygote.py), started by the first command, with the session's environment as it is
# now, ended with this process
ZYGOTE = Zygote(os.environ)


@pytest.fixture
def ctrl_c_reaches_us():
    """Python's own SIGINT handler while the test sends Ctrl-C (to itself, or to a child,
    which then starts with SIGINT at its default): a suite started in the background of a
    non-interactive shell inherits SIGINT ignored, a child process inherits that, and a run
    keeps an ignored SIGINT ignored (tests/checkpoint/test_resume.py), so the interrupt would
    never arrive."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium driven by Playwright (skipped, saying why, without playwright)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()
