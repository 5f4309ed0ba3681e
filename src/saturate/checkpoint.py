"""Checkpoints: one `torch.save` dict per file, written atomically, and resuming from them.

A file is written to a hidden temporary name, flushed and fsynced, then renamed over the old
one (and the directory fsynced), so a crash or kill during a save leaves the previous
checkpoint intact, and no partial file ever has a name that is picked up. `last.pt` is
rewritten at every save; `best.pt` when the monitored metric improves; with top_k > 1 the
k best are also kept as `top-<epoch>-<step>.pt`.
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from saturate.config import CheckpointConfig
from saturate.errors import CheckpointError

log = logging.getLogger(__name__)

SLOW_SAVE_S = 25.0  # torchrun kills its workers 30 s after forwarding SIGTERM


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind `e`, if any: torch.save reports a failed write (a full disk) as a
    RuntimeError raised while it cleans up after the OSError."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        cause = _os_error(e)
        if cause is None:
            raise
        # a full disk, a quota, a vanished mount: the user's to fix
        raise CheckpointError(f"cannot write checkpoint {path}: {cause.strerror or cause}; the previous one is intact") from None
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load(path: Path) -> dict[str, Any]:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"trainer.resume: no checkpoint at {path}") from None
    except Exception as e:
        raise CheckpointError(f"trainer.resume: cannot read {path} as a checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "step" not in ckpt:
        raise CheckpointError(f"trainer.resume: {path} is not a saturate checkpoint (no model and step in it)")
    return ckpt


def newest(directory: Path) -> Path | None:
    """The complete checkpoint with the most steps in `directory` (None if there is none).
    Files that do not load are passed over with a warning."""
    best: tuple[int, Path] | None = None
    for path in sorted(directory.glob("*.pt")):
        try:
            step = load(path)["step"]
        except CheckpointError as e:
            log.warning("passing over %s: %s", path, e)
            continue
        if best is None or step > best[0] or (step == best[0] and path.name == "last.pt"):
            best = (step, path)
    return best[1] if best else None


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix[:-1]: d}
    return {k: v for key, value in d.items() for k, v in _flat(value, f"{prefix}{key}.").items()}


class Checkpointer:
    def __init__(self, directory: Path, cfg: CheckpointConfig, *, interval: int, parts: dict[str, Any], config: dict,
                 fingerprint: dict, enabled: bool = True):  # fmt: skip
        self.directory, self.cfg, self.interval, self.parts = directory, cfg, interval, parts
        self.config, self.fingerprint, self.enabled = config, fingerprint, enabled
        self.best: float | None = None
        self.top: list[tuple[float, str]] = []  # (metric, file name) of the kept top-k files
        self.last_path = directory / "last.pt"
        if enabled:
            directory.mkdir(parents=True, exist_ok=True)

    def due(self, epoch: int, last: bool) -> bool:
        """After every `interval`-th epoch and the last one."""
        return last or epoch % self.interval == 0

    def due_step(self, step: int) -> bool:
        return self.cfg.every_n_steps > 0 and step % self.cfg.every_n_steps == 0

    def _better(self, value: float, than: float | None) -> bool:
        return than is None or (value > than if self.cfg.mode == "max" else value < than)

    def state_dict(self, state: Any) -> dict[str, Any]:
        """`state`: where the run is (its epoch, step and batch_in_epoch attributes)."""
        return {
            **{name: part.state_dict() for name, part in self.parts.items()},
            "epoch": state.epoch,
            "step": state.step,
            "batch_in_epoch": state.batch_in_epoch,  # with the epoch's seeded order: the next sample
            "best": self.best,
            "top": self.top,
            "rng": rng_state(),
            "config": self.config,
            "fingerprint": self.fingerprint,
        }

    def save(self, state: Any, metrics: dict[str, float]) -> float:
        """Save last.pt (and best.pt / a top-k file when `metrics` improve on them); return
        the seconds it took."""
        if not self.enabled:
            return 0.0
        start = time.perf_counter()
        value = metrics.get(self.cfg.monitor)
        improved = value is not None and self._better(value, self.best)
        if improved:
            self.best = value
        ranked = value is not None and self.cfg.top_k > 1 and (len(self.top) < self.cfg.top_k or self._better(value, self.top[-1][0]))
        checkpoint = self.state_dict(state)
        atomic_save(checkpoint, self.last_path)
        if improved:
            atomic_save(checkpoint, self.directory / "best.pt")
        if ranked:
            self._keep_top(checkpoint, value, f"top-{state.epoch:03d}-{state.step:07d}.pt")
        seconds = time.perf_counter() - start
        if seconds > SLOW_SAVE_S:
            log.warning(
                "checkpoint at step %d took %.1fs (> %.0fs): a preempted run may be killed before it finishes",
                state.step,
                seconds,
                SLOW_SAVE_S,
            )
        return seconds

    def _keep_top(self, checkpoint: dict, value: float, name: str) -> None:
        atomic_save(checkpoint, self.directory / name)
        self.top.append((value, name))
        self.top.sort(key=lambda t: t[0], reverse=self.cfg.mode == "max")
        for _, dropped in self.top[self.cfg.top_k :]:
            (self.directory / dropped).unlink(missing_ok=True)
        del self.top[self.cfg.top_k :]

    def resume(self, spec: str | None) -> dict[str, int]:
        """Restore from `spec` ("auto": the newest complete checkpoint here, else a fresh
        start; a .pt file; or a run dir) and return where to continue: {epoch, step,
        batch_in_epoch} (all 0 for a fresh start)."""
        fresh = {"epoch": 0, "step": 0, "batch_in_epoch": 0}
        if not spec:
            return fresh
        path = Path(spec).expanduser()
        if spec == "auto":
            path = newest(self.directory)
            if path is None:
                log.info("trainer.resume=auto: no checkpoint in %s; starting fresh", self.directory)
                return fresh
        elif path.is_dir():
            found = newest(path / "checkpoints") if (path / "checkpoints").is_dir() else newest(path)
            if found is None:
                raise CheckpointError(f"trainer.resume={spec!r}: no checkpoint in {path}")
            path = found
        ckpt = load(path)
        self._warn_changes(ckpt.get("config", {}))
        for name, part in self.parts.items():
            try:
                part.load_state_dict(ckpt[name])
            except (RuntimeError, ValueError, KeyError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CheckpointError(f"trainer.resume: {path} does not fit this run's {name}: {first}") from None
        set_rng_state(ckpt["rng"])
        self.best, self.top = ckpt.get("best"), [tuple(t) for t in ckpt.get("top", [])]
        state = {key: ckpt[key] for key in fresh}
        log.info("resumed from %s: epoch %d, step %d, batch %d of the epoch", path, state["epoch"], state["step"], state["batch_in_epoch"])
        return state

    def _warn_changes(self, saved: dict) -> None:
        ignore = ("run_dir", "trainer.resume", "trainer.progress", "trainer.log_level")
        before, now = _flat(saved), _flat(self.config)
        changed = [
            f"{k}: {before.get(k)!r} -> {now.get(k)!r}"
            for k in sorted(set(before) | set(now))
            if before.get(k) != now.get(k) and not k.startswith(ignore)
        ]
        if changed:
            log.warning("resuming with changed settings (the run will not equal an uninterrupted one): %s", "; ".join(changed))
