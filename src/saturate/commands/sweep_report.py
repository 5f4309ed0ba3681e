"""Summarise a multirun: which setting was fastest, and why the others were not.

    saturate sweep-report outputs/multirun/<date>/<time>

Prints a table (the swept overrides -> samples/s, data-wait share, peak memory, GPU
utilisation when sampled, val/acc, wall time, status) sorted by throughput with the best
marked, and writes sweep.csv, sweep.md and PNG plots (samples/s and data wait against the
batch size, one line per combination of the other swept keys) into the sweep directory. Failed jobs are listed with
their reason; they do not stop the report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from saturate import record as run_record
from saturate.diagnostics.sweep import (
    Refused,
    cell,
    common_overrides,
    escaped,
    markdown,
    plot,
    read_jobs,
    rows,
    write_atomic,
    write_csv,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="saturate sweep-report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("sweep_dir", type=Path)
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"sweep_report: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    problems: list[str] = []
    jobs = read_jobs(args.sweep_dir, problems)
    for problem in problems:
        print(f"sweep_report: {problem}", file=sys.stderr)
    if not jobs:
        print(f"sweep_report: no job directories (0/, 1/, ...) in {args.sweep_dir}", file=sys.stderr)
        return 2

    header, table = rows(jobs)
    common = cell(" ".join(f"{k}={v}" for k, v in common_overrides(jobs).items()) or "-")
    failed = [j for j in jobs if j.status != "completed"]
    why = "; ".join(
        f"job {j.number} ({cell(j.status)}: {cell(j.metrics.get('error', f'no {run_record.FILE}'))})" for j in failed
    )
    text = "\n".join(
        [
            f"# Sweep {escaped(args.sweep_dir)}",
            "",
            f"{len(jobs)} jobs, {len(jobs) - len(failed)} completed; common overrides: {common}",
            "",
            markdown(header, table),
            "",
            *([f"Failed: {why}", ""] if failed else []),
            "![samples/s](samples_per_s.png)",
            "![data wait](data_wait.png)",
            "",
        ]
    )
    print(text)
    refused: list[str] = []
    written = []
    for name, write in (
        ("sweep.md", lambda path: write_atomic(path, text.encode())),
        ("sweep.csv", lambda path: write_csv(path, jobs)),
    ):
        try:
            write(args.sweep_dir / name)
            written.append(name)
        except Refused as e:
            refused.append(str(e))
    try:
        written += [p.name for p in plot(jobs, args.sweep_dir, refused)]
        plots = ""
    except ImportError:
        plots = "; no plots: matplotlib is not installed (pip install -e '.[report]')"
    for problem in refused:
        print(f"sweep_report: {problem}", file=sys.stderr)
    print(f"wrote {', '.join(written) or 'nothing'} in {escaped(args.sweep_dir)}{plots}")
    return 1 if refused else 0
