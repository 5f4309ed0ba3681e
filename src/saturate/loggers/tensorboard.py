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
import threading
import time
from pathlib import Path
from typing import Any

from saturate import names
from saturate.errors import UserError, printable

EVENTS = "events.out.tfevents."  # an event file's name: this, then <second>.<host>.<process>.<writer count>


def read_before_now(logdir: Path) -> None:
    """Rename the event files in `logdir` that a file made now might not sort after, so that
    TensorBoard, which reads a folder's event files in name order, reads a resumed attempt's
    file after every earlier one. A name starts with the second it was made in: an earlier
    attempt's file from the same second could sort after the new one (what follows is the
    host, the process and a writer count that is not zero-padded), and one made on a host
    whose clock ran ahead sorts after it for as long as that clock was ahead; read last, the
    steps the resumed attempt drops (purge_step) would be drawn again. Such files get the
    second before the next file's (their order kept, the rest of each name as it was); the
    events inside keep their own times."""
    found = sorted((p for p in logdir.glob(EVENTS + "*") if p.is_file()), key=lambda p: p.name)
    limit = int(time.time())  # the new file's second (in the same second, the rest of two names may sort either way)
    for path in reversed(found):
        stamp, _, rest = path.name[len(EVENTS) :].partition(".")
        if stamp.isdigit() and int(stamp) < limit:
            return  # it sorts before what follows it, and so does every file before it
        limit -= 1
        target = path.with_name(f"{EVENTS}{limit:010d}.{rest}")
        if not target.exists():
            path.rename(target)


class TensorBoardLogger:
    """A run resumed at step N first drops the events an earlier attempt wrote after N
    (TensorBoard's purge_step), so its curves do not fork. (Runs written before this layout
    started no session, so TensorBoard does not drop theirs.)

    Its events are written by the SummaryWriter's own thread, which opens the file by name at
    every write. A write that fails there (the run dir deleted, the disk full) ends that thread
    and is raised again by the writer's next call in the run's thread: it is answered there, in
    one line, and Python's report of the thread's exception (a traceback) is left out."""

    # in metrics.json, not plotted: the step is every chart's x axis and the wall time its
    # "Relative" axis; the main process's CPU in % of one core (over 100 with threads) is
    # cpu/run_util's share of the machine, restated
    HIDDEN = frozenset({names.STEP, names.WALL_S, names.PROCESS_UTIL})

    EARLIER = "tb"  # where runs written before this layout hold their events

    def __init__(self):
        self.writer: Any = None  # a SummaryWriter while the run lasts
        self.threads: list[threading.Thread] = []  # the writer's own
        self.previous_hook: Any = None  # threading.excepthook before this run's

    def on_run_start(self, run) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported here: slow, and rank 0 only

        earlier = run.run_dir / self.EARLIER
        logdir = earlier if any(earlier.glob("events.out.tfevents.*")) else run.run_dir
        # every attempt starts a session (SessionLog.START): TensorBoard takes the first one it reads as the
        # run's start and each later one as a restart, dropping what came at or after its step
        read_before_now(logdir)
        before = set(threading.enumerate())
        self.writer = SummaryWriter(str(logdir), purge_step=run.start_step + 1 if run.start_step else 0)
        self.threads = [t for t in threading.enumerate() if t not in before]
        self.previous_hook, threading.excepthook = threading.excepthook, self._thread_failed

    def _thread_failed(self, args) -> None:
        """threading.excepthook while the run lasts: a write the writer's thread failed is said by
        the run's thread (see above); anything else as before."""
        if args.thread in self.threads and issubclass(args.exc_type, OSError):
            return
        self.previous_hook(args)

    def _failed(self, run, error: OSError) -> UserError:
        """The run's one line for a write that failed; the writer is dropped (nothing more is written)."""
        writer, self.writer = self.writer, None
        try:
            writer.close()
        except OSError:
            pass  # the same failure again
        self._release()
        gone = "; the run dir is gone" if not run.run_dir.exists() else ""
        where = printable(str(writer.get_logdir()))
        return UserError(f"tensorboard: cannot write its events in {where} ({error.strerror or error}){gone}")

    def _release(self) -> None:
        if threading.excepthook == self._thread_failed:
            threading.excepthook = self.previous_hook

    def on_log(self, run, metrics: dict[str, float], step: int) -> None:
        """The step's scalars as one event, as tf.summary's merged summaries are written, through
        the writer's own FileWriter: add_scalar writes an event per scalar, some 35 us each to
        build, serialise and queue (15 scalars: 0.55 ms a log step against 0.09 ms). Each is
        read back as its own curve, as add_scalar's are (simple_value)."""
        if self.writer is None:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary  # what torch's SummaryWriter writes

        values = [Summary.Value(tag=t, simple_value=float(v)) for t, v in metrics.items() if t not in self.HIDDEN]
        if not values:
            return
        try:
            self.writer.file_writer.add_summary(Summary(value=values), step)
        except OSError as e:
            raise self._failed(run, e) from None

    def _write(self, run, method: str, *args) -> None:
        if self.writer is None:
            return
        try:
            getattr(self.writer, method)(*args)
        except OSError as e:
            raise self._failed(run, e) from None

    def on_text(self, run, tag: str, text: str, step: int) -> None:
        self._write(run, "add_text", tag, text, step)

    def on_images(self, run, tag: str, images, step: int) -> None:
        self._write(run, "add_images", tag, images, step)

    def on_layout(self, run, charts: dict[str, list[str]]) -> None:
        """The Custom Scalars tab: one chart per entry, each plotting the exact tags listed."""
        exact = {title: ["Multiline", [f"^{re.escape(tag)}$" for tag in tags]] for title, tags in charts.items()}
        self._write(run, "add_custom_scalars", {"saturate": exact})

    COMPARE = "compare/"  # the HParams table's metric columns (see above)

    def on_hparams(self, run, params: dict[str, Any], metrics: dict[str, float], varied: list[str]) -> None:
        """This run's session (its values of `params`) and the final values of `metrics`, in its
        own event files at its last step; TensorBoard computes the columns and what differs itself."""
        from torch.utils.tensorboard.summary import hparams

        if self.writer is None:
            return
        _, session_start, session_end = hparams(params, metrics)  # the experiment summary is left out (see above)
        try:
            for summary in (session_start, session_end):
                self.writer.file_writer.add_summary(summary, run.step)
            for tag, value in metrics.items():
                self.writer.add_scalar(self.COMPARE + tag, value, run.step)
            self.writer.flush()
        except OSError as e:
            raise self._failed(run, e) from None

    def on_run_end(self, run, metrics: dict[str, Any]) -> None:
        if self.writer is None:
            return
        try:
            self.writer.close()
        except OSError as e:
            raise self._failed(run, e) from None
        self.writer = None
        self._release()
