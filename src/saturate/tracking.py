"""Where metrics go: TensorBoard scalars and text, the progress bar, metrics.json.

Tags are the contract names (`train/loss`, `val/acc`, `perf/samples_per_s`, ...), the same in
TensorBoard and in metrics.json. Only rank 0 writes; other ranks get a tracker that drops
everything, so callers never ask which rank they are on.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from tqdm import tqdm

log = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    """A value TensorBoard's hparams plugin accepts (bool, number or string)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class Tracker:
    def __init__(self, run_dir: Path, *, log_interval: int, progress: bool, enabled: bool = True):
        self.run_dir, self.log_interval, self.enabled = run_dir, log_interval, enabled
        self.writer = None  # opened by start(), which knows whether the run resumes
        # disable=None: tqdm turns itself off when stderr is not a terminal (logs, CI)
        self.bar = tqdm(unit="step", dynamic_ncols=True, disable=None if enabled and progress else True)
        self.latest: dict[str, float] = {}

    def start(self, total_steps: int, done: int = 0) -> None:
        """Open the event file; a run resumed at step `done` first drops any events that an
        earlier attempt wrote after that step (TensorBoard's purge_step)."""
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter  # imported here: slow, and rank 0 only

            self.writer = SummaryWriter(str(self.run_dir / "tb"), purge_step=done + 1 if done else None)
        self.bar.reset(total=total_steps)
        self.bar.update(done)

    def due(self, step: int) -> bool:
        return step % self.log_interval == 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.latest.update(metrics)
        if self.writer is None:
            return
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def progress(self, step: int, epoch: int) -> None:
        """Advance the bar to `step` and show the latest loss and throughput."""
        self.bar.update(step - self.bar.n)
        shown = {"epoch": epoch}
        for tag, fmt in (("train/loss", "{:.4f}"), ("val/acc", "{:.4f}"), ("perf/samples_per_s", "{:.0f}")):
            if tag in self.latest:
                shown[tag.split("/")[1]] = fmt.format(self.latest[tag])
        self.bar.set_postfix(shown, refresh=False)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def images(self, tag: str, images, step: int) -> None:
        """A grid of images (N, C, H, W) in [0, 1]."""
        if self.writer is not None:
            self.writer.add_images(tag, images.detach().float().cpu(), step)

    def hparams(self, params: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        """One HParams entry for this run: `params` as columns, `metrics` (logged as scalars
        under the same tags at the final step) as the compared values."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        finite = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        experiment, session_start, session_end = hparams({k: _plain(v) for k, v in params.items()}, finite)
        for summary in (experiment, session_start, session_end):
            self.writer.file_writer.add_summary(summary)
        self.log(finite, step)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically: a reader sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
