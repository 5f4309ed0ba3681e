"""Checkpoints: one `torch.save` dict per file, written atomically, and resuming from them.

A file is written to a hidden temporary name, flushed and fsynced, then renamed over the old
one (and the directory fsynced), so a crash or kill during a save leaves the previous
checkpoint intact, and no partial file ever has a name that is picked up. `last.pt` is
rewritten at every save; `best.pt` when the monitored metric improves; with top_k > 1 the
k best are also kept as `top-<epoch>-<step>.pt`.

The saves during training (`checkpoint.background`, on by default) are written by a thread
beside it, as Lightning's AsyncCheckpointIO and torch.distributed.checkpoint's async_save do:
the loop waits only while the state is copied to the host, one save is in flight at a time,
and its files are on disk before the next save, the end of the loop, a stop or an
`on_checkpoint` hook (which reads them). A save that fails in the thread (a full disk) fails
the run at the next save or the end of the loop, with the same message; a stop's own save
logs it and still saves.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import pickle
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from saturate.config.invocation import is_setting_key
from saturate.config.schema import CheckpointConfig
from saturate.errors import CheckpointError, is_number
from saturate.parts.rundir import OWN_NAMES
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


def snapshot(obj: Any) -> Any:
    """A copy of a checkpoint that training can no longer change: every tensor copied to the
    host (on the CPU: cloned), the containers rebuilt, anything else deep-copied."""
    from torch.utils._pytree import tree_map

    copied = lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else copy.deepcopy(x)
    return tree_map(copied, obj)


def write_files(checkpoint: dict, paths: list[Path], removed: list[Path]) -> None:
    """`paths` written, each atomically, then `removed` deleted: a top-k file that drops out
    leaves only once the file that replaces it is whole."""
    for path in paths:
        _atomic_save(checkpoint, path)
    for path in removed:
        path.unlink(missing_ok=True)


class Writer:
    """Checkpoint files written by a thread, one save at a time: `submit` waits for the save
    before it, `wait` for the one in flight and raises its error, if it failed; `done` is
    called once a save's files are all written."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, checkpoint: dict, paths: list[Path], removed: list[Path], done: Callable[[], None]) -> None:
        self.wait()
        job = (checkpoint, paths, removed, done)
        self.thread = threading.Thread(target=self._write, args=job, name="saturate-checkpoint")
        self.thread.start()

    def _write(self, checkpoint: dict, paths: list[Path], removed: list[Path], done: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            write_files(checkpoint, paths, removed)
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


def load(path: Path, what: str = "trainer.resume") -> dict[str, Any]:
    """A checkpoint, read with `torch.load(weights_only=True)`: tensors, numbers, strings and
    containers only (`what`: the key or command
    reading it, for the messages). A file that would need anything else (arbitrary unpickling, which can
    run code) is refused, never loaded."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{what}: no checkpoint at {path}") from None
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
    except Exception as e:  # noqa: BLE001 (any failure to read it: not a checkpoint)
        raise CheckpointError(f"{what}: cannot read {path} as a checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "step" not in ckpt:
        raise CheckpointError(f"{what}: {path} is not a saturate checkpoint (no model and step in it)")
    return ckpt


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


def _gist(error: BaseException) -> str:
    """An exception's message on one line (load_state_dict puts the facts after line 1)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines) or type(error).__name__
    return text if len(text) <= 400 else text[:400] + " ..."


def _configured(stateful: dict[str, Any]) -> dict | None:
    """The optimizer's hyperparameters per group (lr apart) and the schedule's base LRs, as
    the config builds them."""
    optimizer, scheduler = stateful.get("optimizer"), stateful.get("scheduler")
    if optimizer is None or scheduler is None:
        return None
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in optimizer.param_groups]
    return {"groups": copy.deepcopy(groups), "base_lrs": list(scheduler.base_lrs)}


def _apply_hyperparameters(optimizer, scheduler, now: dict, then: dict | None, lr_scale: float) -> list[str]:
    """After the saved optimizer and schedule are loaded: put back what this run's config
    changed since the checkpoint's (`then`: its configured hyperparameters; a checkpoint
    written before they were saved: every configured value that differs from the saved
    state) -- a changed lr, momentum, weight decay -- and restart the schedule from the new
    base at the saved step. What a scheduler moves itself (OneCycleLR's momentum, a plateau
    rule's LR) stays as saved. Returns what changed, in words."""
    changed = []
    for i, (group, wanted) in enumerate(zip(optimizer.param_groups, now["groups"], strict=True)):
        before = then["groups"][i] if then and i < len(then["groups"]) else None
        for key, value in wanted.items():
            moved = group.get(key) != value if before is None else before.get(key) != value
            if moved:
                changed.append(f"group {i} {key} {group.get(key)!r} -> {value!r}")
                group[key] = value
    base_lrs = [lr * lr_scale for lr in now["base_lrs"]]  # the config's, as the callbacks had scaled them
    saved = then["base_lrs"] if then else scheduler.base_lrs
    if list(saved) != (base_lrs if then is None else list(now["base_lrs"])):
        pairs = enumerate(zip(scheduler.base_lrs, base_lrs, strict=True))
        changed += [f"group {i} lr {old!r} -> {new!r}" for i, (old, new) in pairs if old != new]
        scheduler.rebase(base_lrs)
    return changed


def _lr_scale(value, path) -> float:
    if not is_number(value, 0, math.inf, open_low=True, open_high=True):
        raise CheckpointError(f"trainer.resume: {path}: lr_scale {value!r} is not a number > 0; the file is damaged")
    return float(value)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}{key}.").items()}


@dataclass
class Resumed:
    """Where a resumed run continues (all zero for a fresh start), and what it had."""

    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    lr_scale: float = 1.0  # the callbacks' scaling of the configured learning rate (Run.lr_scale)
    metrics: dict[str, float] = field(default_factory=dict)  # saved with the checkpoint


class Checkpointer:
    """Saves and restores a run. `model`: the trained module; `stateful`: the optimizer,
    schedule, scaler, observers and the training order, each with state_dict() and
    load_state_dict(). Each save is given where the loop is (`position`: epoch, step,
    batch_in_epoch) and the run's state (`run`: its `eval_model`, the module evaluated and
    saved as the run's weights, and its `lr_scale`): when a callback keeps an average as
    eval_model, the checkpoint holds both, `model` the weights that scored and `train_model`
    the ones training continues from."""

    def __init__(
        self,
        directory: Path,
        cfg: CheckpointConfig,
        *,
        interval: int,
        model,
        stateful: dict[str, Any],
        config: dict,
        fingerprint: dict,
        enabled: bool = True,
    ):
        self.directory, self.cfg, self.interval, self.stateful = directory, cfg, interval, stateful
        self.model, self.config, self.fingerprint, self.enabled = model, config, fingerprint, enabled
        self.pending: dict[str, Any] = {}  # restored once the observers have started (restore_run)
        self.best: float | None = None
        self.best_at: tuple[int, int] | None = None  # (epoch, step) of the best value
        self.saved_step: int | None = None  # of the last checkpoint written (finite weights)
        self.top: list[tuple[float, str]] = []  # (metric, file name) of the kept top-k files
        self.last_path = directory / "last.pt"
        self.writer = Writer()
        # the hyperparameters this run's config gives, before any step (a scheduler may move some,
        # e.g. OneCycleLR's momentum): saved, so that a resume applies only what the config changed
        self.configured = _configured(stateful)
        if enabled:
            directory.mkdir(parents=True, exist_ok=True)

    def due(self, epoch: int, last: bool) -> bool:
        """After every `interval`-th epoch and the last one."""
        return last or epoch % self.interval == 0

    def due_step(self, step: int) -> bool:
        return self.cfg.every_n_steps > 0 and step % self.cfg.every_n_steps == 0

    def _better(self, value: float, than: float | None) -> bool:
        return than is None or (value > than if self.cfg.mode == "max" else value < than)

    def last_good(self) -> str:
        """Where the last checkpoint with finite weights is, in words (a save in flight waited
        for: its step once its files are written)."""
        self.close()
        if self.saved_step is None:
            return f"not saved yet (no checkpoint of this run has finite weights in {self.directory})"
        return f"{self.last_path} (step {self.saved_step})"

    def state_dict(self, position: Any, metrics: dict[str, float] | None = None, run: Any = None) -> dict[str, Any]:
        """The checkpoint of the run at `position` (its epoch, step and batch_in_epoch)."""
        evaluated = run.eval_model if run is not None else self.model
        weights = {"model": evaluated.state_dict()}
        if evaluated is not self.model:
            weights["train_model"] = self.model.state_dict()
        return {
            "metrics": {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float))},
            **weights,
            **{name: part.state_dict() for name, part in self.stateful.items()},
            "epoch": position.epoch,
            "step": position.step,
            "batch_in_epoch": position.batch_in_epoch,  # with the epoch's seeded order: the next sample
            "best": self.best,
            "top": self.top,
            "lr_scale": float(run.lr_scale) if run is not None else 1.0,
            "rng": rng_state(),
            "optimizer_class": type(self.stateful["optimizer"]).__name__ if "optimizer" in self.stateful else None,
            "configured": self.configured,
            "config": self.config,
            "fingerprint": self.fingerprint,
        }

    def save(self, state: Any, metrics: dict[str, float], run: Any = None, *, background: bool = False) -> float:
        """Save last.pt (and best.pt / a top-k file when `metrics` improve on them); return
        the seconds the caller waited. Stop signals wait for what the caller waits for (the
        state gathered and, in the loop, the files written). `background` (with
        checkpoint.background): the files are written by a thread from a copy of the state;
        `flush` waits for them. A save in the loop (a stop's, a failure's) first waits for the
        one in flight, whose failure is then logged, not raised: the stop's own save goes on."""
        if not self.enabled:
            return 0.0
        with signals_held():
            return self._save(state, metrics, run, background and self.cfg.background)

    def flush(self) -> None:
        """Wait until the save in flight is on disk; a failed one raises its error here."""
        self.writer.wait()

    def close(self) -> None:
        """Wait for the save in flight as the run ends on an error: its own failure is
        logged, not raised over the run's."""
        try:
            self.writer.wait()
        except Exception as e:  # noqa: BLE001 (the run's own error is the one raised)
            log.error("%s", e)

    def _save(self, state: Any, metrics: dict[str, float], run: Any, background: bool) -> float:
        start = time.perf_counter()
        if background:  # the save before this one is on disk: its failure is this run's
            self.flush()
        else:  # a stop's or a failure's save: an earlier write's failure is logged, this save still made
            self.close()
        checkpoint = self.state_dict(state, metrics, run)
        bad = non_finite(checkpoint["model"]) + non_finite(checkpoint.get("train_model", {}))
        if bad:  # never write a state that cannot be trained on: the previous file stays the last good one
            log.error(
                "step %d: not saving a checkpoint: %d tensor(s) of the model hold NaN or inf (%s); the last good "
                "state is %s",
                state.step,
                len(bad),
                ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else ""),
                self.last_good(),
            )
            return 0.0
        value = metrics.get(self.cfg.monitor)
        if value is not None and not math.isfinite(value):
            log.warning(
                "checkpoint.monitor: %s is %s at step %d; no best.pt from this evaluation",
                self.cfg.monitor,
                value,
                state.step,
            )
        value = value if value is not None and math.isfinite(value) else None  # a NaN is never "better"
        improved = value is not None and self._better(value, self.best)
        if improved:
            self.best, self.best_at = value, (state.epoch, state.step)
            checkpoint["best"], checkpoint["best_at"] = value, list(self.best_at)
        ranked = (
            value is not None
            and self.cfg.top_k > 1
            and (len(self.top) < self.cfg.top_k or self._better(value, self.top[-1][0]))
        )
        paths = [self.last_path] + ([self.directory / "best.pt"] if improved else [])
        top = f"top-{state.epoch:03d}-{state.step:07d}.pt" if ranked else None
        removed = self._keep_top(value, top) if top and value is not None else []
        paths += [self.directory / top] if top else []
        written = lambda step=state.step: setattr(self, "saved_step", step)
        if background:
            self.writer.submit(snapshot(checkpoint), paths, removed, written)
        else:
            write_files(checkpoint, paths, removed)
            written()
        seconds = time.perf_counter() - start
        if seconds > SLOW_SAVE_S:
            log.warning(
                "checkpoint at step %d took %.1fs (> %.0fs): a preempted run may be killed before it finishes",
                state.step,
                seconds,
                SLOW_SAVE_S,
            )
        return seconds

    def _keep_top(self, value: float, name: str) -> list[Path]:
        """`name` (about to be written) among the k best; the files that drop out, for the
        writer to remove once it is whole."""
        self.top.append((value, name))
        self.top.sort(key=lambda t: t[0], reverse=self.cfg.mode == "max")
        dropped = [self.directory / n for _, n in self.top[self.cfg.top_k :] if n != name]
        del self.top[self.cfg.top_k :]
        return dropped

    def resume(self, spec: str | None) -> Resumed:
        """Restore from `spec` ("auto": the newest complete checkpoint here, else a fresh
        start; a .pt file; or a run dir) and return where to continue."""
        path = self._find(spec)
        if path is None:
            return Resumed()
        ckpt = load(path)
        optimizer, scheduler = self.stateful["optimizer"], self.stateful["scheduler"]
        saved_kind, kind = ckpt.get("optimizer_class"), type(optimizer).__name__
        if saved_kind is not None and saved_kind != kind:
            raise CheckpointError(
                f"trainer.resume: {path} was trained with {saved_kind}, this run's optimizer is {kind}: its state "
                "(momentum, step counts) cannot carry over; resume with the same optim"
            )
        lr_scale = _lr_scale(ckpt.get("lr_scale", 1.0), path)
        restore = {"model": (self.model, ckpt.get("train_model", ckpt["model"]))}
        entries = {"order": {}, **ckpt}  # a checkpoint from before loader.order: no order drawn
        restore.update({name: (part, entries[name]) for name, part in self.stateful.items() if name != "observers"})
        for name, (part, saved) in restore.items():
            try:
                part.load_state_dict(saved)
            except (RuntimeError, ValueError, KeyError) as e:
                raise CheckpointError(f"trainer.resume: {path} does not fit this run's {name}: {_gist(e)}") from None
        self.pending = {
            "path": path,
            "eval": ckpt["model"] if "train_model" in ckpt else None,
            "observers": ckpt.get("observers", {}),
        }
        assert self.configured is not None, "resume: an optimizer and a schedule are given"
        applied = _apply_hyperparameters(optimizer, scheduler, self.configured, ckpt.get("configured"), lr_scale)
        self._warn_changes(ckpt.get("config", {}), ckpt["step"], applied)
        set_rng_state(ckpt["rng"])
        self.best, self.top = ckpt.get("best"), [tuple(t) for t in ckpt.get("top", [])]
        self.best_at = tuple(ckpt["best_at"]) if ckpt.get("best_at") else None
        self.saved_step = ckpt["step"]
        resumed = Resumed(ckpt["epoch"], ckpt["step"], ckpt["batch_in_epoch"], lr_scale, ckpt.get("metrics", {}))
        log.info(
            "resumed from %s: epoch %d, step %d, batch %d of the epoch",
            path,
            resumed.epoch,
            resumed.step,
            resumed.batch_in_epoch,
        )
        return resumed

    def _find(self, spec: str | None) -> Path | None:
        """The checkpoint `spec` names (None: start fresh)."""
        if not spec:
            return None
        path = Path(spec).expanduser()
        if spec == "auto":
            found = newest(self.directory)
            if found is None:
                log.info("trainer.resume=auto: no checkpoint in %s; starting fresh", self.directory)
            return found
        if path.is_dir():
            found = newest(path / "checkpoints") if (path / "checkpoints").is_dir() else newest(path)
            if found is None:
                raise CheckpointError(f"trainer.resume={spec!r}: no checkpoint in {path}")
            return found
        return path

    def restore_run(self, run: Any) -> None:
        """After the observers started (a weight average exists now): the evaluated weights
        (into `run.eval_model`) and the observers' states of the checkpoint resumed from."""
        if not self.pending:
            return
        evaluated, path = run.eval_model, self.pending["path"]
        try:
            # an average: its own weights, or the trained ones when the checkpoint had none
            if evaluated is not self.model:
                saved = self.pending["eval"]
                evaluated.load_state_dict(saved if saved is not None else self.model.state_dict())
            if "observers" in self.stateful:
                self.stateful["observers"].load_state_dict(self.pending["observers"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"trainer.resume: {path} does not fit this run's callbacks: {_gist(e)}") from None
        self.pending = {}

    def _warn_changes(self, saved: dict, step: int, applied: list[str]) -> None:
        """Every setting that differs from the checkpoint's takes effect from `step` on (the
        run is built from this config); say which, and what became of the optimizer."""
        before, now = _flat(saved), _flat(self.config)
        changed = [
            f"{k}: {before.get(k)!r} -> {now.get(k)!r}"
            for k in sorted(set(before) | set(now))
            if before.get(k) != now.get(k) and is_setting_key(k)
        ]
        if changed:
            optimizer = (
                f"; optimizer and schedule rebuilt from the new values ({', '.join(applied)})" if applied else ""
            )
            log.warning(
                "resuming with changed settings, applied from step %d (the run will not equal an uninterrupted "
                "one): %s%s",
                step,
                "; ".join(changed),
                optimizer,
            )
