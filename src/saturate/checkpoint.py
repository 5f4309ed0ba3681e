"""Checkpoints: one `torch.save` dict per file, written atomically.

`last.pt` is rewritten at every save; `best.pt` when the monitored metric improves. A file
is written to a temporary name, flushed and fsynced, then renamed over the old one, so a
crash during a save leaves the previous checkpoint intact and no partial file is read.
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

from saturate.engine import TrainState

log = logging.getLogger(__name__)


def atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
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


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


class Checkpointer:
    def __init__(
        self,
        directory: Path,
        *,
        interval: int,
        parts: dict[str, Any],
        config: dict,
        monitor: str = "val/acc",
        mode: str = "max",
        enabled: bool = True,
    ):
        self.directory, self.interval, self.parts, self.config = directory, interval, parts, config
        self.monitor, self.mode, self.enabled = monitor, mode, enabled
        self.best: float | None = None
        if enabled:
            directory.mkdir(parents=True, exist_ok=True)

    def due(self, epoch: int, last: bool) -> bool:
        return last or epoch % self.interval == 0

    def _improved(self, value: float | None) -> bool:
        if value is None:
            return False
        return self.best is None or (value > self.best if self.mode == "max" else value < self.best)

    def state_dict(self, state: TrainState) -> dict[str, Any]:
        return {
            **{name: part.state_dict() for name, part in self.parts.items()},
            "epoch": state.epoch,
            "step": state.step,
            "batch_in_epoch": state.batch_in_epoch,
            "best": self.best,
            "rng": rng_state(),
            "config": self.config,
        }

    def save(self, state: TrainState, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        start = time.perf_counter()
        value = metrics.get(self.monitor)
        improved = self._improved(value)
        if improved:
            self.best = value
        checkpoint = self.state_dict(state)
        atomic_save(checkpoint, self.directory / "last.pt")
        if improved:
            atomic_save(checkpoint, self.directory / "best.pt")
        log.debug("checkpoint at step %d saved in %.2fs%s", state.step, time.perf_counter() - start, " (best)" if improved else "")
