"""`<run dir>/metrics.csv`, one row per logged value: `step,name,value` (long format: rows
append as metrics come and go; `pandas.read_csv(...).pivot(index="step", columns="name",
values="value")` gives one column per metric)."""

from __future__ import annotations

import csv
from typing import Any


class CSVLogger:
    """A run resumed at step N keeps the rows up to N and drops the rest."""

    def __init__(self, filename: str = "metrics.csv"):
        self.filename = filename
        self.file: Any = None  # open for the whole run
        self.writer: Any = None  # csv.writer over it

    def on_run_start(self, run) -> None:
        path = run.run_dir / self.filename
        kept = []
        if run.start_step and path.is_file():
            with open(path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["step"]) <= run.start_step]
        self.file = open(path, "w", newline="")  # noqa: SIM115 (open for the whole run)
        self.writer = csv.writer(self.file)
        self.writer.writerow(["step", "name", "value"])
        self.writer.writerows([r["step"], r["name"], r["value"]] for r in kept)

    def on_log(self, run, metrics: dict[str, float], step: int) -> None:
        self.writer.writerows(
            [step, name, repr(float(value))] for name, value in metrics.items() if isinstance(value, (int, float))
        )
        self.file.flush()

    def on_run_end(self, run, metrics: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
