"""The datasets built in a forked process while train.py imports torch and the rest.

A run's start-up imports torch, torch._dynamo and torchmetrics (1.5-2.5 s of one core) and only
then builds its data (the data node's `_target_`: reading, decoding, splitting; mixup's digits
1.3 s, scikit-learn's import among it). On a machine with two cores or more, train.py forks a
child before those imports (`start`); the child builds the data as the run would (the same
config, intra-op threads, seeds and deterministic switch), and the run takes it when it reaches
the data (`take`, from compose.build) instead of building it again: the build's time overlaps
the imports.

What the run gets is what building it in the run's own process gives, the random streams
included:
- the data comes back through `torch.multiprocessing`'s pickler: tensors and NumPy arrays of 1 MiB
  or more in shared memory, the rest by value (smaller tensors as copies of their elements);
- the child sends Python's, NumPy's and torch's CPU generator states from before and after the
  build; the run takes the data only if its own generators stand where the child's started, and
  then leaves them where the child's ended (a builder that draws a random split moves them);
- the run's intra-op threads and deterministic switch must match those the child built under.

Anything else and the run builds the data itself, as without a child, saying why when the reason
is not the build's own error (which its own build then raises as before): a dataset that does
not pickle (a lambda, an open file), one that holds a memory-mapped array, more than 64 MiB by
value, over 256 tensors of 1 MiB or more (each is a file descriptor passed over a socket),
more shared memory than a quarter of what is free, a builder that touched CUDA, changed torch's
default dtype or threads. What is not carried back: what the builder changed outside
what it returned (a module-level variable it sets, a registry it fills). `loader.build_ahead=false`
builds in the run's process; so does every run that is not train.py's single, first, one-process
run on Linux (a multirun, tune, torchrun's ranks, saturate.fit).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

log = logging.getLogger("saturate")

BY_VALUE_LIMIT = 64 * 2**20  # bytes of the pickle itself (what is not in shared memory)
SHARED_MIN = 2**20  # tensors (their storage) and NumPy arrays this large: in shared memory; smaller: by value
SHARED_SHARE = 0.25  # of the memory free when the child sends: the most its shared memory may take
MAX_PIECES = 256  # shared tensors: each is one file descriptor passed over a socket


@dataclass
class Built:
    """What the child sends back: the node it built, the data, and the state around the build."""

    node: Any
    data: Any
    seconds: float
    threads: int
    deterministic: bool
    before: tuple  # (Python's, NumPy's, torch's CPU) generator states when the build began
    after: tuple  # ... and when it ended


@dataclass
class Declined:
    why: str
    build_error: bool = False  # the build itself raised: the run's own build says so


class _Pending:
    def __init__(self, process, results, done):
        self.process, self.results, self.done = process, results, done

    def receive(self) -> Built | Declined:
        try:
            return ForkingPickler.loads(self.results.recv_bytes())
        except EOFError:
            return Declined(f"the process building it ended without sending it (exit code {self.process.exitcode})")
        except Exception as e:  # a class that does not unpickle here
            return Declined(f"its data did not unpickle here ({type(e).__name__}: {e})")

    def close(self) -> None:
        """Let the child go (it waits until the data's shared memory is taken), and reap it."""
        for conn in (self.done, self.results):
            conn.close()
        self.process.join(timeout=5)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()


_pending: _Pending | None = None


def wanted(cfg) -> bool:
    """Whether train.py's run forks a child for its data: loader.build_ahead on, a single run
    without tune in one process, torch not imported yet (nothing to overlap otherwise), Linux
    (fork), two cores or more, and no thread besides this one (forking a process with threads
    can deadlock the child)."""
    devices = cfg.trainer.devices
    return (
        bool(cfg.loader.build_ahead)
        and not cfg.tune.enabled
        and (devices == "auto" or devices == 1)
        and "LOCAL_RANK" not in os.environ
        and "torch" not in sys.modules
        and sys.platform == "linux"
        and len(os.sched_getaffinity(0)) >= 2
        and threading.active_count() == 1
    )


def start(cfg) -> None:
    """Fork the child that builds `cfg`'s data (the config already checked without its targets)."""
    global _pending
    context = multiprocessing.get_context("fork")
    results, results_end = context.Pipe(duplex=False)
    done_end, done = context.Pipe(duplex=False)
    process = context.Process(
        target=_child, args=(cfg, results_end, done_end, (results, done)), name="saturate-data", daemon=False
    )
    process.start()
    results_end.close()
    done_end.close()
    _pending = _Pending(process, results, done)


def take(node) -> Built | None:
    """What was built ahead for `node` (its `data`, a Data; `seconds`, the child's build), with
    the global generators left where building it here would have left them; None when there is
    none to take (then build it here)."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return None
    waited = time.perf_counter()
    try:
        built = pending.receive()
    finally:
        pending.close()
    waited = time.perf_counter() - waited
    if isinstance(built, Built):
        why = _mismatch(built, node)
        built = Declined(why) if why else built
    if isinstance(built, Declined):
        level = logging.DEBUG if built.build_error else logging.INFO
        log.log(level, "data: built here, not ahead in a forked process: %s (loader.build_ahead)", built.why)
        return None
    _set_states(built.after)
    log.info(
        "data: built in a forked process while the imports ran (%.2f s there; %.2f s waited here)",
        built.seconds,
        waited,
    )
    return built


def discard() -> None:
    """Stop a child whose data no run took (the run failed first, or went elsewhere: tune, torchrun)."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None:
        pending.process.kill()
        pending.close()


def _mismatch(built: Built, node) -> str | None:
    """Why data built as `built` is not what building `node` here now would give, or None."""
    import torch

    if built.node != node:
        return "the data node differs from the one it was built from"
    if built.threads != torch.get_num_threads():
        return f"it was built with {built.threads} intra-op threads, the run has {torch.get_num_threads()}"
    if built.deterministic != torch.are_deterministic_algorithms_enabled():
        return "the deterministic switch differs"
    if not _same_states(built.before, _states()):
        return "the random generators stand elsewhere than where its build began"
    return None


def _states() -> tuple:
    import random

    import numpy as np
    import torch

    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _same_states(a: tuple, b: tuple) -> bool:
    import numpy as np
    import torch

    pairs = zip(a[1], b[1], strict=True)  # NumPy's: (name, key array, position, has_gauss, cached_gaussian)
    numpy_same = all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in pairs)
    return a[0] == b[0] and numpy_same and torch.equal(a[2], b[2])


def _set_states(states: tuple) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


# -- in the child ---------------------------------------------------------------------------------


def _child(cfg, results, done, parents: tuple) -> None:
    """Build, send, and wait until the run has taken the shared memory (or gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to answer; it stops this child
    for conn in parents:
        conn.close()
    try:
        payload = _pickled(_build(cfg))
    except BaseException as e:  # the build's own error: the run's own build raises it again
        payload = _pickled(Declined(f"{type(e).__name__}: {e}", build_error=True))
    try:
        results.send_bytes(payload)
        done.recv_bytes()  # EOF when the run has what it needs (or is gone)
    except (EOFError, OSError):
        pass


def _build(cfg) -> Built | Declined:
    import torch

    from saturate.started import resume_collector

    resume_collector(freeze=True)  # paused over the imports, as in the run (saturate.started)
    from saturate.config.schema import validate
    from saturate.data.policy import PRESETS
    from saturate.data.source import build_datasets
    from saturate.parts.device import keep_host_memory, seed_all, set_threads

    run = validate(cfg, presets=tuple(PRESETS), targets=False)
    logging.getLogger("saturate").setLevel(run.trainer.log_level)
    if run.device.keep_host_memory:
        keep_host_memory()
    set_threads(run.device.threads)
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    seed_all(run.trainer.seed)  # as compose.run's `seeded` does (its switches' reset imports torch._inductor: 1 s)
    if run.trainer.deterministic:
        torch.use_deterministic_algorithms(True)
    before, started = _states(), time.perf_counter()
    data = build_datasets(run.data)
    seconds, after = time.perf_counter() - started, _states()
    if torch.cuda.is_initialized():
        return Declined("its build used CUDA")
    if (torch.get_num_threads(), torch.get_default_dtype()) != (threads, dtype):
        return Declined("its build changed torch's intra-op threads or default dtype")
    return Built(run.data, data, seconds, threads, run.trainer.deterministic, before, after)


class _TooMuch(Exception):
    pass


def _pickled(obj) -> bytes:
    """`obj` through torch.multiprocessing's pickler, its large arrays in shared memory; a
    Declined saying why when it does not pickle or is too large."""
    import io

    import psutil
    import torch.multiprocessing  # noqa: F401  (registers the tensors' shared-memory reductions)

    class Capped(io.BytesIO):
        def write(self, b) -> int:  # bytes, or a PickleBuffer (protocol 5: an array's data)
            if self.tell() + memoryview(b).nbytes > BY_VALUE_LIMIT:
                raise _TooMuch(f"more than {BY_VALUE_LIMIT >> 20} MiB to send by value")
            return super().write(b)

    if isinstance(obj, Declined):
        return pickle.dumps(obj)
    limit = int(psutil.virtual_memory().available * SHARED_SHARE)
    buffer = Capped()
    try:
        _Pickler(buffer, limit).dump(obj)
    except Exception as e:
        why = str(e) if isinstance(e, _TooMuch) else f"it does not pickle ({type(e).__name__}: {e})"
        return pickle.dumps(Declined(why))
    return buffer.getvalue()


def _small_tensor(array):
    """A tensor under SHARED_MIN sent by value, as its NumPy array (a copy of its elements)."""
    import torch

    return torch.from_numpy(array)


def _shared_array(tensor):
    """A NumPy array sent as the tensor holding it: a view of the shared memory."""
    return tensor.numpy()


class _Pickler(ForkingPickler):
    """ForkingPickler (with torch's reductions) that counts the shared memory it sends, sends
    large NumPy arrays as tensors, and refuses memory-mapped arrays."""

    def __init__(self, file, limit: int, pieces: int = MAX_PIECES):
        super().__init__(file, 5)  # ForkingPickler takes Pickler's arguments by position
        self.limit, self.pieces, self.shared, self.storages = limit, pieces, 0, set()

    def reducer_override(self, obj):
        import numpy as np
        import torch

        if isinstance(obj, np.memmap):
            raise _TooMuch("it holds a memory-mapped array (mapped in the run's process instead)")
        if type(obj) is np.ndarray and obj.nbytes >= SHARED_MIN and obj.dtype.kind in "biufc":
            with contextlib.suppress(TypeError, ValueError), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only array: the run's copy is writable
                return _shared_array, (torch.from_numpy(np.ascontiguousarray(obj)),)  # (a dtype torch lacks: by value)
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
            small = obj.untyped_storage().nbytes() < SHARED_MIN
            if small and type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad:
                with contextlib.suppress(TypeError, RuntimeError):  # a dtype NumPy lacks (bfloat16): shared
                    return _small_tensor, (obj.numpy(),)
            storage = obj.untyped_storage()
            if storage.data_ptr() not in self.storages:
                self.storages.add(storage.data_ptr())
                self.shared += storage.nbytes()
                if self.shared > self.limit or len(self.storages) > self.pieces:
                    raise _TooMuch(
                        f"over {self.pieces} tensors of 1 MiB or more, or {self.limit >> 20} MiB of shared memory (a "
                        "quarter of the free)"
                    )
        return NotImplemented
