"""Running the checks: each in a process of its own (`python -m saturate.selftest --one NAME`)
under its time limit, killed with its children when it has not answered; then the table."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from saturate.errors import printable
from saturate.selftest.base import REGISTRY, Check, Context, Failed, Skip


@dataclass
class Row:
    name: str
    kind: str
    what: str
    status: str  # PASS, FAIL or SKIP
    detail: str  # the one line: what it found, the error, or why it was skipped
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)


def run_one(check: Check, ctx: Context, result: Path) -> None:
    """In the check's own process: run it, write its row to `result`."""
    start = time.monotonic()
    figures: dict = {}
    try:
        found = check.fn(ctx)
        detail, figures = found if isinstance(found, tuple) else (found, {})
        status = "PASS"
        if ctx.dry and check.kind == "measure":
            detail = f"dry (toy sizes: the commands work, nothing is measured): {detail}"
    except Skip as e:
        status, detail = "SKIP", str(e)
    except Failed as e:
        status, detail = "FAIL", str(e)
    except Exception as e:  # noqa: BLE001 (a bug or a crash of the path under test: its one line here, the traceback in the log)
        traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        status, detail = "FAIL", f"{type(e).__name__}: {first}"[:300]
    row = Row(check.name, check.kind, check.what, status, one_line(detail), round(time.monotonic() - start, 1), figures)
    end_leftovers()
    result.parent.mkdir(parents=True, exist_ok=True)  # a check may have removed the work dir
    result.write_text(json.dumps(asdict(row)))


def end_leftovers() -> None:
    """In the check's process, once the check has returned: end every process it started and
    left running. A detached one (a new session) is out of reach of the runner's group kill, and
    the runner's polling misses it when the check returns at once after starting it."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


def one_line(detail) -> str:
    """A check's detail as one table line: control characters escaped, at most 300 characters."""
    text = printable(" ".join(str(detail).split()))
    return text if len(text) <= 300 else text[:299] + "…"


def skip_reason(check: Check, ctx: Context, left_s: float | None) -> str | None:
    """Why `check` does not run here, or None."""
    if check.needs_cuda and not ctx.cuda:
        return check.needs_cuda
    if check.kind == "measure" and not ctx.cuda and not ctx.dry:
        return "a measurement of the GPU (device=cpu): run it on a GPU, or --dry to check its commands here"
    if check.kind == "measure" and left_s is not None and not ctx.dry and left_s < check.estimate_s:
        return f"the budget has {max(0, left_s):.0f} s left; this takes about {check.estimate_s:.0f} s (raise --budget)"
    return None


def run_isolated(check: Check, ctx: Context, extra: list[str]) -> Row:
    """`check` in a new process group, killed whole (train.py runs and their workers too) after
    its time limit; its output in logs/<name>.log."""
    logs = ctx.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result = logs / f"{check.name}.result.json"
    result.unlink(missing_ok=True)
    where = ["--device", ctx.device, "--gpus", str(ctx.gpus), "--work", str(ctx.work)]  # as this process resolved them
    command = [sys.executable, "-m", "saturate.selftest", "--one", check.name, *where, *extra]
    start = time.monotonic()
    with open(logs / f"{check.name}.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        seen: set = set()  # every process the check started, detached ones too (they leave its group)
        try:
            _wait(proc, check.timeout_s, seen)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Row(
                check.name,
                check.kind,
                check.what,
                "FAIL",
                f"no answer within {check.timeout_s:.0f} s (killed; see logs/{check.name}.log)",
                round(time.monotonic() - start, 1),
            )
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything the check left running in its group
            except ProcessLookupError:
                pass
            for child in seen:  # and what it detached from the group
                with contextlib.suppress(psutil.Error):
                    child.kill()
    if result.exists():
        return Row(**json.loads(result.read_text()))
    try:
        text = (logs / f"{check.name}.log").read_text(errors="replace")
    except OSError:
        text = "(its log is gone: the check removed it)"
    tail = [line for line in text.splitlines() if line.strip()][-1:]
    return Row(
        check.name,
        check.kind,
        check.what,
        "FAIL",
        f"the check's process exited {proc.returncode} without an answer: {tail[0][:200] if tail else '(no output)'}",
        round(time.monotonic() - start, 1),
    )


def _wait(proc: subprocess.Popen, timeout_s: float, seen: set) -> None:
    """Wait for the check's process, noting the processes it starts as it runs."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            seen.update(psutil.Process(proc.pid).children(recursive=True))
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        time.sleep(0.1)


def run_all(checks: list[Check], ctx: Context, *, budget_s: float, extra: list[str], say=print) -> list[Row]:
    """The crash checks, then the measurements within `budget_s` (counted from the first)."""
    rows: list[Row] = []
    measuring_since = None
    for check in sorted(checks, key=lambda c: c.kind != "check"):  # crash checks first: a budget never skips one
        if check.kind == "measure" and measuring_since is None:
            measuring_since = time.monotonic()
        left = budget_s - (time.monotonic() - measuring_since) if measuring_since is not None else None
        why = skip_reason(check, ctx, left)
        row = Row(check.name, check.kind, check.what, "SKIP", why) if why else run_isolated(check, ctx, extra)
        say(f"{row.status:4}  {row.name:<26} {row.detail}" + (f"  ({row.seconds:.0f} s)" if row.seconds else ""))
        rows.append(row)
    return rows


def selected(only: list[str]) -> list[Check]:
    unknown = [name for name in only if name not in REGISTRY]
    if unknown:
        raise SystemExit(
            f"saturate selftest: --only {','.join(unknown)}: no such check; the checks are {', '.join(REGISTRY)}"
        )
    return [REGISTRY[name] for name in only] if only else list(REGISTRY.values())
