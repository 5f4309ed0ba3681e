"""Running under torchrun (or SLURM through submitit) with DistributedDataParallel.

torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) starts one
process group per run: NCCL for CUDA tensors and gloo for CPU ones (so small agreements
between ranks, a stop flag or an out-of-memory, never touch the GPU). Under SLURM without
torchrun, submitit derives that environment from SLURM's. A single process gets a `Dist` of
world size 1 whose collectives are no-ops, so callers never ask whether they are
distributed.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import hashlib
import json
import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from saturate.errors import UserError
from saturate.files import write_text
from saturate.scale.ranks import cuda_index, rank_zero, world_size
from saturate.scale.rendezvous import rendezvous
from saturate.started import stopping_at_once

log = logging.getLogger(__name__)

GROUP_TIMEOUT = timedelta(minutes=10)  # a collective that waits longer for a rank fails

__all__ = [
    "PEER_STOPPED",
    "Dist",
    "alone",
    "no_sync",
    "peer_failed",
    "rank_zero",
    "shared_value",
    "stopped_by_peer",
    "world_size",
    "wrap",
]


def init_process_group(device_index: int | None = None) -> None:
    """Start this run's process group from the environment, once per process, after every
    rank has come (`rendezvous`). With CUDA the rank's GPU (`device_index`: device.index, by
    saturate.scale.ranks.cuda_index) is made current and NCCL bound to it, the GPU the run
    then trains on; without an index (the run directory's name is agreed before the config is
    read) the group is not bound, and Dist binds it."""
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    device_id = None
    if torch.cuda.is_available() and device_index is not None:
        device_id = torch.device("cuda", rank_gpu(device_index))
        torch.cuda.set_device(device_id)
    size = world_size()  # first: under SLURM it sets RANK from the task's variables
    rank = int(os.environ.get("RANK", "0"))
    with stopping_at_once("waiting for the other ranks"):
        store = rendezvous(rank, size)
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=size, timeout=GROUP_TIMEOUT, device_id=device_id
        )
    atexit.register(_close_process_group)
    log.debug("process group: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend)


def rank_gpu(configured: int) -> int:
    """This rank's GPU for device.index=`configured` (saturate.scale.ranks.cuda_index)."""
    return cuda_index(configured, int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())


def _close_process_group() -> None:
    """Close the process group before the interpreter exits: a rank that exits with gloo's
    threads still running aborts ("terminate called without an active exception") when it
    finishes before the others. The run's objects still held in reference cycles (DDP's
    reducer and the work it gave gloo) are freed first, while the interpreter can still run
    what freeing them calls, not during its finalisation."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


class Dist:
    """This process's place in the run, and the few collectives the run needs."""

    def __init__(self, device_index: int | None = None):
        """`device_index`: device.index when the run may use CUDA (None for device=cpu)."""
        self.world_size = world_size()
        if self.world_size > 1:
            init_process_group(device_index)
            # the group may have started unbound (shared_value)
            if torch.cuda.is_available() and device_index is not None:
                torch.cuda.set_device(rank_gpu(device_index))
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.is_main = self.rank == 0
        self.check_every = 1  # steps between stop-flag agreements (a collective): the log interval across ranks

    def agree(self, ok: bool) -> bool:
        """True only if `ok` on every rank (a gloo all-reduce of one CPU value: no GPU sync)."""
        if self.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def all_true(self, flag: torch.Tensor) -> torch.Tensor:
        """A bool tensor and-ed across the ranks where it lives (on the GPU under NCCL: no
        host read)."""
        if self.world_size == 1:
            return flag
        t = flag.to(torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t.bool()

    def minimum(self, value: int) -> int:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def any(self, flag: bool) -> bool:
        return not self.agree(not flag)

    def any_of(self, flags) -> list[bool]:
        """Each flag or-ed across the ranks, in one small collective."""
        if self.world_size == 1:
            return [bool(f) for f in flags]
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def mean(self, values: dict[str, float], sum_keys: tuple[str, ...] = ()) -> dict[str, float]:
        """Average `values` over the ranks (`sum_keys` are summed instead); one all-reduce."""
        if self.world_size == 1 or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return {k: v if k in sum_keys else v / self.world_size for k, v in zip(keys, t.tolist(), strict=True)}

    def gather_objects(self, obj) -> list:
        """Every rank's `obj`, in rank order (on every rank)."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def params_identical(self, model: torch.nn.Module) -> bool:
        """Whether every rank holds bit-identical parameters (a digest of their bytes)."""
        digest = hashlib.sha256()
        for p in model.parameters():
            digest.update(p.detach().cpu().contiguous().numpy().tobytes())
        if self.world_size == 1:
            return True
        digests = [None] * self.world_size
        dist.all_gather_object(digests, digest.hexdigest())
        return len(set(digests)) == 1


# what gloo and NCCL say when a peer process is gone (it crashed, or was stopped for failing)
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited",
)


def peer_failed(error: BaseException) -> str | None:
    """What broke, when `error` is a collective that failed because another rank is gone (that
    rank's own error is the one to read, not this one's traceback); None otherwise."""
    text = str(error)
    said = next((phrase for phrase in PEER_GONE if phrase in text), None)
    if isinstance(error, RuntimeError) and said:
        return said
    if dist.is_available() and isinstance(error, getattr(dist, "DistError", ())):
        return type(error).__name__
    return None


PEER_STOPPED = "stopped because another rank failed"  # how a rank says the failure is another's


def stopped_by_peer(broke: str) -> UserError:
    """The one line of a rank that stopped because a collective broke off (`broke`: what
    peer_failed said). Under torch's elastic launcher (trainer.devices, torchrun) it is also
    this rank's error file, which the launcher reads: it then names the rank that failed for
    its own reason, not this one (both may end in the same second)."""
    error = UserError(
        f"rank {os.environ.get('RANK', '?')}: {PEER_STOPPED} (a collective broke off: {broke}); that rank's own "
        "message and log say why"
    )
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(UserError):  # an unwritable file: the launcher then names ranks by exit time
            write_text(error_file, json.dumps({"message": str(error), "timestamp": int(time.time())}))
    return error


def shared_value(make):
    """`make()` on rank 0, the same value on every rank (for the run directory's name, which
    Hydra resolves in each process before the run starts)."""
    if world_size() == 1:
        return make()
    init_process_group()
    box = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wrap(model: torch.nn.Module, ranks: Dist, device: torch.device) -> torch.nn.Module:
    """DistributedDataParallel when there are several ranks; the model itself otherwise."""
    if ranks.world_size == 1:
        return model
    try:
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    except RuntimeError as e:  # DDP compares the parameters' shapes across the ranks first
        said = " ".join(str(e).split())
        if "appears not to match" not in said and "expects same model across all ranks" not in said:
            raise
        raise UserError(
            f"rank {ranks.rank}: its model differs from rank 0's ({said[:300]}); every rank must build the same "
            "model: give each the same model=... overrides"
        ) from None


@contextlib.contextmanager
def alone(model: torch.nn.Module, ranks: Dist):
    """For the block, every SyncBatchNorm layer of `model` synchronises within a group of
    this rank only (so it computes plain BatchNorm): the batch-size search's trials differ
    between ranks (sizes, out-of-memory retries), and collectives among them would wait for
    each other forever. Every rank must enter it (making the groups is collective)."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    if (
        ranks.world_size == 1 or not layers or not dist.is_initialized()
    ):  # the same model on every rank: all skip together
        yield
        return
    groups = [dist.new_group([r]) for r in range(ranks.world_size)]  # new_group is collective: each rank makes all
    before = [m.process_group for m in layers]
    for m in layers:
        m.process_group = groups[ranks.rank]
    try:
        yield
    finally:
        for m, group in zip(layers, before, strict=True):
            m.process_group = group


def no_sync(model: torch.nn.Module):
    """DDP's no_sync() (accumulate locally, no gradient all-reduce), or nothing."""
    inner = getattr(model, "_orig_mod", model)  # under torch.compile
    return inner.no_sync() if isinstance(inner, torch.nn.parallel.DistributedDataParallel) else contextlib.nullcontext()
