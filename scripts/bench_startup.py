"""How fast a newcomer's first answers come, measured side by side with `import torch`.

    python scripts/bench_startup.py [--rounds 5]

Times, in fresh processes, alternately: `python -c "import torch"`, `python train.py --help`,
a misspelt key (`trainer.max_epoch=3`) and an out-of-range value (`loader.num_workers=-1`),
and prints each one's median and its ratio to `import torch`. The target (issue 27): --help
and the misspelt key at most 0.5x. An out-of-range value is checked against the model's and
the data's constructors, which imports them (and so torch): it is printed for the record.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "train.py --help": [sys.executable, str(ROOT / "train.py"), "--help"],
    "a misspelt key": [sys.executable, str(ROOT / "train.py"), "trainer.max_epoch=3"],
    "an out-of-range value": [
        sys.executable,
        str(ROOT / "train.py"),
        "loader.num_workers=-1",
        "hydra.run.dir=/tmp/saturate-bench-startup",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, cmd in COMMANDS.items():  # alternately: the machine's noise hits all alike
            start = time.perf_counter()
            subprocess.run(cmd, capture_output=True, cwd=ROOT)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["import torch"])
    print(f"| command | median s ({args.rounds} rounds) | vs import torch |")
    print("|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {statistics.median(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
