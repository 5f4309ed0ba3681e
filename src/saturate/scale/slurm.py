"""hydra/launcher=slurm, in the sweep command: hydra-submitit-launcher's launch (each job of a
sweep, or the one job of `python train.py -m`, a SLURM job; the Hydra plugin is
hydra_plugins.saturate_slurm_launcher), with what the sweep needs to say and to wait for:

- the preset's time-limit signal checked against its time limit before anything is submitted;
- an sbatch that refuses the jobs (more memory or GPUs than the partition's nodes have) is
  one message carrying sbatch's reason, not submitit's traceback;
- job states from `squeue` where `sacct` cannot give them (SLURM accounting off), said once:
  submitit would warn at every poll and, never seeing a cancelled job end, wait forever;
- a job that ends without a result (scancel, a time limit past max_num_timeout, a node
  failure) is one message once every job has left the queue: what each job ended as, and
  for each stopped run the command that resumes it (its metrics.json's `resume_with`);
- jobs still queued when the sweep returns are named.

The jobs themselves run hydra-submitit-launcher's code: the stop signal and requeue are the run's
(saturate.loop.faults.StopSignal), the resume command is saturate.scale.launch.resume_hint.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hydra.core.utils import JobReturn
from omegaconf import OmegaConf
from submitit.core.utils import FailedJobError, UncompletedJobError
from submitit.slurm import slurm as submitit_slurm

from saturate import record as run_record
from saturate.errors import UserError

log = logging.getLogger(__name__)

# slurmctld checks time limits every 30 s and sends --signal "up to 60 seconds earlier than
# specified" (sbatch's manual): a signal delay must leave the job at least this long to train
EARLY_SIGNAL_S = 60
SQUEUE_EVERY_S = 30  # how often the sweep asks squeue once sacct has failed (submitit asks sacct every 600 s)
# SLURM states of a job that is not over, though submitit's list would count it finished
NOT_OVER = {"CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING", "REQUEUE_HOLD"}
NOT_OVER |= {"REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD"}
LEFT_THE_QUEUE = "LEFT_THE_QUEUE"  # no longer listed by squeue (its end is older than slurmctld's MinJobAge)


def launch(launcher, submit: Callable[[], Sequence[JobReturn]]) -> Sequence[JobReturn]:
    """hydra-submitit-launcher's launch (`submit`) for `launcher` (its `params`: the resolved
    hydra.launcher node; its `config`: the sweep's), with the checks and messages of this module."""
    params = launcher.params
    check_signal_delay(params["timeout_min"], params["signal_delay_s"])
    if OmegaConf.select(launcher.config, "trainer.resume", default=None) != "auto":
        log.warning(
            "hydra/launcher=slurm without trainer.resume=auto: a job SLURM requeues (preemption, scontrol requeue, "
            "its time limit) cannot continue its run and is refused its run dir; add trainer.resume=auto"
        )
    watcher = SqueueWatcher.install()
    try:
        with _sbatch_lines_held():
            returns = submit()
    except FailedJobError as e:
        if not _refused_by_sbatch(e):
            raise  # a job that failed outside its run (saturate's errors are in its JobReturn): the traceback
        raise UserError(refusal(params, e)) from None
    except UncompletedJobError as e:
        watcher.wait()  # the sweep's other jobs, and requeued ones, may still run: their end first
        raise UserError(unfinished(Path(str(launcher.config.hydra.sweep.dir)), watcher, e)) from None
    queued = watcher.not_over()
    if queued:
        log.warning(
            "the sweep returns while SLURM job(s) %s are still queued (squeue -j %s follows them)",
            ", ".join(f"{job} ({state})" for job, state in queued.items()),
            ",".join(sorted({job.split("_")[0] for job in queued})),
        )
    return returns


def refusal(params: dict, error: FailedJobError) -> str:
    """One message for an sbatch that refused the jobs: its reason and what hydra.launcher asked for."""
    said = "; ".join(line.removeprefix("sbatch: error:").strip() for line in str(error).splitlines() if line.strip())
    keys = ("partition", "nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node", "mem_gb")
    asked = ", ".join(f"{key}={params.get(key)}" for key in keys)
    return (
        f"hydra/launcher=slurm: sbatch refused the job ({said}); hydra.launcher asks for {asked}: sinfo -N -o "
        "'%P %N %c %m %G' lists each partition's nodes with their CPUs, memory (MB) and GPUs (mem_gb=null takes the "
        "partition's default memory)"
    )


def unfinished(sweep_dir: Path, watcher: SqueueWatcher, error: UncompletedJobError) -> str:
    """One message for jobs that ended without a result: how each ended, and each stopped run."""
    ended = [
        f"{job} {state.lower().replace('_', ' ')}" for job, state in watcher.states().items() if state != "COMPLETED"
    ]
    first = str(error).strip().splitlines()[0]
    lines = [f"hydra/launcher=slurm: SLURM job(s) ended without a result: {', '.join(ended) or first}"]
    return "\n".join([*lines, *stopped_runs(sweep_dir)])


def check_signal_delay(timeout_min: int, signal_delay_s: int) -> None:
    """The signal before the time limit (SIGUSR2, on which the run saves and submitit requeues
    it) must come after the job has had time to train, or every attempt is signalled before
    it trains and max_num_timeout is used up for nothing."""
    most = timeout_min * 60 - EARLY_SIGNAL_S
    if signal_delay_s >= most:
        raise UserError(
            f"hydra.launcher.signal_delay_s={signal_delay_s}: expected less than timeout_min x 60 - {EARLY_SIGNAL_S} = "
            f"{most} s (SLURM may send the signal up to {EARLY_SIGNAL_S} s early: every attempt would be signalled "
            "before it trains); lower it, or raise hydra.launcher.timeout_min"
        )


def stopped_runs(sweep_dir: Path) -> list[str]:
    """A line for each run of the sweep that did not complete: its status and, for a stopped
    one, the command that resumes it (from its metrics.json)."""
    lines = []
    for path in sorted(sweep_dir.glob(f"*/{run_record.FILE}")):
        record = run_record.read(path.parent)
        if record is None:
            continue
        if record.status == "preempted":
            lines.append(
                f"  {path.parent}: stopped by {record.stopped_by} with last.pt saved; resume with: {record.resume_with}"
            )
        elif record.status != "completed":
            lines.append(f"  {path.parent}: {record.status}" + (f": {record.error}" if record.error else ""))
    return lines


def _refused_by_sbatch(error: FailedJobError) -> bool:
    cause = error.__cause__
    return isinstance(cause, subprocess.CalledProcessError) and "sbatch" in str(cause.cmd[0] if cause.cmd else "")


class _HeldLines:
    """sys.stderr, less what sbatch printed when it refused a job (submitit prints it, then
    raises it: the refusal's one message carries it)."""

    def __init__(self, stream):
        self.stream, self.dropped = stream, False

    def write(self, text: str) -> int:
        dropped, self.dropped = self.dropped, text.startswith("sbatch: error:")
        if self.dropped or (dropped and text == "\n"):
            return len(text)
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def _sbatch_lines_held() -> Iterator[None]:
    stream = sys.stderr
    sys.stderr = _HeldLines(stream)
    try:
        yield
    finally:
        sys.stderr = stream


class SqueueWatcher(submitit_slurm.SlurmInfoWatcher):
    """submitit's job states, which it reads with sacct; where sacct fails (no SLURM
    accounting), from squeue: the jobs slurmctld still knows (`-t all`: also those that ended
    within its MinJobAge); a job it no longer lists has ended."""

    @classmethod
    def install(cls) -> SqueueWatcher:
        """The watcher of every SLURM job of this process (submitit's is a class attribute)."""
        if not isinstance(submitit_slurm.SlurmJob.watcher, cls):
            submitit_slurm.SlurmJob.watcher = cls(delay_s=600)
        return submitit_slurm.SlurmJob.watcher

    def update(self) -> None:
        command = self._make_command()
        if command is None:
            return
        self._num_calls += 1
        sacct = subprocess.run(command, capture_output=True, text=True)
        if sacct.returncode == 0:
            self._output = sacct.stdout.encode()  # as submitit keeps it: bytes
            self._info_dict.update(self.read_info(sacct.stdout))
        else:
            self._from_squeue(sacct.stderr.strip())
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def _from_squeue(self, sacct_said: str) -> None:
        if self._delay_s != SQUEUE_EVERY_S:  # the first time: said once, instead of a warning per poll
            log.info("SLURM accounting is off here (sacct: %s): job states come from squeue", sacct_said or "failed")
            self._delay_s = SQUEUE_EVERY_S
        listed = subprocess.run(
            ["squeue", "--me", "-h", "-r", "-t", "all", "-o", "%i|%T"], capture_output=True, text=True
        )
        if listed.returncode != 0:  # the states stay as they were until the next poll
            log.debug("squeue failed: %s", listed.stderr.strip())
            return
        states = dict(line.split("|", 1) for line in listed.stdout.split() if "|" in line)
        for job in self._registered - self._finished:
            self._info_dict[job] = {"JobID": job, "State": states.get(job, LEFT_THE_QUEUE)}

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        return super().is_done(job_id, mode) and self.get_state(job_id, mode="cache") not in NOT_OVER

    def states(self) -> dict[str, str]:
        """Every job of this process with its state as last read."""
        return {job: self.get_state(job, mode="cache") for job in sorted(self._registered)}

    def not_over(self, settle_s: float = 30) -> dict[str, str]:
        """The jobs still queued or running once those that sent their results back have had
        `settle_s` to end (their processes exit after writing them; srun and SLURM take a few seconds more)."""
        deadline = time.monotonic() + settle_s
        while True:
            self.update()
            left = {job: state for job, state in self.states().items() if not self.is_done(job, mode="cache")}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(2)

    def wait(self, poll_s: float = 1.0) -> None:
        """Until every job of this process is over."""
        while not all(self.is_done(job) for job in self._registered):
            time.sleep(poll_s)
