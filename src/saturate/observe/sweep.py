"""Reading a multirun directory back: one row per job, the table, the CSV and the plots
that scripts/sweep_report.py writes."""

from __future__ import annotations

import csv
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from saturate import names

log = logging.getLogger(__name__)

# (metrics.json key, column heading, format)
FIGURES = [
    (names.SAMPLES_PER_S, "samples/s", "{:,.0f}"),
    (names.DATA_WAIT_FRAC, "data wait", "{:.1%}"),
    (names.PEAK_MB, "peak MB", "{:,.0f}"),
    (names.GPU_UTIL_MEAN, "GPU util", "{:.0f}%"),
    (names.WALL_S, "wall s", "{:.1f}"),
]
# the task's validation metrics, in this order where a job logged them
TASK_METRICS = [
    ("val/acc", "{:.4f}"),
    ("val/top5", "{:.4f}"),
    ("val/mae", "{:.4f}"),
    ("val/rmse", "{:.4f}"),
    ("val/r2", "{:.4f}"),
    (names.VAL_LOSS, "{:.4f}"),
]


def figures(jobs: list[Job]) -> list[tuple[str, str, str]]:
    """The columns: throughput, data wait, memory, GPU utilisation (when sampled), the task's
    validation metrics that some job logged (its checkpoint.monitor first, whatever its
    name), their test-set counterparts where a job has a test split, the time to the target
    where a job met one (target.metric), wall time."""
    logged = {k for j in jobs for k in j.metrics}
    monitors = [j.metrics["monitor"] for j in jobs if j.metrics.get("monitor", "").startswith("val/")]
    order = list(dict.fromkeys([*monitors, *(k for k, _ in TASK_METRICS if k != names.VAL_LOSS)]))
    task = [(k, k, dict(TASK_METRICS).get(k, "{:.4f}")) for k in order if k in logged and k != names.VAL_LOSS]
    if not task and names.VAL_LOSS in logged:
        task = [(names.VAL_LOSS, names.VAL_LOSS, "{:.4f}")]
    tested = [(f"test/{k[4:]}", f"test/{k[4:]}", fmt) for k, _, fmt in task if f"test/{k[4:]}" in logged]
    base = [f for f in FIGURES if f[0] != names.GPU_UTIL_MEAN or names.GPU_UTIL_MEAN in logged]
    target = [(names.TO_TARGET_S, "to target s", "{:.1f}")] if names.TO_TARGET_S in logged else []  # target.metric
    return base[:-1] + task + tested + target + base[-1:]


@dataclass
class Job:
    number: int
    path: Path
    overrides: dict[str, str]
    metrics: dict = field(default_factory=dict)

    @property
    def status(self) -> str:
        return self.metrics.get("status", "missing")  # missing: the job died before writing anything

    @property
    def throughput(self) -> float:
        return self.metrics.get(names.SAMPLES_PER_S, 0.0) if self.status == "completed" else -1.0


def read_jobs(sweep_dir: Path) -> list[Job]:
    jobs = []
    # <job>_<name> (or <job>)
    numbered = {p: re.match(r"(\d+)(_|$)", p.name) for p in sweep_dir.iterdir() if p.is_dir()}
    for path in sorted((p for p, m in numbered.items() if m), key=lambda p: int(numbered[p].group(1))):
        overrides_file = path / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
        pairs = dict(o.lstrip("+~").split("=", 1) for o in overrides or [] if "=" in o)
        metrics_file = path / "metrics.json"
        try:
            metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
        except json.JSONDecodeError:
            metrics = {"status": "failed", "error": "metrics.json is not valid JSON"}
        jobs.append(Job(int(numbered[path].group(1)), path, pairs, metrics))
    return jobs


def swept_keys(jobs: list[Job]) -> list[str]:
    """Override keys whose value differs between jobs, in first-seen order."""
    keys = list(dict.fromkeys(k for j in jobs for k in j.overrides))
    return [k for k in keys if len({j.overrides.get(k) for j in jobs}) > 1]


def common_overrides(jobs: list[Job]) -> dict[str, str]:
    swept = set(swept_keys(jobs))
    return {k: v for k, v in jobs[0].overrides.items() if k not in swept} if jobs else {}


def rows(jobs: list[Job]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) sorted by throughput, the best marked; failed jobs last."""
    keys = swept_keys(jobs)
    columns = figures(jobs)
    header = ["job", *keys, *(heading for _, heading, _ in columns), "status"]
    ordered = sorted(jobs, key=lambda j: j.throughput, reverse=True)
    best = ordered[0] if ordered and ordered[0].status == "completed" else None
    table = []
    for job in ordered:
        cells = [str(job.number), *(job.overrides.get(k, "") for k in keys)]
        for key, _, fmt in columns:
            value = job.metrics.get(key)
            cells.append(fmt.format(value) if isinstance(value, (int, float)) else "-")
        status = job.status if job.status != "failed" else f"failed: {job.metrics.get('error', '')}"
        table.append([*cells, ("**best** " if job is best else "") + status])
    return header, table


def markdown(header: list[str], table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    return "\n".join(lines)


def write_csv(path: Path, jobs: list[Job]) -> None:
    keys = swept_keys(jobs)
    columns = figures(jobs)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["job", *keys, *(k for k, _, _ in columns), "batch_size", "num_workers", "status", "error"])
        for j in sorted(jobs, key=lambda j: j.number):
            values = [j.metrics.get(k, "") for k, _, _ in columns]
            used = [j.metrics.get("batch_size", ""), j.metrics.get("num_workers", "")]
            writer.writerow(
                [
                    j.number,
                    *(j.overrides.get(k, "") for k in keys),
                    *values,
                    *used,
                    j.status,
                    j.metrics.get("error", ""),
                ]
            )


def lines(jobs: list[Job], key: str) -> dict[str, list[tuple[float, float]]]:
    """The completed jobs' (batch size, `key`) points, one line per combination of the
    other swept keys, named by it (e.g. "augmentation=gpu loader.num_workers=2")."""
    others = [k for k in swept_keys(jobs) if k != "loader.batch_size"]
    out: dict[str, list[tuple[float, float]]] = {}
    for j in (j for j in jobs if j.status == "completed"):
        name = " ".join(f"{k}={j.overrides.get(k, '')}" for k in others) or "all jobs"
        out.setdefault(name, []).append((j.metrics["batch_size"], j.metrics[key]))
    return {name: sorted(points) for name, points in sorted(out.items())}


def plot(jobs: list[Job], out: Path) -> list[Path]:
    """samples/s and data-wait share against the batch size, one line per combination of the
    other swept keys (or, when the batch size was not swept, one bar per job). Returns the
    files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [j for j in jobs if j.status == "completed"]
    if not done:
        return []
    by_batch = len({j.metrics.get("batch_size") for j in done}) > 1
    written = []
    for key, label, name in (
        (names.SAMPLES_PER_S, "samples/s", "samples_per_s.png"),
        (names.DATA_WAIT_FRAC, "data wait (share of step time)", "data_wait.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        if by_batch:  # one line per value of the other swept keys (workers, augmentation, precision, ...)
            for group, line in lines(jobs, key).items():
                ax.plot([x for x, _ in line], [y for _, y in line], marker="o", label=group)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size (per device)")
            ax.legend()
        else:
            keys = swept_keys(jobs)
            labels = [" ".join(f"{k}={j.overrides.get(k, '')}" for k in keys) or str(j.number) for j in done]
            ax.bar(range(len(done)), [j.metrics[key] for j in done])
            ax.set_xticks(range(len(done)), labels, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{label} by job")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)
    return written
