"""Where this process stands among a run's processes, read from the environment alone:
torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE), or SLURM's through submitit. No torch
and no process group here, so that composing a config (the run directory's name is rank
0's) stays as fast as a `--help`."""

from __future__ import annotations

import os

from saturate.errors import UserError
from saturate.started import STOP_SIGNALS

__all__ = ["STOP_SIGNALS", "cpus_per_task", "cuda_index", "rank_zero", "slurm_to_torch_env", "world_size"]


_exported_from_slurm = False  # slurm_to_torch_env derived RANK and WORLD_SIZE from SLURM's variables


def slurm_to_torch_env() -> None:
    """In a SLURM job of several tasks started by submitit (hydra/launcher=slurm), export
    torchrun's variables from SLURM's with submitit's helper; CUDA_VISIBLE_DEVICES is left
    alone (LOCAL_RANK picks the GPU)."""
    global _exported_from_slurm
    if "RANK" in os.environ or os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return
    if _whole("SLURM_NTASKS", 1, "a number of tasks >= 1 (read under SUBMITIT_EXECUTOR=slurm)") <= 1:
        return
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    _exported_from_slurm = True


def _whole(name: str, default: int, allowed: str, low: int = 1) -> int:
    """The environment variable `name` as a whole number >= `low` (`default` when unset); any
    other value is one line naming it, its value and what is allowed."""
    value = os.environ.get(name)
    if value is None:
        return default
    number = int(value.strip()) if value.strip().isdigit() else None
    if number is None or number < low:
        raise UserError(f"{name}={value!r} in the environment: expected {allowed}")
    return number


def origin() -> str:
    """The environment variables that make this process a rank of several, as `NAME=value`s."""
    names = ("SUBMITIT_EXECUTOR", "SLURM_NTASKS", "SLURM_PROCID") if _exported_from_slurm else ("RANK", "WORLD_SIZE")
    return " ".join(f"{name}={os.environ.get(name)}" for name in names)


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
    """How many processes this run has (WORLD_SIZE, 1 when unset); a WORLD_SIZE, RANK or
    LOCAL_RANK that cannot be this process's is one line naming it."""
    slurm_to_torch_env()
    size = _whole("WORLD_SIZE", 1, "the run's number of processes, a whole number >= 1")
    rank = _whole("RANK", 0, f"this process's rank: 0 to WORLD_SIZE - 1 = {size - 1} (WORLD_SIZE={size})", low=0)
    if rank >= size:
        unset = "" if "WORLD_SIZE" in os.environ else ", unset"
        raise UserError(
            f"RANK={rank} in the environment: expected 0 to WORLD_SIZE - 1 = {size - 1} (WORLD_SIZE={size}{unset}); "
            "set both, as torchrun does, or neither to train in one process"
        )
    _whole("LOCAL_RANK", 0, "this process's rank on its node, a whole number >= 0", low=0)
    return size


def rank_zero() -> bool:
    """Whether this process is rank 0 (before any process group exists)."""
    world_size()  # the variables checked
    return int(os.environ.get("RANK", "0")) == 0


def cuda_index(configured: int, local_rank: int, visible: int) -> int:
    """The GPU a rank trains on, counted within CUDA_VISIBLE_DEVICES: `device.index` plus its
    local rank when the node's ranks share the visible GPUs, `device.index` alone when each
    rank sees only its own. The process group binds NCCL to the same one (saturate.scale.distributed)."""
    return configured + (local_rank if visible > 1 else 0)
