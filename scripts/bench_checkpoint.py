"""What checkpointing costs a run of short epochs: the same `python train.py` run, whole process
timed, with the default checkpointing (trainer.checkpoint_interval=auto) and with checkpoints
off, in alternating rounds.

    python scripts/bench_checkpoint.py                      # the VAE example, 150 epochs, 5 rounds
    python scripts/bench_checkpoint.py --quick              # 2 rounds of a 5-epoch run: the script works

Checkpoints off: the same command in a process whose Checkpointer saves and holds nothing (no
last.pt, no best.pt; the test split, if any, is evaluated with the final weights): the floor
that any checkpointing is measured against. Each round runs both, the first of them swapped
from round to round; a round's figure is its default time over its off time (a paired
comparison: drift on a shared machine moves both alike). The table gives each round's times,
ratio and the default run's mean epoch (its training loop over its epochs), and the median
ratio; the target is <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from saturate import names

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.05

# the child: train.py as `python train.py ARGS` runs it; with "off", a Checkpointer that writes nothing
CHILD = """
import runpy, sys
if sys.argv[1] == "off":
    from saturate.checkpoint.checkpointer import Checkpointer
    Checkpointer.save = lambda self, *args, **kwargs: 0.0
    Checkpointer.hold = lambda self, *args, **kwargs: None
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

VAE = ["hydra.searchpath=[file://examples/vae/conf]", "experiment=vae"]


def command(mode: str, epochs: int, run_dir: Path, extra: list[str]) -> list[str]:
    args = [*VAE, f"trainer.max_epochs={epochs}", "trainer.progress=false", f"hydra.run.dir={run_dir}", *extra]
    return [sys.executable, "-c", CHILD, mode, str(ROOT / "train.py"), *args]


def timed(mode: str, epochs: int, run_dir: Path, extra: list[str]) -> float:
    """Seconds from the process's start to its exit (a failure stops the bench, with its output)."""
    start = time.perf_counter()
    result = subprocess.run(command(mode, epochs, run_dir, extra), cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{mode} run failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return seconds


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5 epochs: that the script works")
    parser.add_argument("overrides", nargs="*", help="more overrides for both runs (e.g. device=cpu)")
    args = parser.parse_args(argv)
    epochs, rounds = (5, 2) if args.quick else (args.epochs, args.rounds)
    ratios = []
    print(f"VAE example, {epochs} epochs, whole process; default checkpointing against checkpoints off\n")
    print("| round | default s | off s | ratio | epoch s |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = ["default", "off"] if r % 2 == 0 else ["off", "default"]
            seconds = {mode: timed(mode, epochs, Path(tmp) / f"{mode}{r}", args.overrides) for mode in order}
            ratios.append(seconds["default"] / seconds["off"])
            loop = json.loads((Path(tmp) / f"default{r}" / "metrics.json").read_text())[names.LOOP_S]
            times = f"{seconds['default']:.2f} | {seconds['off']:.2f}"
            print(f"| {r + 1} | {times} | {ratios[-1]:.3f} | {loop / epochs:.3f} |", flush=True)
    median = statistics.median(ratios)
    verdict = "within" if median <= TARGET else "over"
    each = ", ".join(f"{x:.3f}" for x in ratios)
    print(f"\nmedian ratio {median:.3f} ({verdict} the target {TARGET}); rounds: {each}")
    return ratios


if __name__ == "__main__":
    main()
