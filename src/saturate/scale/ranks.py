"""Where this process stands among a run's processes, read from the environment alone:
torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE), or SLURM's through submitit. No torch
and no process group here, so that composing a config (the run directory's name is rank
0's) stays as fast as a `--help`."""

from __future__ import annotations

import os
import signal

# What a scheduler sends to stop a job (SLURM: SIGTERM, or the --signal before the time limit: SIGUSR2 from
# hydra/launcher=slurm, SIGUSR1 often in a user's own script; Ctrl-C: SIGINT): every rank stops at the same
# step, saves and exits 128 + the signal (saturate.loop.faults.StopSignal)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


def slurm_to_torch_env() -> None:
    """In a SLURM job of several tasks started by submitit (hydra/launcher=slurm), export
    torchrun's variables from SLURM's with submitit's helper; CUDA_VISIBLE_DEVICES is left
    alone (LOCAL_RANK picks the GPU)."""
    if (
        "RANK" in os.environ
        or os.environ.get("SUBMITIT_EXECUTOR") != "slurm"
        or int(os.environ.get("SLURM_NTASKS", "1")) <= 1
    ):
        return
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def cpus_per_task() -> int | None:
    """The CPUs SLURM gave each task of this job (--cpus-per-task, hydra.launcher.cpus_per_task),
    for torch's intra-op threads: without it every task of a node starts a thread per core of
    the node. None outside such a job, or where OMP_NUM_THREADS says already (the user's, or
    torchrun's for several processes)."""
    value = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if "OMP_NUM_THREADS" in os.environ or not value.isdigit() or int(value) < 1:
        return None
    return int(value)


def world_size() -> int:
    slurm_to_torch_env()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_zero() -> bool:
    """Whether this process is rank 0 (before any process group exists)."""
    slurm_to_torch_env()
    return int(os.environ.get("RANK", "0")) == 0


def cuda_index(configured: int, local_rank: int, visible: int) -> int:
    """The GPU a rank trains on, counted within CUDA_VISIBLE_DEVICES: `device.index` plus its
    local rank when the node's ranks share the visible GPUs, `device.index` alone when each
    rank sees only its own. The process group binds NCCL to the same one (saturate.scale.distributed)."""
    return configured + (local_rank if visible > 1 else 0)
