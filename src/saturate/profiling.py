"""trainer.profile=true: a torch.profiler trace of a few steady-state steps.

The first `wait` steps (compilation, worker start-up, caches) are not recorded, then one
warm-up step, then `steps` recorded ones. The trace goes to <run dir>/profile/ as a Chrome
trace (open it in https://ui.perfetto.dev or chrome://tracing), and the operators that took
the most self time are printed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

log = logging.getLogger(__name__)


class NoProfiler:
    def step(self) -> None:
        pass

    def close(self) -> None:
        pass


class StepProfiler:
    def __init__(self, directory: Path, device: torch.device, *, wait: int, steps: int, top: int = 15):
        self.directory, self.top = directory, top
        self.sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler = profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=1, active=steps, repeat=1),
            on_trace_ready=self._ready,
            record_shapes=True,
        )
        self.profiler.start()
        self.done = False

    def _ready(self, prof) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"trace_step{prof.step_num}.json"
        prof.export_chrome_trace(str(path))
        table = prof.key_averages().table(sort_by=self.sort, row_limit=self.top)
        (self.directory / "top_ops.txt").write_text(table)
        log.info(
            "profile: trace of the steady-state steps in %s (open in https://ui.perfetto.dev); top operators by self time:\n%s", path, table
        )
        self.done = True

    def step(self) -> None:
        if not self.done:
            self.profiler.step()

    def close(self) -> None:
        self.profiler.stop()
