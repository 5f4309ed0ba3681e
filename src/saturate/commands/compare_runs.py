"""Run train.py configurations side by side and compare their measured figures.

    saturate compare-runs "augmentation=cpu" "augmentation=gpu" --common trainer.max_epochs=5
    saturate compare-runs "loader=default" "loader=resident" --repeats 3

Each argument is one configuration (space-separated overrides). Every configuration runs
`--repeats` times, interleaved (A B A B ...) so that drift on a shared machine hits all of
them alike, in this process through `saturate.train`, with outputs in a temporary
directory. The table gives the median of each figure and each configuration's throughput
relative to the first.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

import saturate
from saturate import names
from saturate.config.dirs import CONF

saturate.register()  # the schema and resolvers, before composing conf/
COLUMNS = [
    (names.SAMPLES_PER_S, "samples/s", "{:.0f}"),
    (names.DATA_WAIT_FRAC, "data wait", "{:.1%}"),
    (names.STEP_MS, "step ms", "{:.2f}"),
    ("objective", "monitor", "{:.4f}"),
    (names.WALL_S, "wall s", "{:.1f}"),
]


def run_once(overrides: list[str], run_dir: Path) -> dict[str, float]:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"run_dir={run_dir}", "trainer.progress=false"])
    metrics = saturate.train(cfg)
    return {**metrics, "objective": float(metrics)}  # checkpoint.monitor: val/acc, val/loss, ... as the task says


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="saturate compare-runs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("configs", nargs="+", help="one quoted string of overrides per configuration")
    parser.add_argument("--common", nargs="*", default=[], help="overrides added to every configuration")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    logging.getLogger("saturate").setLevel(logging.WARNING)

    results: dict[str, list[dict]] = {c: [] for c in args.configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for i, config in enumerate(args.configs):
                results[config].append(run_once([*args.common, *config.split()], Path(tmp) / f"{i}-{r}"))

    first = statistics.median(m[names.SAMPLES_PER_S] for m in results[args.configs[0]])
    print(
        f"\n{platform.machine()}, {os.cpu_count()} CPUs, "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}, torch {torch.__version__}; "
        f"common: {' '.join(args.common) or '-'}; median of {args.repeats}\n"
    )
    width = max(len(c) for c in args.configs)
    print(f"| {'configuration':<{width}} | " + " | ".join(h for _, h, _ in COLUMNS) + " | vs first |")
    print(f"|{'-' * (width + 2)}|" + "|".join("-" * (len(h) + 1) + ":" for _, h, _ in COLUMNS) + "|---------:|")
    for config, runs in results.items():
        cells = [fmt.format(statistics.median(m[key] for m in runs)).rjust(len(h)) for key, h, fmt in COLUMNS]
        ratio = statistics.median(m[names.SAMPLES_PER_S] for m in runs) / first
        print(f"| {config:<{width}} | " + " | ".join(cells) + f" | {ratio:7.2f}x |")
