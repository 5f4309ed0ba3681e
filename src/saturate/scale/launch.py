"""Every device by default: `python train.py` on a machine with several GPUs starts one
process per GPU through torch's elastic launcher (the code path `torchrun` runs), all in the
run directory Hydra made for this run.

`trainer.devices`: "auto" (every visible CUDA device; one process on a CPU) or a number of
processes (on a CPU, gloo processes: `device=cpu trainer.devices=2`). Under torchrun or SLURM
(a LOCAL_RANK in the environment) the processes already exist and nothing is launched.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from saturate import record as run_record
from saturate.config.invocation import SCRIPT, TRAIN_COMMAND, Invocation, key_of
from saturate.config.naming import override_value
from saturate.errors import UserError
from saturate.scale.ranks import STOP_SIGNALS

log = logging.getLogger(__name__)

LAUNCHED = "SATURATE_LAUNCHED"  # set in the processes this module starts


def processes(devices, device_type: str) -> int:
    """How many processes this run wants that do not exist yet (1: run here)."""
    if "LOCAL_RANK" in os.environ:
        return 1
    cuda = torch.cuda.device_count() if device_type != "cpu" and torch.cuda.is_available() else 0
    if devices == "auto":
        return max(1, cuda)
    if devices > 1 and (device_type == "cuda" or cuda) and devices > cuda:  # CUDA asked for, or chosen by device=auto
        raise UserError(
            f"trainer.devices={devices}: {cuda} CUDA device(s) visible; expected at most {cuda}, or device=cpu"
        )
    return devices


def launch(count: int, overrides: list[str], run_dir: str) -> dict:
    """Run this script's job in `count` processes (rank 0 writes the run dir) and return
    rank 0's metrics.json. `overrides`: the whole command line (Invocation.command_line())."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # the ranks run the command this process runs: `saturate train` as the module, else the script
    script = ["-m", "saturate", "train"] if os.environ.get(SCRIPT) == TRAIN_COMMAND else [os.path.abspath(sys.argv[0])]
    kept = [o for o in overrides if key_of(o) not in ("hydra.run.dir", "run_dir")]
    pinned = f"hydra.run.dir={override_value(run_dir)}"
    args = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={count}", *script, *kept, pinned])
    os.environ[LAUNCHED] = "1"
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = first_failure(e)
        preempted = {128 + s for s in STOP_SIGNALS} | {-s for s in STOP_SIGNALS}
        if failure.exitcode in preempted:  # a signal to the ranks (a scheduler's): they stopped together
            log.warning(
                "trainer.devices=%d: the ranks were stopped by %s (their message above says what was saved and how "
                "to resume)",
                count,
                signal.Signals(abs(failure.exitcode) % 128).name,
            )
            raise SystemExit(128 + abs(failure.exitcode) % 128) from None
        log_file = Path(run_dir) / ("train.log" if rank == 0 else f"train.rank{rank}.log")
        raise UserError(
            f"trainer.devices={count}: rank {rank} failed first (exit status {failure.exitcode}); its message is "
            f"above, its log is {log_file}"
        ) from None
    except SignalException as e:  # SIGTERM or SIGINT to this launcher: torch's agent passed it on to the ranks
        log.warning(
            "trainer.devices=%d: %s; the ranks stopped (at a step boundary once training, which saves; their message "
            "above says what was saved and how to resume)",
            count,
            signal.Signals(e.sigval).name,
        )
        raise SystemExit(128 + e.sigval) from None
    finally:
        os.environ.pop(LAUNCHED, None)
    done = run_record.read(run_dir)
    if done is None:
        raise UserError(f"trainer.devices: the ranks ended, but rank 0 left no readable {run_record.path(run_dir)}")
    return done.entries


def first_failure(error: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The rank that failed first, and its failure (a ChildFailedError's): of the ranks that
    failed for a reason of their own, the earliest; a rank that stopped because another failed
    says so in its error file (saturate.scale.distributed.stopped_by_peer), and several ranks
    often end within the same second, the resolution of torch's timestamps."""
    from saturate.scale.distributed import PEER_STOPPED

    own = {rank: f for rank, f in error.failures.items() if PEER_STOPPED not in str(f.message)}
    failures = own or error.failures
    rank = min(failures, key=lambda r: (failures[r].timestamp, r))
    return rank, failures[rank]


def resume_hint(run_dir: str, world_size: int, invocation: Invocation) -> str:
    """The command that continues this run in its own directory: the same command line,
    with the run dir pinned and trainer.resume=auto (from Python: the same fit call). A job
    that a launcher started (hydra/launcher=slurm) goes back through it: `python train.py -m`
    with the launcher's overrides and this job's, into this job's dir."""
    if not invocation.app:
        return f"saturate.fit(..., run_dir={str(run_dir)!r}, overrides=[..., 'trainer.resume=auto'])"
    placed = ("hydra.run.dir", "trainer.resume", "run_dir")
    kept = [o for o in invocation.command_line() if key_of(o) not in placed]
    script = os.path.relpath(invocation.app) if invocation.app.endswith(".py") else "train.py"
    if invocation.app == TRAIN_COMMAND:
        return _resume_command(run_dir, world_size, invocation, kept, TRAIN_COMMAND, "-m saturate train")
    return _resume_command(run_dir, world_size, invocation, kept, f"python {script}", script)


def _resume_command(
    run_dir: str, world_size: int, invocation: Invocation, kept: list[str], command: str, torchrun: str
) -> str:
    """`command` (or torchrun with `torchrun`, its script or -m module) with the run dir pinned."""
    if invocation.launcher and invocation.sweep_dir:  # the job's own run dir is the sweep's dir and its subdir
        subdir = os.path.relpath(os.path.abspath(run_dir), invocation.sweep_dir)
        pinned = [
            f"hydra.sweep.dir={override_value(invocation.sweep_dir)}",
            f"hydra.sweep.subdir={override_value(subdir)}",
        ]
        return " ".join([command, "-m", *map(shlex.quote, [*kept, *pinned]), "trainer.resume=auto"])
    per_node = os.environ.get("LOCAL_WORLD_SIZE", world_size)
    launched = os.environ.get(LAUNCHED) == "1"  # started by trainer.devices: the same command starts them again
    launcher = command
    if world_size > 1 and not launched:
        launcher = f"torchrun --nproc_per_node={per_node} {torchrun}"
    run_dir_pinned = shlex.quote(f"hydra.run.dir={override_value(str(run_dir))}")
    return " ".join([launcher, *map(shlex.quote, kept), run_dir_pinned, "trainer.resume=auto"])
