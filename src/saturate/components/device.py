"""Choosing the training device and its global switches (TF32, cudnn.benchmark, memory cap)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

from saturate.config.schema import DeviceConfig, TrainerConfig
from saturate.errors import UserError
from saturate.scale.ranks import cpus_per_task, cuda_index

log = logging.getLogger(__name__)


_THREADS = {"default": torch.get_num_threads(), "set": False}  # torch's own choice; whether a run changed it

# the CPU quota of this process's cgroup: v2's "quota period" (or "max period": none), v1's two files
CGROUP_ROOT = Path("/sys/fs/cgroup")
QUOTA, AFFINITY = "the cgroup's CPU quota", "the CPU affinity mask"


def quota_cores(cpu_max: Path | None = None) -> int | None:
    """The cores this process's cgroup CPU quota allows (quota / period, rounded up), or None
    where it sets none or cannot be read. `cpu_max`: a cgroup v2 cpu.max file; by default the
    one of this process's own cgroup and the root's (the smaller), else cgroup v1's
    cpu.cfs_quota_us and cpu.cfs_period_us. torch's default thread count ignores the quota: a
    container given 1 core on a 2-core host would start 2 threads that share it."""
    if cpu_max is not None:
        return _quota(_read(cpu_max).split())
    found = [_quota(_read(path).split()) for path in _cpu_max_files()]
    found.append(_quota([_read(CGROUP_ROOT / "cpu" / f"cpu.cfs_{part}_us") for part in ("quota", "period")]))
    known = [n for n in found if n is not None]
    return min(known) if known else None


def _cpu_max_files() -> list[Path]:
    own = [line.partition("::")[2] for line in _read(Path("/proc/self/cgroup")).splitlines() if line.startswith("0::")]
    return [CGROUP_ROOT / own[0].lstrip("/") / "cpu.max", CGROUP_ROOT / "cpu.max"] if own else [CGROUP_ROOT / "cpu.max"]


def _read(path: Path) -> str:
    try:
        with open(path) as f:
            return f.read(4096).strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _quota(fields: list[str]) -> int | None:
    """ceil(quota / period) from the two figures, or None: no quota ("max", v1's -1), or not two whole numbers."""
    if len(fields) != 2 or not all(f.isdigit() for f in fields) or int(fields[1]) == 0 or int(fields[0]) == 0:
        return None
    return max(1, math.ceil(int(fields[0]) / int(fields[1])))


def auto_threads(cpu_max: Path | None = None) -> tuple[int | None, str]:
    """device.threads=auto: (the count, why), or (None, "") for torch's own. SLURM's CPUs per
    task in a SLURM job; else the cores this process may use, where that is fewer than torch's
    default: the cgroup's CPU quota (which torch ignores) within the affinity mask (which torch
    reads once, at import: a mask set later, a launcher's or a notebook's, is followed here);
    OMP_NUM_THREADS set by the user wins over both (torch has read it)."""
    slurm = cpus_per_task()
    if slurm is not None:
        return slurm, ""
    if "OMP_NUM_THREADS" in os.environ:
        return None, ""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = quota_cores(cpu_max)
    cores = min(quota or affinity, affinity)
    if cores >= _THREADS["default"]:
        return None, ""
    return cores, QUOTA if quota is not None and quota < affinity else AFFINITY


def set_threads(threads) -> str:
    """device.threads: a number; or auto (auto_threads), else what torch chose, put back after
    an earlier run in this process set another (tune's trials) and otherwise left as the caller
    has it. Returns why auto chose fewer than torch would ("" when it did not)."""
    chosen, why = (threads, "") if threads != "auto" else auto_threads()
    if chosen is None and _THREADS["set"]:
        chosen = _THREADS["default"]
    if chosen is not None:
        torch.set_num_threads(chosen)
        _THREADS["set"] = chosen != _THREADS["default"]
    return why


def setup_device(cfg: DeviceConfig, local_rank: int = 0) -> torch.device:
    """Resolve `cfg.type` to a device and apply the CUDA switches; says what it chose.

    Under torchrun each process takes the device `index + local_rank` when it sees several
    GPUs; a process that sees one (one GPU per rank: SLURM's --gpus-per-task, Kubernetes)
    takes that one. `index` counts within CUDA_VISIBLE_DEVICES, which CUDA itself honours.
    `threads`: torch's intra-op threads; auto: as many as SLURM gave the task CPUs in a SLURM
    job, else the cores the cgroup's CPU quota allows where that is fewer than torch's own
    default (its cores in the affinity mask, or OMP_NUM_THREADS, which wins), else torch's
    default, also after an earlier run of this process set another number (tune's trials).
    """
    if cfg.keep_host_memory:
        keep_host_memory()
    why = set_threads(cfg.threads)
    has_cuda = torch.cuda.is_available()
    if cfg.type == "cuda" and not has_cuda:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise UserError(f"device.type='cuda': no CUDA device is available{hint}; use device=cpu or device=auto")
    if cfg.type == "cpu" or not has_cuda:
        threads = f"{torch.get_num_threads()} threads" + (f": {why}" if why else "")
        log.info("device: cpu (%s)%s", threads, "" if cfg.type == "cpu" else ", no CUDA found")
        return torch.device("cpu")

    count = torch.cuda.device_count()
    index = cuda_index(cfg.index, local_rank, count)
    if index >= count:
        raise UserError(f"device.index={cfg.index}: device {index} requested but {count} CUDA device(s) are visible")
    torch.cuda.set_device(index)
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark is True  # auto: decided once the data is known
    if cfg.memory_fraction < 1.0:
        torch.cuda.set_per_process_memory_fraction(cfg.memory_fraction, index)
    log.info(
        "device: cuda:%d (%s), tf32=%s, cudnn.benchmark=%s",
        index,
        torch.cuda.get_device_name(index),
        cfg.tf32,
        cfg.cudnn_benchmark,
    )
    return torch.device("cuda", index)


def autotune_convolutions(cfg: DeviceConfig, *, fixed_shapes: bool, device: torch.device) -> bool:
    """cudnn.benchmark, decided once the data is known: it times every convolution algorithm
    for each new input shape, which pays off when the shapes are fixed and is paid again for
    every new length when they vary (a padding collate). auto: on for fixed shapes; true and
    false are the user's; never in deterministic mode (its algorithms are chosen, not timed).
    Returns the choice."""
    on = device.type == "cuda" and (cfg.cudnn_benchmark is True or (cfg.cudnn_benchmark == "auto" and fixed_shapes))
    on = on and not torch.are_deterministic_algorithms_enabled()
    torch.backends.cudnn.benchmark = on
    if device.type == "cuda" and cfg.cudnn_benchmark == "auto":
        shapes = "fixed" if fixed_shapes else "varying"
        log.info("cudnn.benchmark=%s (device.cudnn_benchmark=auto: %s shapes)", on, shapes)
    return on


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt() parameters
MMAP_THRESHOLD = 32 * 2**20  # glibc's upper limit for it on 64-bit systems
TRIM_THRESHOLD = 2**30


def keep_host_memory() -> bool:
    """Let glibc's malloc keep freed blocks up to 32 MiB for reuse instead of handing each back
    to the OS. By default a block over 128 KiB (a batch, an activation) is mmap'ed when taken
    and munmap'ed when freed, and a training step frees and takes them again every step: the
    pages fault in anew each time (docs/benchmarks.md, "Single settings": keep_host_memory); the
    environment variable MALLOC_MMAP_THRESHOLD_ does the same (jemalloc and tcmalloc, which
    PyTorch's CPU tuning guide suggests, do it too). Left alone when the user chose: an allocator in LD_PRELOAD or a
    MALLOC_* variable. Processes forked later (DataLoader workers) inherit it. Returns
    whether it was applied."""
    if sys.platform != "linux" or "LD_PRELOAD" in os.environ or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


class OutOfMemory(UserError):
    """Out of memory even with the smallest batch (or micro-batch) there is."""


# what cuBLAS and cuDNN raise when they cannot allocate their handles or workspaces
ALLOCATION_FAILED = (
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
)


# torch.OutOfMemoryError from torch 2.4 on; torch 2.3 names it torch.cuda.OutOfMemoryError only
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def is_oom(error: BaseException) -> bool:
    """CUDA's out-of-memory error (current form, or the older RuntimeError), or a cuBLAS or
    cuDNN allocation failure, which are the same shortage by another name."""
    return isinstance(error, _OUT_OF_MEMORY) or (
        isinstance(error, RuntimeError) and any(s in str(error) for s in ALLOCATION_FAILED)
    )


def free_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def seed_all(seed: int) -> None:
    """Python's, NumPy's and torch's global generators (torch's CUDA ones too) seeded with `seed`."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def seeded(cfg: TrainerConfig, device: torch.device):
    """Seed every generator; with `deterministic`, deterministic kernels for the run (the
    process-wide switches are put back afterwards, for callers that train twice).

    On CUDA some backward kernels have no deterministic version (adaptive pooling, NLLLoss,
    scatter-add among them): torch then warns when one runs instead of stopping the run, and
    the run is reproducible up to those ops. On the CPU every op used is deterministic and
    resumed runs equal uninterrupted ones bit for bit."""
    seed_all(cfg.seed)
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        cuda = device.type == "cuda"
        torch.use_deterministic_algorithms(True, warn_only=cuda)
        torch.backends.cudnn.benchmark = False
        if cuda:
            log.warning(
                "trainer.deterministic=true on CUDA: ops without a deterministic CUDA kernel (adaptive pooling and "
                "NLLLoss backward, scatter-add, ...) run anyway, each with a torch warning; bit-exact results are "
                "promised on the CPU only"
            )
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


@contextlib.contextmanager
def untouched_rng(task=None):
    """Every global generator (Python's `random`, NumPy's, torch's CPU and CUDA ones) as it was
    before the block, whatever the block drew: for what runs the user's model or task only to
    look at it (the start-up checks, the cost probes, the batch-size search). Dropout, or a
    task that draws its own mixup weights, would otherwise move the streams training then
    sees, and a measurement setting would change what the run learns. With `task`, the state
    it holds in tensors too (a hidden state carried from one batch to the next: task.carry's,
    or a user's task's own), as it was."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    kept = {name: _copied(value) for name, value in vars(task).items()} if hasattr(task, "__dict__") else None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        if kept is not None:
            _put_back_tensor_state(task, kept)


def _put_back_tensor_state(obj, kept: dict) -> None:
    """The attributes of `obj` that held tensors before (alone, or in lists, tuples and dicts;
    `kept` copies them down to the tensors, so a state changed in place comes back too) or hold
    them now, as they were. Other attributes (a flag a check set, a module, a data set the task
    refers to) are left as they became."""
    for name in set(vars(obj)) | set(kept):
        if _holds_tensors(kept.get(name)) or _holds_tensors(vars(obj).get(name)):
            if name in kept:
                setattr(obj, name, kept[name])
            else:
                delattr(obj, name)


def _holds_tensors(value) -> bool:
    if isinstance(value, torch.nn.Parameter):  # trained weights (a task that is a Module): the optimizer's own
        return False
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    if type(value) is dict:
        return any(_holds_tensors(v) for v in value.values())
    return False


def _copied(value):
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return value.clone()
    if type(value) in (list, tuple):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_copied(v) for v in value))
    if type(value) is dict:
        return {k: _copied(v) for k, v in value.items()}
    return value
