"""The datasets built in a forked process while train.py imports torch and the rest.

A run's start-up imports torch, torch._dynamo and torchmetrics (1.5-2.5 s of one core) and only
then builds its data (the data node's `_target_`: reading, decoding, splitting; mixup's digits
0.7-1.3 s, scikit-learn's import among it). On a machine with two cores or more, train.py forks
a child before those imports (`start`); the child builds the data as the run would (the same
config, intra-op threads, seeds and deterministic switch, every module the data node names
imported before the seeding, as the run's config check imports them), and the run takes it
when it reaches the data (`Ahead.take`, handed down to compose.build) instead of building it
again: the build's time overlaps the imports.

What the run gets is what building it in the run's own process gives, the random streams
included:
- the data comes back through `torch.multiprocessing`'s pickler: tensors and NumPy arrays of 1 MiB
  or more in shared memory, smaller ones by value; either way with their strides, offsets, and the
  memory views of one array or storage share (a view and its base stay one buffer), and an
  array's read-only flag;
- the child sends Python's, NumPy's and torch's CPU generator states from before and after the
  build; the run takes the data only if its own generators stand where the child's started, and
  then leaves them where the child's ended (a builder that draws a random split moves them; one
  that calls torch.manual_seed reseeds the CUDA generators too, as it would have);
- the run's intra-op threads, default dtype, deterministic switch and float32 matmul precision
  must be those the child built under, and the build must not have changed them.

A mistake the builder reports (a saturate UserError) is raised in the run as its own build would
raise it, without a second build. Anything else and the run builds the data itself, as without a
child, saying why: a dataset that does not pickle (a lambda, an open file), a memory-mapped array
or tensor, more than 64 MiB by value, over 256 tensors of 1 MiB or more (each is a file descriptor
passed over a socket), more shared memory than a quarter of what is free (or than /dev/shm has),
a lazily conjugated tensor, a builder that used CUDA, left a process running, stopped on a prompt
for input, or raised an error of another kind (its traceback is then the run's own).
What is not carried back: what the builder changed outside what it returned (a module-level
variable, a registry, a CUDA seed set with torch.cuda.manual_seed alone), and whatever a class's
own pickling leaves out (a `__getstate__` that drops a cache). `loader.build_ahead=false` builds
in the run's process; so does every run that is not train.py's single, first, one-process run on
Linux (a multirun, tune, torchrun's ranks, saturate.fit).

The child has its own process group (a terminal's Ctrl-C is the run's to answer) and is killed
when the run's process dies. A run that ends before taking the data (a mistake found after the
fork, the run dir refused) prints its error, lets a build under way finish for up to 10 s, so
that a cache it writes is not cut short, then stops it and what it started; after Ctrl-C, at once.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

from saturate.errors import UserError

log = logging.getLogger("saturate")

BY_VALUE_LIMIT = 64 * 2**20  # bytes of the pickle itself (what is not in shared memory)
SHARED_MIN = 2**20  # tensors (their storage) and NumPy arrays this large: in shared memory; smaller: by value
SHARED_SHARE = 0.25  # of the memory free when the child sends: the most its shared memory may take
MAX_PIECES = 256  # shared tensors: each is one file descriptor passed over a socket
GRACE_S = 10.0  # a run that ends before taking the data lets a build under way finish this long


@dataclass
class Built:
    """What the child sends back: the node it built, the data, and the state around the build."""

    node: Any
    data: Any
    seconds: float
    switches: tuple  # (threads, default dtype, deterministic, float32 matmul precision) it built under
    before: tuple  # (Python's, NumPy's, torch's CPU) generator states when the build began
    after: tuple  # ... and when it ended
    reseeded: int | None = None  # the seed the builder gave torch.manual_seed (the CUDA generators follow it)


@dataclass
class Declined:
    why: str


@dataclass
class Failed:
    """The builder's own mistake (a UserError): the run raises it as its own build would have."""

    node: Any
    error: BaseException


class Ahead:
    """The child building a run's data (`start`): the run takes what it built (`take`), or
    lets it go (`discard`)."""

    def __init__(self, process, results, done):
        self.process, self.results, self.done = process, results, done

    def take(self, node) -> Built | None:
        """What was built for `node` (its `data`, a Data; `seconds`, the child's build), with the
        global generators left where building it here would have left them; None when it cannot
        be taken (then build it here: the log says why). Raises the builder's own mistake. Once;
        the child is stopped."""
        if self.process is None:
            return None
        waited = time.perf_counter()
        try:
            got = self._receive()
        finally:
            self._stop(grace=0, settle=1.0)  # what it sent (its shared memory too) is here
        waited = time.perf_counter() - waited
        if isinstance(got, (Built, Failed)) and got.node != node:
            got = Declined("the data node differs from the one it was built from")
        if isinstance(got, Failed):
            raise got.error
        why = _mismatch(got) if isinstance(got, Built) else None
        got = Declined(why) if why else got
        if isinstance(got, Declined):
            log.info("data: built here, not ahead in a forked process: %s (loader.build_ahead)", got.why)
            return None
        _carry_back(got)
        log.info(
            "data: built in a forked process while the imports ran (%.2f s there; %.2f s waited here)",
            got.seconds,
            waited,
        )
        return got

    def discard(self, *, interrupted: bool = False) -> None:
        """Stop a child whose data no run took (the run failed first, or tune or torchrun took
        over): after its build, for up to GRACE_S; `interrupted` (Ctrl-C), at once."""
        self._stop(grace=0, settle=0) if interrupted else self._stop(grace=GRACE_S, settle=1.0)

    def _receive(self) -> Built | Declined | Failed:
        ended = Declined("the process building it ended without sending it")
        while not self.results.poll(0.05):  # readable: what it sent, or the end of the pipe
            if not self.process.is_alive() and not self.results.poll(0):  # gone (its pipe held by what it started)
                return ended
            if _stopped(self.process.pid):  # a job-control stop: it would wait for ever
                return Declined("the process building it was stopped (it asked the terminal for input)")
        try:
            return ForkingPickler.loads(self.results.recv_bytes())
        except (EOFError, OSError):  # killed (out of memory) before it had sent it all
            return ended
        except Exception as e:  # a class that does not unpickle here
            return Declined(f"its data did not unpickle here ({type(e).__name__}: {e})")

    def _stop(self, grace: float, settle: float) -> None:
        """Stop the child and whatever it started (its process group), after up to `grace` s for
        a build under way (the child sends once the build is done) and `settle` s for it to end
        as a process does (its temporary files removed), and reap it."""
        process, self.process = self.process, None
        if process is None:
            return
        try:
            if grace > 0 and process.is_alive() and not self.results.poll(0):
                print(
                    f"waiting up to {grace:.0f} s for the data's build in the forked process to finish (a file it "
                    "writes stays whole); Ctrl-C stops it at once",
                    file=sys.stderr,
                    flush=True,
                )
                with contextlib.suppress(OSError, EOFError):
                    self.results.poll(grace)
            self.done.close()  # the child's cue to end as a process does (its temporary files removed)
            process.join(timeout=settle)
        finally:  # Ctrl-C while waiting too
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)  # it, and what it started
            process.kill()
            process.join()
            self.results.close()


def _stopped(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


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


def start(cfg) -> Ahead | None:
    """Fork the child that builds `cfg`'s data (the config already checked without its
    targets); None when the system refuses a process or a pipe (the run builds its data)."""
    context, pipes = multiprocessing.get_context("fork"), []
    try:
        pipes += context.Pipe(duplex=False)  # (the reading end, the writing end): the run reads what the child sends
        pipes += context.Pipe(duplex=False)  # the child reads, the run closes its end when it has taken the data
        results, results_end, done_end, done = pipes
        process = context.Process(
            target=_child, args=(cfg, os.getpid(), results_end, done_end, (results, done)), name="saturate-data"
        )
        process.start()
    except OSError as e:  # EAGAIN, ENOMEM, EMFILE
        for conn in pipes:
            conn.close()
        log.info("data: built here, not ahead in a forked process: %s (loader.build_ahead)", e)
        return None
    with contextlib.suppress(OSError):  # its own group (the child sets it too: whichever comes first)
        os.setpgid(process.pid, process.pid)
    results_end.close()
    done_end.close()
    return Ahead(process, results, done)


def _mismatch(built: Built) -> str | None:
    """Why data built as `built` is not what building it here now would give, or None."""
    if built.switches != _switches():
        return "torch's threads, default dtype, deterministic switch or matmul precision differ from the child's"
    if not _same_states(built.before, _states()):
        return "the random generators stand elsewhere than where its build began"
    return None


def _carry_back(built: Built) -> None:
    """The generators where the child's build left them (a torch.manual_seed in it reseeds the
    CUDA generators as well, as the same call here would)."""
    import torch

    if built.reseeded is not None:
        torch.manual_seed(built.reseeded)
    _set_states(built.after)


def _switches() -> tuple:
    import torch

    return (
        torch.get_num_threads(),
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_float32_matmul_precision(),
    )


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


def _child(cfg, parent: int, results, done, parents: tuple) -> None:
    """Build, send, and wait until the run has taken the shared memory (or gone)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # its own group: the terminal's Ctrl-C is the run's to answer; stopped with what it starts
    for number in (signal.SIGTTIN, signal.SIGTTOU):  # a prompt for input fails (then the run builds and asks)
        signal.signal(number, signal.SIG_IGN)  # instead of stopping a process in the background
    _die_with(parent)
    for conn in parents:
        conn.close()
    try:
        from saturate.config.schema import validate  # no torch
        from saturate.data.policy import PRESETS

        run = validate(cfg, presets=tuple(PRESETS), targets=False)  # as the run had it checked before the fork
        try:
            payload = _pickled(_build(run))
        except UserError as e:  # the builder's mistake, answered by the run in one line
            payload = _pickled(Failed(run.data, _portable(e)))
    except BaseException as e:  # a bug: the run builds again, and its traceback is the run's own
        payload = pickle.dumps(Declined(f"its build raised {type(e).__name__}: {e}"))
    try:
        results.send_bytes(payload)
        done.recv_bytes()  # EOF when the run has what it needs (or is gone)
    except (EOFError, OSError):
        pass


def _left_running() -> bool:
    """Whether the build left a process of its own running (the resource sharer is a thread)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        return any(p.status() != psutil.STATUS_ZOMBIE for p in psutil.Process().children(recursive=True))
    return False


def _portable(error: UserError) -> UserError:
    """`error`, or a UserError with its message when its class does not unpickle (a constructor
    that takes other arguments than its message)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return UserError(str(error))
    return error


def _die_with(parent: int) -> None:
    """SIGKILL when the run's process dies (Linux's PR_SET_PDEATHSIG), however it dies."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that
        os._exit(1)


def _build(run) -> Built | Declined:
    import torch
    from hydra._internal.utils import _locate

    from saturate.started import resume_collector

    resume_collector(freeze=True)  # paused over the imports, as in the run (saturate.started)
    from saturate.data.source import build_datasets
    from saturate.parts.device import keep_host_memory, seed_all, set_threads

    for target in _targets(run.data):  # the run's config check imports them (hydra's get_method) before it seeds
        with contextlib.suppress(Exception):  # a mistake is the build's to report (get_method would log it too)
            _locate(target)
    logging.getLogger("saturate").setLevel(run.trainer.log_level)
    if run.device.keep_host_memory:
        keep_host_memory()
    set_threads(run.device.threads)
    if run.device.type != "cpu" and torch.cuda.is_available():  # as setup_device on a CUDA run (no CUDA context)
        torch.backends.cuda.matmul.allow_tf32 = run.device.tf32  # float32 matmul precision "high"
    seed_all(run.trainer.seed)  # as compose.run's `seeded` does (its switches' reset imports torch._inductor: 1 s)
    if run.trainer.deterministic:
        torch.use_deterministic_algorithms(True)
    switches, before, seed, started = _switches(), _states(), torch.initial_seed(), time.perf_counter()
    data = build_datasets(run.data)
    seconds, after = time.perf_counter() - started, _states()
    if torch.cuda.is_initialized():
        return Declined("its build used CUDA")
    if _left_running():
        return Declined("its build left processes running (its data may need them: a Manager's server)")
    if _switches() != switches:
        return Declined("its build changed torch's threads, default dtype, deterministic switch or matmul precision")
    reseeded = torch.initial_seed() if torch.initial_seed() != seed else None
    return Built(run.data, data, seconds, switches, before, after, reseeded)


def _targets(node) -> list[str]:
    """Every `_target_` in a node, its own first, then those of its arguments, as the config check finds them."""
    if isinstance(node, dict):
        own = [node["_target_"]] if isinstance(node.get("_target_"), str) else []
        return own + [t for key, value in node.items() if key != "_target_" for t in _targets(value)]
    return [t for value in node for t in _targets(value)] if isinstance(node, list) else []


class _TooMuch(Exception):
    pass


def _pickled(obj) -> bytes:
    """`obj` through torch.multiprocessing's pickler (_Pickler); a Declined saying why when it
    does not pickle or is too large."""
    import io

    import psutil
    import torch.multiprocessing  # noqa: F401  (registers the tensors' shared-memory reductions)

    class Capped(io.BytesIO):
        def write(self, b) -> int:  # bytes, or a PickleBuffer (protocol 5: an array's data)
            if self.tell() + memoryview(b).nbytes > BY_VALUE_LIMIT:
                raise _TooMuch(f"more than {BY_VALUE_LIMIT >> 20} MiB to send by value")
            return super().write(b)

    limit = int(psutil.virtual_memory().available * SHARED_SHARE)
    with contextlib.suppress(OSError):
        limit = min(limit, int(shutil.disk_usage("/dev/shm").free * 0.9))
    buffer = Capped()
    try:
        _Pickler(buffer, limit).dump(obj)
    except Exception as e:
        why = str(e) if isinstance(e, _TooMuch) else f"it could not be sent ({type(e).__name__}: {e})"
        return pickle.dumps(Declined(why))
    return buffer.getvalue()


class _Pickler(ForkingPickler):
    """ForkingPickler (with torch's reductions: tensors in shared memory) that sends tensors under
    SHARED_MIN by value and NumPy arrays of SHARED_MIN or more through shared memory, each with
    its layout, and the buffers views share once; counts the shared memory; refuses what maps a
    file."""

    def __init__(self, file, limit: int, pieces: int = MAX_PIECES):
        super().__init__(file, 5)  # ForkingPickler takes Pickler's arguments by position
        self.limit, self.pieces, self.shared, self.storages = limit, pieces, 0, set()
        self.bytes_of: dict[int, Any] = {}  # a small storage's bytes, one object each: pickle's memo sends it once

    def reducer_override(self, obj):
        import numpy as np
        import torch

        if isinstance(obj, np.ndarray):
            return self._array(obj)
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.device.type == "cpu":
            return self._tensor(obj)
        return NotImplemented

    def _array(self, array):
        import mmap

        import numpy as np
        import torch

        owner = array
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        if isinstance(owner, np.memmap) or isinstance(owner.base, mmap.mmap):
            raise _TooMuch("it holds a memory-mapped array (mapped in the run's process instead)")
        if array.dtype.hasobject or type(array) is not np.ndarray:
            return NotImplemented  # by value, as pickle does
        if array is not owner:  # a view: its owner once, then its offset, shape and strides over it
            if type(owner) is not np.ndarray or not (owner.flags.c_contiguous or owner.flags.f_contiguous):
                raise _TooMuch("it holds a view of a buffer NumPy does not own (its layout would change)")
            offset = array.__array_interface__["data"][0] - owner.__array_interface__["data"][0]
            return _array_view, (owner, offset, array.shape, array.strides, array.dtype, array.flags.writeable)
        if not (array.flags.c_contiguous or array.flags.f_contiguous):
            raise _TooMuch("it holds a strided array over a foreign buffer (its layout would change)")
        if array.nbytes < SHARED_MIN:
            return NotImplemented  # by value: NumPy's pickle keeps C or Fortran order and the read-only flag
        fortran = not array.flags.c_contiguous
        with contextlib.suppress(TypeError, ValueError), warnings.catch_warnings():  # a dtype torch lacks: by value
            warnings.simplefilter("ignore")  # a read-only array (its flag is sent along)
            tensor = torch.from_numpy(array.T if fortran else array)
            return _shared_array, (tensor, fortran, array.flags.writeable)
        return NotImplemented

    def _tensor(self, tensor):
        import torch

        storage = tensor.untyped_storage()
        if getattr(storage, "filename", None):
            raise _TooMuch("it holds a tensor mapped from a file (mapped in the run's process instead)")
        if tensor.is_conj() or tensor.is_neg():  # torch's sharing drops the bit
            raise _TooMuch("it holds a lazily conjugated or negated tensor (resolve_conj() or resolve_neg() it)")
        plain = type(tensor) is torch.Tensor and not tensor.requires_grad
        if plain and storage.nbytes() < SHARED_MIN:  # by value, its storage once
            key = storage.data_ptr(), storage.nbytes()
            if key not in self.bytes_of:
                self.bytes_of[key] = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
            shape, stride = tuple(tensor.shape), tensor.stride()
            return _small_tensor, (self.bytes_of[key], str(tensor.dtype), tensor.storage_offset(), shape, stride)
        if storage.data_ptr() not in self.storages:  # torch's own reduction: shared memory
            self.storages.add(storage.data_ptr())
            self.shared += storage.nbytes()
            if self.shared > self.limit or len(self.storages) > self.pieces:
                raise _TooMuch(
                    f"over {self.pieces} tensors of 1 MiB or more, or {self.limit >> 20} MiB of shared memory (a "
                    "quarter of the free)"
                )
        return NotImplemented


def _small_tensor(data, dtype: str, offset: int, shape: tuple, stride: tuple):
    """A tensor sent by value: its storage's bytes (one array for every tensor of that storage,
    so views stay views), its dtype, offset, shape and strides."""
    import torch

    storage = torch.from_numpy(data).untyped_storage()
    return torch.empty(0, dtype=getattr(torch, dtype.removeprefix("torch."))).set_(storage, offset, shape, stride)


def _shared_array(tensor, fortran: bool, writeable: bool):
    """A NumPy array sent as the tensor holding it: a view of the shared memory, in its order."""
    array = tensor.numpy()
    array = array.T if fortran else array
    if not writeable:
        array.flags.writeable = False
    return array


def _array_view(owner, offset: int, shape: tuple, strides: tuple, dtype, writeable: bool):
    """A view of `owner` (sent once for all its views) at `offset` bytes with its shape and strides."""
    import numpy as np

    flat = owner.ravel(order="K").view(np.uint8)  # C or Fortran contiguous: a view, not a copy
    view = np.ndarray(shape, dtype, buffer=flat, offset=offset, strides=strides)
    if not writeable:
        view.flags.writeable = False
    return view
