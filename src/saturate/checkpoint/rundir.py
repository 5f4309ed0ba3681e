"""The run directory belongs to one run at a time, and never loses an earlier run.

A run holds its directory for as long as it runs (an exclusive `flock` on `<run dir>/.lock`,
released by the kernel however the process ends): a second run started into the same
directory is refused with one line, instead of racing the first for `last.pt`. A fresh run
(no `trainer.resume`) into a directory that holds an earlier run's checkpoints is refused
too, with the commands that continue it (`trainer.resume=auto`) or start it over
(`trainer.restart=true`, which deletes everything that run wrote): a forgotten
`trainer.resume=auto` must not replace a finished run's `best.pt` by a worse one. The deletion
is the last thing before training: `hold` only grants it, and the run calls `start_over()`
once its whole configuration is validated and its parts are built, so a mistake in the same
command (a negative width, a bad learning rate) deletes nothing.

How the run was started (`.hydra/config.yaml`, `hydra.yaml`, `overrides.yaml`: what
`saturate eval --run-saved-config` and sweep reports read) is saved by saturate, not by Hydra
before the run starts, and only once the directory is this run's: a run refused for another
run's directory replaces nothing of that run.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from saturate import record as run_record
from saturate.config.registration import UNSET_RUN_DIR
from saturate.config.secrets import masked
from saturate.errors import ConfigError, UserError, printable
from saturate.files import write_text
from saturate.record import RunRecord
from saturate.scale.ranks import rank_zero

log = logging.getLogger(__name__)

LOCK = ".lock"
OWN_NAMES = ("last.pt", "best.pt", "top-*.pt")  # saturate's checkpoint files: the only ones resume looks at in a folder


HYDRA_SUBDIR = ".hydra"
_started: tuple[Path, dict[str, str]] | None = None  # the record of how the run in a dir was started, not yet saved


def save_when_claimed(run_dir: str | Path, files: dict[str, str]) -> None:
    """Save `files` (name -> text) in `run_dir`/.hydra once the run holds its directory
    (`hold`; trainer.restart: once the earlier run's files are deleted), or once it fails
    there without another run's files in the way (`record_failure`)."""
    global _started
    _started = (Path(run_dir).resolve(), files) if files and run_dir else None


def _save_started(run_dir: Path) -> None:
    global _started
    if _started is None or _started[0] != run_dir.resolve():
        return
    files, _started = _started[1], None
    (run_dir / HYDRA_SUBDIR).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write_text(run_dir / HYDRA_SUBDIR / name, text)


def save_started_if_free(run_dir: str | Path) -> None:
    """The record of how the run was started, saved now when no other run is in `run_dir`: a
    tune's dir, which its trials hold in folders of their own."""
    directory = Path(run_dir)
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True)
        if _free(directory):
            _save_started(directory)


def _free(run_dir: Path) -> bool:
    """Whether no other run is in `run_dir`: none holds it, none left its checkpoints there."""
    if _own_checkpoints(run_dir):
        return False
    try:
        with open(run_dir / LOCK, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


class RunDirTaken(UserError):
    """The run directory is another run's: in use, or holding its checkpoints. Nothing of this
    run is written there (not even a failure record)."""


def _own_checkpoints(run_dir: Path) -> list[Path]:
    folder = run_dir / "checkpoints"
    return sorted({p for pattern in OWN_NAMES for p in folder.glob(pattern)}) if folder.is_dir() else []


def _resumes_here(resume: str | None, run_dir: Path) -> bool:
    """Whether `trainer.resume` continues the run that lives in `run_dir`."""
    if resume == "auto":
        return True
    if not resume:
        return False
    target, here = Path(resume).expanduser().resolve(), run_dir.resolve()
    return target in (here, here / "checkpoints") or target.parent == here / "checkpoints"


def _earlier_run(run_dir: Path) -> str:
    """What the earlier run in `run_dir` reached, in words, from its metrics.json (if readable)."""
    unreadable = f"its {run_record.FILE} says nothing readable"
    done = run_record.read(run_dir)
    best = done.best if done is not None else None
    if done is None or done.status is None or best is None:
        return unreadable
    try:
        return f"{done.status}, best {best['metric']} {float(best['value']):.4f} at step {int(best['step'])}"
    except (KeyError, TypeError, ValueError):  # a record that is not saturate's
        return unreadable


# what a run writes in its dir besides checkpoints (Hydra's .hydra/ and train.log are Hydra's): its
# metrics, report, predictions, TensorBoard events (in the run dir; tb/ and tb/hparams/: where runs
# written before that layout kept them), and what the trackers keep to continue their run (saturate.loggers.mlflow,
# saturate.loggers.wandb: deleted, MLflow and W&B start a new run; the old one stays in their store)
OWN_FILES = (
    run_record.FILE,
    "metrics.csv",
    "report.md",
    "mlflow.json",
    "predictions/*.npz",
    "events.out.tfevents.*",
    "tb/**/events.out.tfevents.*",
    "wandb/**/*",
)


def _start_over(run_dir: Path) -> None:
    """trainer.restart=true: everything the earlier run wrote goes (its checkpoints, TensorBoard
    events and HParams session, predictions, metrics and report, its trackers' files), each file
    listed in the log; files of other names (a user's notes) stay."""
    found = {p for pattern in OWN_FILES for p in run_dir.glob(pattern) if p.is_file() or p.is_symlink()}
    deleted = [*_own_checkpoints(run_dir), *sorted(found)]
    for path in deleted:
        path.unlink(missing_ok=True)
    shutil.rmtree(run_dir / "wandb", ignore_errors=True)  # its folders, emptied above
    for folder in (run_dir / "predictions", run_dir / "tb" / "hparams", run_dir / "tb"):
        with contextlib.suppress(OSError):  # only if empty: a user's file there stays
            folder.rmdir()
    log.warning(
        "trainer.restart=true: deleted the earlier run's %d file(s) in %s: %s",
        len(deleted),
        printable(run_dir),
        ", ".join(printable(p.relative_to(run_dir)) for p in deleted),
    )


def _check(run_dir: Path, resume: str | None, restart: bool) -> RunDirTaken | bool:
    """Why this run may not start in `run_dir`; else whether it starts over (trainer.restart
    over an earlier run's checkpoints)."""
    checkpoints = _own_checkpoints(run_dir)
    if not checkpoints or _resumes_here(resume, run_dir):
        return False
    if restart:
        return True
    return RunDirTaken(
        f"run_dir: {printable(run_dir)} holds the checkpoints of an earlier run ({_earlier_run(run_dir)}); continue it "
        "with trainer.resume=auto, start it over with trainer.restart=true (deletes what it wrote: checkpoints, "
        "TensorBoard events, predictions, metrics), or give this run its own hydra.run.dir"
    )


class Held:
    """The run dir, held. `start_over()` deletes the earlier run's files where trainer.restart
    asked for it: call it once nothing can fail for a mistake in the config any more."""

    def __init__(self, run_dir: Path, restart: bool):
        self.run_dir, self.restart = run_dir, restart

    def start_over(self) -> None:
        if self.restart:
            self.restart = False
            _start_over(self.run_dir)
            _save_started(self.run_dir)


@contextlib.contextmanager
def hold(
    run_dir: Path, *, resume: str | None, restart: bool, enabled: bool, agree: Callable[[bool], bool]
) -> Iterator[Held]:
    """Hold `run_dir` for the block, or raise RunDirTaken. `enabled` on rank 0 only (the
    others share its directory); `agree` makes every rank stop when rank 0 is refused."""
    lock, refused, over = None, None, False
    if enabled:
        lock = open(run_dir / LOCK, "a+")  # noqa: SIM115 (held for the whole run)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            lock = None
            refused = RunDirTaken(
                f"run_dir: {printable(run_dir)} is in use by another run ({holder}); wait for it to end, or give this "
                "run its own hydra.run.dir"
            )
        else:
            lock.truncate(0)
            lock.write(f"process {os.getpid()}\n")
            lock.flush()
            checked = _check(run_dir, resume, restart)
            refused, over = (checked, False) if isinstance(checked, RunDirTaken) else (None, checked)
            if refused is None and not over:
                _save_started(run_dir)
    try:
        if not agree(refused is None):
            raise refused or RunDirTaken("run_dir: refused on rank 0 (its message says why)")
        yield Held(run_dir, over)
    finally:
        if lock is not None:
            lock.close()  # the kernel drops the lock


def record_failure(run_dir: str, error: Exception, *, trained: bool = False) -> None:
    """metrics.json of a run that failed: status and why (rank 0 only). Where this attempt
    failed before it trained, an earlier attempt's record that is not a failure (a finished
    or preempted run resumed with a mistake in its config) is kept: its final metrics are not
    replaced by an error. An attempt that `trained` records its own failure."""
    if not rank_zero():
        return
    try:
        directory = Path(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
    except Exception:  # noqa: BLE001 (no run dir to write to (an unresolvable config, a read-only disk))
        return
    with contextlib.suppress(UserError):  # a full disk: the failure is still recorded below
        if _free(directory):
            _save_started(directory)
    found = run_record.read(directory)
    earlier = found.status if found is not None else None
    if earlier not in (None, "failed") and not trained:
        log.warning(
            "kept %s (status %s): this attempt failed before it trained; its error is not recorded there",
            run_record.path(directory),
            earlier,
        )
        return
    if isinstance(error, ConfigError):  # every problem, on one line (sweep reports show this)
        why = "; ".join(str(p) for p in error.problems)
    else:
        why = " ".join(line.strip() for line in str(error).strip().splitlines()[:3])
    run_record.write(directory, RunRecord({"status": "failed", "error": masked(f"{type(error).__name__}: {why}")}))


def prepare(run) -> Path:
    """The run's directory, made and found writable before any work (a read-only or full disk
    is found now, not at the first save); and the batch-size cache's, when a search will write it."""
    if run.run_dir == UNSET_RUN_DIR:
        raise UserError(
            "run_dir: not set; outside train.py (Hydra's compose API) give run_dir=<folder>, or use saturate.fit"
        )
    run_dir = Path(run.run_dir)
    _writable(run_dir, "run_dir")
    if run.loader.batch_size == "auto" and run.batch_search.cache:
        _writable(Path(run.batch_search.cache).parent, "batch_search.cache")
    return run_dir


def _writable(folder: Path, key: str) -> None:
    """`folder` exists (made if need be) and takes a file, or a UserError naming `key`."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".saturate-write-test-{os.getpid()}"
        probe.write_bytes(b"saturate")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{key}: cannot write to {folder} ({e.strerror or e}); point it at a writable folder") from None
