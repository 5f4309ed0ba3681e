"""trainer.profile=true: a torch.profiler trace of a few steady-state steps, as a callback.

The first `wait` steps (compilation, worker start-up, caches) are not recorded, then one
warm-up step, then `steps` recorded ones. The trace goes to <run dir>/profile/ as a Chrome
trace (open it in https://ui.perfetto.dev or chrome://tracing), and the operators that took
the most self time are printed and written to profile/top_ops.txt.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, schedule

log = logging.getLogger(__name__)


class Profiler:
    def __init__(self, wait: int = 5, steps: int = 5, top: int = 15):
        self.wait, self.steps, self.top = wait, steps, top
        self.profiler: profile | None = None
        self.done, self.directory = False, Path()  # the directory: set when the run starts

    def on_run_start(self, run) -> None:
        cuda = next(run.model.parameters()).device.type == "cuda"
        self.sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        self.directory = run.run_dir / "profile"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.profiler = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=1, active=self.steps, repeat=1),
            on_trace_ready=self._ready,
            record_shapes=True,
        )
        self.profiler.start()

    def _ready(self, prof) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"trace_step{prof.step_num}.json"
        prof.export_chrome_trace(str(path))
        table = prof.key_averages().table(sort_by=self.sort, row_limit=self.top)
        (self.directory / "top_ops.txt").write_text(table)
        log.info(
            "profile: trace of the steady-state steps in %s (open in https://ui.perfetto.dev); top operators by "
            "self time:\n%s",
            path,
            table,
        )
        self.done = True

    def on_train_batch_end(self, run, loss) -> None:
        if not self.done and self.profiler is not None:
            self.profiler.step()

    def on_run_end(self, run, metrics) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
