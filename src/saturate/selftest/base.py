"""What a self-test check is: a named function run in a process of its own, given a Context,
that returns what it found (one line, and figures for a measurement) or raises `Skip` or
`Failed`. `check(...)` registers one; your own module of checks registers its own the same
way (`saturate selftest --checks my_project.checks`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from saturate import record as run_record

ROOT = Path(__file__).resolve().parents[3]  # the checkout: train.py, conf/, scripts/


class Skip(Exception):
    """This check has no meaning here; the message says why."""


class Failed(Exception):
    """The check ran and found something wrong; the message is its one line."""


@dataclass(frozen=True)
class Check:
    name: str
    what: str  # one line: the path it exercises
    fn: Callable[[Context], str | tuple[str, dict]]
    kind: str = "check"  # "check" (does it work) or "measure" (how fast; GPU only unless --dry)
    needs_cuda: str = ""  # why it has no meaning without a GPU (skipped there with this reason)
    timeout_s: float = 180.0  # the check's process is killed after this
    estimate_s: float = 30.0  # a measurement's usual cost on a GPU: skipped when the budget left is smaller


REGISTRY: dict[str, Check] = {}


def check(
    name: str,
    what: str,
    *,
    kind: str = "check",
    needs_cuda: str = "",
    timeout_s: float = 180.0,
    estimate_s: float = 30.0,
):
    """Register the decorated function as the check `name`."""

    def register(fn):
        REGISTRY[name] = Check(name, what, fn, kind, needs_cuda, timeout_s, estimate_s)
        return fn

    return register


@dataclass
class Run:
    """One train.py run a check started: its run dir, exit status and output."""

    run_dir: Path
    returncode: int
    output: str

    @property
    def metrics(self) -> dict:
        done = run_record.read(self.run_dir)
        if done is None:
            raise Failed(f"no readable {run_record.FILE} in {self.run_dir}: {self.error_line()}")
        return done.entries

    def error_line(self) -> str:
        """The line that says what went wrong: saturate's 'error:' line, else the exception's."""
        lines = [line.strip() for line in self.output.splitlines() if line.strip()]
        said = [line for line in lines if line.startswith("error:")]
        raised = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception", "Interrupt"))]
        return (said or raised or lines or ["(no output)"])[-1][:300]


@dataclass
class Context:
    """Where and how a check runs."""

    device: str  # "cuda" or "cpu": what the runs are told (device=...)
    work: Path  # runs/ and logs/ go here
    dry: bool = False  # measurements at toy sizes: their commands are checked, nothing is measured
    gpus: int = 0  # CUDA devices visible
    runs: list[Run] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def tiny(self, steps: int = 8, batch: int = 32) -> list[str]:
        """A run of a few steps on synthetic 32x32 images (no download, seconds anywhere)."""
        return [
            "data=synthetic",
            "data.num_train=1024",
            "data.num_val=256",
            "trainer.max_epochs=1",
            f"trainer.limit_train_batches={steps}",
            "trainer.limit_val_batches=2",
            f"trainer.log_interval={max(1, steps // 2)}",
            "trainer.progress=false",
            f"loader.batch_size={batch}",
            "loader.num_workers=0",
            f"device={self.device}",
            "trainer.devices=1",
        ]

    def train(self, name: str, *overrides: str, expect: int | None = 0, env: dict | None = None) -> Run:
        """`python train.py OVERRIDES` into runs/NAME, as a user runs it; Failed when its exit
        status is not `expect` (None: any)."""
        run_dir = self.work / "runs" / name
        run = self._command(
            [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"], run_dir, env
        )
        if expect is not None and run.returncode != expect:
            raise Failed(f"train.py exited {run.returncode} (expected {expect}): {run.error_line()}")
        return run

    def script(self, name: str, *args: str) -> dict:
        """`python scripts/NAME ARGS --json FILE`: the figures it wrote."""
        out = self.work / "logs" / f"{Path(name).stem}.{len(self.runs)}.json"
        run = self._command([sys.executable, str(ROOT / "scripts" / name), *args, "--json", str(out)], out.parent)
        if run.returncode != 0 or not out.exists():
            raise Failed(f"scripts/{name} exited {run.returncode}: {run.error_line()}")
        return json.loads(out.read_text())

    def _command(self, command: list[str], where: Path, env: dict | None = None) -> Run:
        """`command` run from the work folder, its output's tail in this check's log."""
        print("$", " ".join(command), flush=True)
        done = subprocess.run(command, cwd=self.work, capture_output=True, text=True, env={**os.environ, **(env or {})})
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", flush=True)
        run = Run(where, done.returncode, done.stdout + done.stderr)
        self.runs.append(run)
        return run


def expect(condition: bool, message: str) -> None:
    """Failed(message) unless `condition`."""
    if not condition:
        raise Failed(message)
