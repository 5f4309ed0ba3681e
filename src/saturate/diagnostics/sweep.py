"""Reading a multirun directory back: one row per job, the table, the CSV and the plots
that saturate sweep-report writes.

A sweep dir is untrusted: its jobs wrote it, and anyone who can write there may have planted
files. Nothing here follows a symbolic link below the dir it was given, reads a file that is
not a regular one or is larger than a run writes, or copies text from a run without escaping
it; a file that cannot be read as what it should be is passed over with one line naming it.
What the report writes goes through a temporary file and a rename, never through a link."""

from __future__ import annotations

import csv
import io
import logging
import os
import re
import tempfile
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from saturate import names
from saturate import record as run_record
from saturate.record import Unreadable

log = logging.getLogger(__name__)

CELL_CHARS = 300  # text copied from a run into a table cell, at most

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
    monitors = [m for j in jobs if isinstance(m := j.metrics.get("monitor"), str) and m.startswith("val/")]
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
        status = self.metrics.get("status", "missing")  # missing: the job died before writing anything
        return status if isinstance(status, str) else "missing"

    @property
    def throughput(self) -> float:
        value = self.metrics.get(names.SAMPLES_PER_S, 0.0)
        return float(value) if self.status == "completed" and number(value) else -1.0


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_inside(root: Path, path: Path) -> bytes | None:
    """The bytes of `path`, a regular file below `root` reached through no symbolic link;
    None when there is none; Unreadable when it is a link, not a regular file, or too large."""
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        if current.is_symlink():
            raise Unreadable("a symbolic link")
    try:  # O_NOFOLLOW: a link planted since the check is refused too; O_NONBLOCK: a FIFO does not hang
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Unreadable(e.strerror or str(e)) from None
    with os.fdopen(fd, "rb") as f:
        return run_record.bounded(f)


def _overrides(data: bytes) -> dict[str, str]:
    try:
        overrides = yaml.safe_load(data)
    except (yaml.YAMLError, RecursionError, ValueError):
        overrides = None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise Unreadable("not a YAML list of overrides")
    return dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)


def read_jobs(sweep_dir: Path, problems: list[str] | None = None) -> list[Job]:
    """The numbered job dirs of `sweep_dir`, read as untrusted: what cannot be read is passed
    over, and one line naming it is added to `problems`."""
    problems = [] if problems is None else problems
    jobs = []
    # <job>_<name> (or <job>)
    numbered = {}
    for p in sweep_dir.iterdir():
        if not (match := re.match(r"(\d+)(_|$)", p.name)):
            continue
        if p.is_symlink():
            problems.append(f"passing over {escaped(p)}: a symbolic link")
        elif p.is_dir():
            numbered[p] = match
    for path in sorted(numbered, key=lambda p: int(numbered[p].group(1))):
        pairs, metrics = {}, {}
        for name in (".hydra/overrides.yaml", run_record.FILE):
            try:
                data = read_inside(sweep_dir, path / name)
                if data is not None and name == run_record.FILE:
                    metrics = run_record.parse(data).entries
                elif data is not None:
                    pairs = _overrides(data)
            except Unreadable as e:
                problems.append(f"passing over {escaped(path / name)}: {e}")
                if name == run_record.FILE:
                    metrics = {"status": "failed", "error": f"{run_record.FILE} is {e}"}
        jobs.append(Job(int(numbered[path].group(1)), path, pairs, metrics))
    return jobs


def escaped(text) -> str:
    """`text` with every control character (newlines, escapes, bidi marks) written as an escape:
    what a run wrote never starts a line of its own, nor moves the cursor, in a report."""
    return "".join(
        c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") else c
        for c in str(text)
    )


def cell(text) -> str:
    """Text from a run made one Markdown table cell: escaped, no column separator, no HTML,
    at most CELL_CHARS characters."""
    text = escaped(text)
    text = text if len(text) <= CELL_CHARS else text[: CELL_CHARS - 1] + "…"
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


class Refused(Exception):
    """A report file that is a link or not a regular file: never written through."""


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` through a new temporary file beside it and a rename: a reader sees the old
    file or the new one; a symbolic link (or anything but a regular file) there is refused,
    and the rename would replace a link planted since, never write through it."""
    if path.is_symlink():
        raise Refused(f"refusing to write {escaped(path)}: it is a symbolic link")
    if path.exists() and not path.is_file():
        raise Refused(f"refusing to write {escaped(path)}: it is not a regular file")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        cells = [str(job.number), *(cell(job.overrides.get(k, "")) for k in keys)]
        for key, _, fmt in columns:
            value = job.metrics.get(key)
            cells.append(fmt.format(value) if number(value) else "-")
        status = job.status if job.status != "failed" else f"failed: {job.metrics.get('error', '')}"
        table.append([*cells, ("**best** " if job is best else "") + cell(status)])
    return header, table


def markdown(header: list[str], table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    return "\n".join(lines)


def write_csv(path: Path, jobs: list[Job]) -> None:
    """sweep.csv, written atomically (Refused where a link or a folder is in its place); the
    csv module quotes what the runs wrote, newlines included."""
    keys = swept_keys(jobs)
    columns = figures(jobs)
    with io.StringIO(newline="") as f:
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
        write_atomic(path, f.getvalue().encode())


def lines(jobs: list[Job], key: str) -> dict[str, list[tuple[float, float]]]:
    """The completed jobs' (batch size, `key`) points, one line per combination of the
    other swept keys, named by it (e.g. "augmentation=gpu loader.num_workers=2")."""
    others = [k for k in swept_keys(jobs) if k != "loader.batch_size"]
    out: dict[str, list[tuple[float, float]]] = {}
    for j in (j for j in jobs if j.status == "completed"):
        name = " ".join(f"{k}={j.overrides.get(k, '')}" for k in others) or "all jobs"
        if number(j.metrics.get("batch_size")) and number(j.metrics.get(key)):
            out.setdefault(name, []).append((j.metrics["batch_size"], j.metrics[key]))
    return {name: sorted(points) for name, points in sorted(out.items())}


def label_text(text: str) -> str:
    """A plot label from a run's overrides: escaped, and no `$` that matplotlib would parse as maths."""
    return escaped(text)[:CELL_CHARS].replace("$", r"\$")


def plot(jobs: list[Job], out: Path, refused: list[str] | None = None) -> list[Path]:
    """samples/s and data-wait share against the batch size, one line per combination of the
    other swept keys (or, when the batch size was not swept, one bar per job). Returns the
    files written; a file refused (a link in its place) is named in `refused`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [j for j in jobs if j.status == "completed" and number(j.metrics.get(names.SAMPLES_PER_S))]
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
            drawn = lines(jobs, key)
            for group, line in drawn.items():
                ax.plot([x for x, _ in line], [y for _, y in line], marker="o", label=label_text(group))
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size (per device)")
            if drawn:
                ax.legend()
        else:
            keys = swept_keys(jobs)
            named = [" ".join(f"{k}={j.overrides.get(k, '')}" for k in keys) or str(j.number) for j in done]
            labels = [label_text(n) for n in named]
            ax.bar(range(len(done)), [j.metrics[key] if number(j.metrics.get(key)) else 0 for j in done])
            ax.set_xticks(range(len(done)), labels, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{label} by job")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        image = io.BytesIO()
        fig.savefig(image, format="png", dpi=100)
        plt.close(fig)
        try:
            write_atomic(out / name, image.getvalue())
            written.append(out / name)
        except Refused as e:
            (refused if refused is not None else []).append(str(e))
    return written
