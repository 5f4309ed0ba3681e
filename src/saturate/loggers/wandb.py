"""Weights & Biases, offline by default (`logger=[tensorboard,wandb]`): nothing needs an account
or the network; the run is written under `<run dir>/wandb/offline-run-*` and uploaded later
with `wandb sync <run dir>/wandb/offline-run-*` (`logger.wandb.mode=online` sends it live).

The settings go in as the run's config (as TensorBoard's HParams session has them), metrics at
their steps, the verdict and status in the summary and as tags, report.md and the config as
files; a sweep's jobs share a group (the sweep dir's name). A resumed run continues the same
W&B run: its id is kept in `<run dir>/wandb/run_id` (offline, each attempt writes a directory
of its own with that id; `wandb sync` joins them). W&B's trouble (no account online, an
unwritable folder) is a warning, never a failed run. wandb is imported when a run starts.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from pathlib import Path
from typing import Any

from saturate import files, names
from saturate import record as run_record
from saturate.errors import ConfigError, Problem

log = logging.getLogger(__name__)

ID_FILE = "run_id"  # <run dir>/wandb/run_id
MODES = ("offline", "online", "disabled")


class WandbLogger:
    """`mode`: offline (default), online or disabled; `project`: default the Hydra job's name."""

    def __init__(self, mode: str = "offline", project: str | None = None, entity: str | None = None):
        problems = [Problem("logger.wandb.mode", mode, "offline, online or disabled")] if mode not in MODES else []
        problems += [
            Problem(f"logger.wandb.{key}", value, "null or a name")
            for key, value in (("project", project), ("entity", entity))
            if value is not None and not (isinstance(value, str) and value.strip())
        ]
        if problems:
            raise ConfigError(problems)
        self.mode, self.project, self.entity = mode, project, entity
        self.run: Any = None  # wandb's Run while the run lasts
        self.last_step = -1

    def on_run_start(self, run) -> None:
        folder = run.run_dir / "wandb"
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_DISABLE_GIT", "true")
        try:
            import wandb

            folder.mkdir(exist_ok=True)
            saved = folder / ID_FILE
            earlier = saved.is_file() and not saved.is_symlink()
            run_id = saved.read_text().strip() if earlier else uuid.uuid4().hex[:8]
            files.write_text(saved, run_id + "\n")
            sweep = run.info.get("sweep")
            self.run = wandb.init(
                dir=str(run.run_dir),
                mode=self.mode,  # type: ignore[arg-type]  # one of MODES, checked when built
                project=self.project or run.info.get("app") or "saturate",
                entity=self.entity,
                name=run.info.get("name") or run.run_dir.name,
                id=run_id,
                resume="allow",
                group=Path(sweep).name if sweep else None,
                job_type="train",
                tags=[str(run.info[k]) for k in ("data", "model", "task") if k in run.info],
                config={"saturate": {"run_dir": str(run.run_dir)}},
                # no system-metrics sampler: wandb-core is a child of this process, and its CPU would count in
                # the run's own (the report's facts); no console capture (train.log has it)
                settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
            )
        except Exception as e:  # noqa: BLE001 (no tracker: the run goes on without it)
            log.warning("wandb: cannot start (%s: %s); this run is not tracked there", type(e).__name__, e)
            self.run = None
            return
        if self.run.dir and not Path(self.run.dir).resolve().is_relative_to(run.run_dir.resolve()):
            log.warning("wandb: writing to %s, not under the run dir (is it writable?)", self.run.dir)
        self.last_step = run.start_step  # offline, a resumed run's W&B step starts again at 0

    def on_log(self, run, metrics: dict[str, float], step: int) -> None:
        if self.run is None:
            return
        values = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != names.STEP}
        if step < self.last_step:  # W&B's steps only go forward (the batch search logs by batch size): a summary
            self._safely("summary", self.run.summary.update, values)
            return
        self.last_step = step
        self._safely("log", self.run.log, values, step=step)

    def on_text(self, run, tag: str, text: str, step: int) -> None:
        if self.run is not None and tag == "fingerprint":
            fingerprint = re.sub(r"^```\w*\n|```$", "", text.strip())  # the YAML, out of its Markdown fence
            self._safely("config", self.run.config.update, {"fingerprint": fingerprint}, allow_val_change=True)

    def on_hparams(self, run, params: dict[str, Any], metrics: dict[str, float], varied: list[str]) -> None:
        if self.run is not None:
            self._safely("config", self.run.config.update, params, allow_val_change=True)

    def on_run_end(self, run, metrics: dict[str, Any]) -> None:
        if self.run is None:
            return
        done = run_record.read(run.run_dir)
        status = metrics.get("status") or (done.status if done else None) or "failed"
        verdict = done.verdict if done else None
        summary = {"saturate/status": status, **({"saturate/verdict": verdict} if verdict else {})}
        self._safely("summary", self.run.summary.update, summary)
        self._safely("tags", setattr, self.run, "tags", (*self.run.tags, status, *([verdict] if verdict else [])))
        for path in (run.run_dir / "report.md", run.run_dir / ".hydra" / "config.yaml"):
            if path.is_file():
                self._safely("save", self.run.save, str(path), base_path=str(run.run_dir), policy="now")
        self._safely("finish", self.run.finish, exit_code=0 if status == "completed" else 1)
        self.run = None

    def _safely(self, what: str, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (the tracker's trouble is never the run's)
            log.warning("wandb: %s failed (%s: %s); the run goes on", what, type(e).__name__, e)
