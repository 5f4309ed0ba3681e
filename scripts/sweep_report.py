"""Summarise a multirun: which setting was fastest, and why the others were not.

    python scripts/sweep_report.py outputs/multirun/<date>/<time>

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

from saturate.observe.sweep import common_overrides, markdown, plot, read_jobs, rows, write_csv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir", type=Path)
    args = parser.parse_args()
    if not args.sweep_dir.is_dir():
        print(f"sweep_report: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    jobs = read_jobs(args.sweep_dir)
    if not jobs:
        print(f"sweep_report: no job directories (0/, 1/, ...) in {args.sweep_dir}", file=sys.stderr)
        return 2

    header, table = rows(jobs)
    common = " ".join(f"{k}={v}" for k, v in common_overrides(jobs).items()) or "-"
    failed = [j for j in jobs if j.status != "completed"]
    why = "; ".join(f"job {j.number} ({j.status}: {j.metrics.get('error', 'no metrics.json')})" for j in failed)
    text = "\n".join(
        [
            f"# Sweep {args.sweep_dir}",
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
    (args.sweep_dir / "sweep.md").write_text(text)
    write_csv(args.sweep_dir / "sweep.csv", jobs)
    try:
        written = plot(jobs, args.sweep_dir)
        print("wrote sweep.md, sweep.csv" + "".join(f", {p.name}" for p in written) + f" in {args.sweep_dir}")
    except ImportError:
        print("wrote sweep.md and sweep.csv; no plots: matplotlib is not installed (pip install -e '.[report]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
