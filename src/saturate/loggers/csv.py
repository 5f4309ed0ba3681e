"""`<run dir>/metrics.csv`, one row per logged value: `step,name,value` (long format: rows
append as metrics come and go; `pandas.read_csv(...).pivot(index="step", columns="name",
values="value")` gives one column per metric)."""

from __future__ import annotations

import csv
import io
from typing import Any

from saturate import files
from saturate.errors import ConfigError, Problem


class CSVLogger:
    """A run resumed at step N keeps the rows up to N and drops the rest. The file is written
    whole at the start (through a temporary file and a rename: a link planted in its place is
    replaced, not written through), then appended to without following a link."""

    def __init__(self, filename: str = "metrics.csv"):
        if not isinstance(filename, str) or filename in ("", ".", "..") or "/" in filename:
            raise ConfigError([Problem("logger.csv.filename", filename, "a file name (it is written in the run dir)")])
        self.filename = filename
        self.file: Any = None  # open for the whole run
        self.writer: Any = None  # csv.writer over it

    def on_run_start(self, run) -> None:
        path = run.run_dir / self.filename
        kept = []
        if run.start_step and path.is_file() and not path.is_symlink():
            with open(path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["step"]) <= run.start_step]
        start = io.StringIO(newline="")
        rows = csv.writer(start)
        rows.writerow(["step", "name", "value"])
        rows.writerows([r["step"], r["name"], r["value"]] for r in kept)
        files.write_text(path, start.getvalue())
        self.file = files.open_growing(path, "a")
        self.writer = csv.writer(self.file)

    def on_log(self, run, metrics: dict[str, float], step: int) -> None:
        self.writer.writerows(
            [step, name, repr(float(value))] for name, value in metrics.items() if isinstance(value, (int, float))
        )
        self.file.flush()

    def on_run_end(self, run, metrics: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
