"""Where metrics go: the loggers (TensorBoard by default, metrics.csv, a user's own), the
progress bar, metrics.json.

Tags are the contract names (`train/loss`, `val/acc`, `perf/samples_per_s`, ...), the same in
every logger and in metrics.json. Only rank 0 writes; other ranks get a tracker that drops
everything, so callers never ask which rank they are on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

from tqdm import tqdm

from saturate.callbacks import TensorBoardLogger, builtin_logger

log = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    """A value TensorBoard's hparams plugin accepts (bool, number or string). Integers go as
    text: the HParams tab prints every number to five significant digits (128 as 128.00)."""
    if isinstance(value, (bool, float, str)):
        return value
    return str(value)


class Tracker:
    def __init__(self, run_dir: Path, *, log_interval: int, progress: bool, enabled: bool = True, loggers: list[Any] = ("tensorboard",),
                 shown: str = "val/acc"):  # fmt: skip
        self.run_dir, self.log_interval, self.enabled = run_dir, log_interval, enabled
        self.spec = list(loggers)  # names of built-in loggers, or logger objects
        self.loggers: list[Any] = []  # opened by start(), which knows whether the run resumes
        self.shown = shown  # the validation metric the progress bar shows
        # disable=None: tqdm turns itself off when stderr is not a terminal (logs, CI)
        self.bar = tqdm(unit="step", dynamic_ncols=True, disable=None if enabled and progress else True)
        self.latest: dict[str, float] = {}

    def start(self, total_steps: int, done: int = 0) -> None:
        """Open the loggers; a run resumed at step `done` first drops whatever an earlier
        attempt logged after that step."""
        if self.enabled:
            self.loggers = [builtin_logger(x, self.run_dir, done) if isinstance(x, str) else x for x in self.spec]
        self.bar.reset(total=total_steps)
        self.bar.update(done)

    def _each(self, method: str, *args) -> None:
        for logger in self.loggers:
            fn = getattr(logger, method, None)
            if callable(fn):
                fn(*args)

    def due(self, step: int) -> bool:
        return step % self.log_interval == 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.latest.update(metrics)
        self._each("log_metrics", metrics, step)

    def progress(self, step: int, epoch: int) -> None:
        """Advance the bar to `step` and show the latest loss and throughput."""
        self.bar.update(step - self.bar.n)
        shown = {"epoch": epoch}
        for tag, fmt in (("train/loss", "{:.4f}"), (self.shown, "{:.4f}"), ("perf/samples_per_s", "{:.0f}")):
            if tag in self.latest:
                shown[tag.split("/")[1]] = fmt.format(self.latest[tag])
        self.bar.set_postfix(shown, refresh=False)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self._each("log_text", tag, text, step)

    def layout(self, charts: dict[str, list[str]]) -> None:
        """The overview TensorBoard's Custom Scalars tab opens with: {chart title: tags}."""
        self._each("log_layout", charts)

    def images(self, tag: str, images, step: int) -> None:
        """A grid of images (N, C, H, W) in [0, 1]."""
        if self.loggers:
            self._each("log_images", tag, images.detach().float().cpu(), step)

    def hparams(self, params: dict[str, Any], metrics: dict[str, float], step: int, varied: Collection[str] = ()) -> None:
        """One HParams entry for this run: `params` as columns, `metrics` (logged as scalars
        under the same tags at the final step) as the compared values; TensorBoard lists the
        `varied` params (what a sweep varies) first and shows them by default."""
        finite = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        plain = {k: _plain(v) for k, v in params.items()}
        for logger in self.loggers:
            fn = getattr(logger, "log_hparams", None)
            if isinstance(logger, TensorBoardLogger):
                logger.log_hparams(plain, finite, varied=varied)
            elif callable(fn):
                fn(plain, finite)
        self.log(finite, step)

    def close(self) -> None:
        self.bar.close()
        self._each("close")
        self.loggers = []
