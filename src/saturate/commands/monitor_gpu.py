"""Watch NVIDIA GPU use live, then judge it.

    saturate monitor-gpu [--interval 1] [--duration 300] [--csv gpu.csv]

One line per sample and device (utilisation, memory, power, temperature, SM clock), until
--duration seconds have passed or Ctrl-C; then, per device, the mean utilisation, its
fluctuation (standard deviation), the minimum, the share of samples under 50 %, and a
status (stable, fluctuating or starved; the thresholds are printed). Run it beside a
training run. Without an NVIDIA GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from datetime import datetime

from saturate.diagnostics.monitor import Analysis, analyse, open_nvml, read_gpu, visible_nvml_handles

FIELDS = ["time", "gpu", "util", "mem_used_mb", "power_w", "temp_c", "sm_clock_mhz"]


def cell(values: dict, key: str, width: int, spec: str) -> str:
    """A figure right-aligned in `width`, or '-' where NVML refused it."""
    return format(values[key], spec).rjust(width) if key in values else "-".rjust(width)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="saturate monitor-gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--duration", type=float, default=None, help="seconds to watch (default: until Ctrl-C)")
    parser.add_argument("--csv", default=None, help="also write every sample to this CSV file")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be > 0")

    pynvml, why = open_nvml()
    handles = visible_nvml_handles(pynvml) if pynvml else []
    if not handles:
        print(
            f"monitor_gpu: no NVIDIA GPU to watch ({why or 'NVML sees no device'}); nothing to monitor", file=sys.stderr
        )
        return 2

    out = open(args.csv, "w", newline="") if args.csv else None  # noqa: SIM115 (closed in the finally below)
    writer = csv.DictWriter(out, FIELDS) if out else None
    if writer:
        writer.writeheader()
    util: dict[int, list[float]] = {index: [] for index, _ in handles}
    start = time.monotonic()
    try:
        while args.duration is None or time.monotonic() - start < args.duration:
            now = datetime.now().strftime("%H:%M:%S")
            for index, handle in handles:
                v = read_gpu(pynvml, handle)  # what NVML gives: a MIG slice or a vGPU refuses some fields
                if "util" in v:
                    util[index].append(v["util"])
                print(
                    f"{now}  gpu{index}  util {cell(v, 'util', 3, ',.0f')}%  mem "
                    f"{cell(v, 'mem_used_mb', 8, ',.0f')} MB  power {cell(v, 'power_w', 5, '.0f')} W  temp "
                    f"{cell(v, 'temp_c', 3, '.0f')} C  sm {cell(v, 'sm_clock_mhz', 5, ',.0f')} "
                    "MHz",
                    flush=True,
                )
                if writer:
                    writer.writerow({"time": now, "gpu": index, **v})
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        if out:
            out.close()
        pynvml.nvmlShutdown()

    print(f"\nanalysis ({Analysis.thresholds()}):")
    for index, series in util.items():
        if series:
            a = analyse(series)
            print(
                f"  gpu{index}: {len(series)} samples, mean {a.mean:.1f}%, fluctuation (std) {a.std:.1f}, min "
                f"{a.minimum:.0f}%, {a.under_50:.0%} under 50% -> {a.status}"
            )
    return 0
