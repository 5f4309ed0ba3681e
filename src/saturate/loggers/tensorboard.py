"""TensorBoard event files in the run dir itself: every metric as a scalar, texts (the report,
the config), image grids, the Custom Scalars overview, and the run's HParams session: one run
in TensorBoard's run list per run dir, named by the run dir's path below the logdir (a sweep's
jobs, under `--logdir <sweep dir>`: `0_batch_size-32+channels_last-True`). Runs written before
this layout hold their events in `<run dir>/tb`: resumed, they go on writing there (one run).

HParams: no run writes an experiment summary. TensorBoard then builds the table's columns
from every run's own values (the union of keys, each marked as differing when its values
do), so a sweep's keys show whichever run it reads first; with an experiment summary it
took the first one found, and a plain run read first hid every swept key. The session sits
in the run's own event files (a sub-run of its own made every run appear twice, and drew
the final values as extra points on the loss charts). TensorBoard offers every scalar of a
session's run as a metric column, sorted by name, and shows the first five: the compared
metrics' final values are written once more as `compare/<metric>` (one point each, at the
last step), which sorts before `cpu/` and `memory/`, so the table opens on them."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from saturate import names


def after_earlier_files(logdir: Path) -> None:
    """Return once a new event file in `logdir` is named after every earlier one. TensorBoard
    reads a folder's event files in name order; a name starts with the second it was made in,
    then the host, the process and a per-process counter that is not zero-padded (writer 10
    sorts before writer 9). A resumed attempt whose file was made in the same second as the
    earlier attempt's could be read first, and the earlier steps it drops (purge_step) read
    after it: the resumed curve would end at the earlier attempt's last step. So a resume
    within the same second waits for the next one (at most a second; a clock that went
    back is not waited for)."""
    stamps = [p.name.split(".")[3] for p in logdir.glob("events.out.tfevents.*")]
    latest = max((int(s) for s in stamps if s.isdigit()), default=None)
    if latest is not None and 0 <= latest + 1 - time.time() <= 1:
        time.sleep(latest + 1 - time.time())


class TensorBoardLogger:
    """A run resumed at step N first drops the events an earlier attempt wrote after N
    (TensorBoard's purge_step), so its curves do not fork. (Runs written before this layout
    started no session, so TensorBoard does not drop theirs.)"""

    # in metrics.json, not plotted: the step is every chart's x axis and the wall time its
    # "Relative" axis; the main process's CPU in % of one core (over 100 with threads) is
    # cpu/run_util's share of the machine, restated
    HIDDEN = frozenset({names.STEP, names.WALL_S, names.PROCESS_UTIL})

    EARLIER = "tb"  # where runs written before this layout hold their events

    def __init__(self):
        self.writer: Any = None  # a SummaryWriter while the run lasts

    def on_run_start(self, run) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported here: slow, and rank 0 only

        earlier = run.run_dir / self.EARLIER
        logdir = earlier if any(earlier.glob("events.out.tfevents.*")) else run.run_dir
        # every attempt starts a session (SessionLog.START): TensorBoard takes the first one it reads as the
        # run's start and each later one as a restart, dropping what came at or after its step
        after_earlier_files(logdir)
        self.writer = SummaryWriter(str(logdir), purge_step=run.start_step + 1 if run.start_step else 0)

    def on_log(self, run, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            if tag not in self.HIDDEN:
                self.writer.add_scalar(tag, value, step)

    def on_text(self, run, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def on_images(self, run, tag: str, images, step: int) -> None:
        self.writer.add_images(tag, images, step)

    def on_layout(self, run, charts: dict[str, list[str]]) -> None:
        """The Custom Scalars tab: one chart per entry, each plotting the exact tags listed."""
        exact = {title: ["Multiline", [f"^{re.escape(tag)}$" for tag in tags]] for title, tags in charts.items()}
        self.writer.add_custom_scalars({"saturate": exact})

    COMPARE = "compare/"  # the HParams table's metric columns (see above)

    def on_hparams(self, run, params: dict[str, Any], metrics: dict[str, float], varied: list[str]) -> None:
        """This run's session (its values of `params`) and the final values of `metrics`, in its
        own event files at its last step; TensorBoard computes the columns and what differs itself."""
        from torch.utils.tensorboard.summary import hparams

        _, session_start, session_end = hparams(params, metrics)  # the experiment summary is left out (see above)
        for summary in (session_start, session_end):
            self.writer.file_writer.add_summary(summary, run.step)
        for tag, value in metrics.items():
            self.writer.add_scalar(self.COMPARE + tag, value, run.step)
        self.writer.flush()

    def on_run_end(self, run, metrics: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
