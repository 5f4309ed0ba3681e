"""A checkpoint's file: one `torch.save` dict, written atomically, read back as data.

A file is written to a hidden temporary name, flushed and fsynced, then renamed over the old
one (and the directory fsynced), so a crash or kill during a save leaves the previous
checkpoint intact, and no partial file ever has a name that is picked up. Reading is
weights-only (tensors and plain values): nothing read from disk can run code. The writer
thread (`Writer`) writes the saves made during training beside it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import pickle
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from saturate.checkpoint.rundir import OWN_NAMES
from saturate.errors import CheckpointError
from saturate.files import NotAFile, open_regular
from saturate.scale.ranks import STOP_SIGNALS

log = logging.getLogger(__name__)

SLOW_SAVE_S = 25.0  # torchrun kills its workers 30 s after forwarding SIGTERM


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind `e`, if any: torch.save reports a failed write (a full disk) as a
    RuntimeError raised while it cleans up after the OSError."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Stop signals that arrive meanwhile wait for the block to end, then reach their handlers
    in order: a second Ctrl-C (which interrupts at once) inside torch.save would leave a torn
    file and torch's writer failing on its own state; after the block it finds a whole one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum in held:  # the handler now in place: the first SIGINT may have installed the second's
            handler = signal.getsignal(signum)
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


def atomic_save(obj: Any, path: Path) -> None:
    """`obj` to `path` through a temporary file, fsync and a rename, with stop signals held
    until the rename is done."""
    with signals_held():
        _atomic_save(obj, path)


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        cause = _os_error(e)
        if cause is None:
            raise
        # a full disk, a quota, a vanished mount, a folder in its place: the user's to fix; the message names this file
        kept = (
            "a folder is in its place: move it away"
            if path.is_dir()
            else "the previous one is intact"
            if path.is_file()
            else "no earlier one was written"
        )
        raise CheckpointError(f"cannot write checkpoint {path}: {cause.strerror or cause}; {kept}") from None


def _immutable(x: Any) -> bool:
    """A tuple of plain values (Python's random state: 625 ints), kept whole: a pytree would
    copy it value by value (4 ms a save)."""
    return isinstance(x, tuple) and all(type(v) in (int, float, str, bool, type(None)) for v in x)


def snapshot(obj: Any) -> Any:
    """A copy of a checkpoint that training can no longer change: every tensor copied to the
    host (on the CPU: cloned), the containers rebuilt, anything else deep-copied (a tuple of
    plain values, which nothing can change, kept as it is)."""
    from torch.utils._pytree import tree_map

    def copied(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        return x if _immutable(x) else copy.deepcopy(x)

    return tree_map(copied, obj, is_leaf=_immutable)


Also = Sequence[tuple[dict, list[Path]]]  # other checkpoints of the same save, each with its files (a held best.pt)


def write_files(checkpoint: dict, paths: list[Path], removed: list[Path], also: Also = ()) -> None:
    """`paths` written, each atomically, then `also`'s, then `removed` deleted: a top-k file
    that drops out leaves only once the file that replaces it is whole."""
    written: list[str] = []
    for state, path in [(checkpoint, p) for p in paths] + [(other, p) for other, ps in also for p in ps]:
        try:
            _atomic_save(state, path)
        except CheckpointError as e:
            if written:  # the message says what of this step is on disk
                raise CheckpointError(f"{e}; {' and '.join(written)} of step {checkpoint['step']} written") from None
            raise
        written.append(path.name)
    for path in removed:
        path.unlink(missing_ok=True)


class Writer:
    """Checkpoint files written by a thread, one save at a time: `submit` waits for the save
    before it, `wait` for the one in flight and raises its error, if it failed; `done` is
    called once a save's files are all written."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(
        self, checkpoint: dict, paths: list[Path], removed: list[Path], done: Callable[[], None], also: Also = ()
    ) -> None:
        self.wait()
        job = (checkpoint, paths, removed, done, also)
        self.thread = threading.Thread(target=self._write, args=job, name="saturate-checkpoint")
        self.thread.start()

    def _write(
        self, checkpoint: dict, paths: list[Path], removed: list[Path], done: Callable[[], None], also: Also
    ) -> None:
        start = time.perf_counter()
        try:
            write_files(checkpoint, paths, removed, also)
        except BaseException as e:  # noqa: BLE001 (raised in the training thread, at its next wait)
            self.error = e
            return
        done()
        seconds = time.perf_counter() - start
        if seconds > SLOW_SAVE_S:
            log.warning(
                "checkpoint at step %d took %.1fs to write (> %.0fs): a preempted run may be killed before it finishes",
                checkpoint["step"],
                seconds,
                SLOW_SAVE_S,
            )

    def wait(self) -> None:
        if self.thread is not None:
            with signals_held():  # as in a save in the loop: a stop signal meanwhile waits for whole files
                self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain values (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = [kind, torch.from_numpy(np.array(keys)), pos, has_gauss, gauss]
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read(path: Path, what: str) -> Any:
    """What `path` holds, read with `torch.load(weights_only=True)`: tensors, numbers, strings
    and containers only (`what`: the key or command reading it, for the messages). The file
    is opened only when it is a regular file (a FIFO or a device is refused at once, never
    waited on); one that would need anything else (arbitrary unpickling, which can run code)
    is refused, never loaded. FileNotFoundError goes to the caller."""
    try:
        with open_regular(path, what) as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except (FileNotFoundError, NotAFile):
        raise
    except pickle.UnpicklingError as e:
        if "global" not in str(e).lower():  # not a refused object: a damaged or foreign file
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            cause = next(
                (lines[i + 1] for i, line in enumerate(lines[:-1]) if "Unpickler error" in line),
                lines[-1] if lines else "",
            )
            raise CheckpointError(
                f"{what}: cannot read {path} as a checkpoint (damaged or not a checkpoint: {cause})"
            ) from None
        first = next((line.strip() for line in str(e).splitlines() if "global" in line.lower()), "")
        raise UnsafeCheckpoint(
            f"{what}: refusing {path}: it holds objects that only arbitrary unpickling could load, which can "
            f"run code; saturate loads tensors and plain values only ({first})"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001 (any failure to read it: not a checkpoint)
        raise CheckpointError(f"{what}: cannot read {path} as a checkpoint ({type(e).__name__}: {e})") from None


def load(path: Path, what: str = "trainer.resume") -> dict[str, Any]:
    """A checkpoint of saturate's (`read`): a dict with a step and a `model` state dict
    ({name: tensor}); anything else is one CheckpointError naming `path`."""
    try:
        ckpt = read(path, what)
    except FileNotFoundError:
        raise CheckpointError(f"{what}: no checkpoint at {path}") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "step" not in ckpt:
        raise CheckpointError(f"{what}: {path} is not a saturate checkpoint (no model and step in it)")
    for entry in ("model", "train_model"):
        problem = weights_problem(ckpt[entry]) if entry in ckpt else None
        if problem:
            raise CheckpointError(f"{what}: {path} is not a saturate checkpoint (its {entry} {problem})")
    return ckpt


def weights_problem(state: Any) -> str | None:
    """What keeps `state` from being a state dict ({name: tensor}), in words; None when it is one."""
    if not isinstance(state, dict):
        return f"is a {type(state).__name__}, not a state dict {{name: tensor}}"
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            return f"holds a {type(value).__name__} at {name!r}, not a tensor"
    return None


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file holding objects that only arbitrary unpickling could load."""


def newest(directory: Path) -> Path | None:
    """saturate's own checkpoint (last.pt, best.pt, top-*.pt) with the most steps in
    `directory` (None if there is none); any other file there is never opened. Files that do
    not load are passed over with a warning."""
    best: tuple[int, Path] | None = None
    for path in sorted({p for pattern in OWN_NAMES for p in directory.glob(pattern)}):
        try:
            step = load(path)["step"]
        except UnsafeCheckpoint:
            raise  # someone put it there: say so, do not quietly resume from another file
        except CheckpointError as e:
            log.warning("passing over %s: %s", path, e)
            continue
        if best is None or step > best[0] or (step == best[0] and path.name == "last.pt"):
            best = (step, path)
    return best[1] if best else None


def non_finite(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors holding NaN or inf (one host read)."""
    names = [k for k, t in state_dict.items() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not names:
        return []
    finite = torch.stack([torch.isfinite(state_dict[k]).all() for k in names]).tolist()
    return [k for k, ok in zip(names, finite, strict=True) if not ok]


def gist(error: BaseException) -> str:
    """An exception's message on one line (load_state_dict puts the facts after line 1)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines) or type(error).__name__
    return text if len(text) <= 400 else text[:400] + " ..."
