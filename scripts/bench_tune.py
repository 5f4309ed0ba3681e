"""What `tune=true` buys, measured side by side.

    python scripts/bench_tune.py [--rounds 2] [--steps 150] [extra overrides for the start]
    python scripts/bench_tune.py --case cifar        # on a GPU machine

`--case folder` (the default), the CPU target (>= 1.5x the start): scikit-learn's digits
written as 1,797 JPEG files (64 px, resized to 32 on load), a narrow SmallCNN, per-sample
augmentation in the main process (0 workers): what many pipelines look like.
`--case cifar`, the GPU target (>= 0.9x the best hand-picked settings): CIFAR-sized
synthetic data and resnet18 from the defaults, tuned with tune.allow=[batch_size,precision],
against the hand-picked fast path (resident data, batched augmentation, AMP, compile,
channels_last, batch 512).

It runs `python train.py tune=true ...` with the default budget (no cache), then trains the
start, the preset (and for cifar the hand-picked config) for `--steps` steps each,
alternately (`--rounds` times: the machine's noise hits all alike), and prints the mean
samples/s of each and their ratios.
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
sys.path.insert(0, str(ROOT))
from saturate.commands.make_image_folder import write_digits  # noqa: E402

START = ["data=image_folder", "data.image_size=32", "model.width=8", "augmentation=cpu", "loader.num_workers=0"]
CIFAR = ["data=synthetic", "data.num_train=50000", "model=resnet18", "augmentation=cpu"]
HAND_PICKED = [
    "loader=resident",
    "augmentation=gpu",
    "precision=amp",
    "trainer.compile=true",
    "trainer.channels_last=true",
    "loader.batch_size=512",
    "optim.lr_scaling=sqrt",
]


def train(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"train.py {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--case", choices=("folder", "cifar"), default="folder")
    opts, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if opts.case == "folder":
            write_digits(tmp / "images", size=64, fmt="jpg")
            start, allow = [*START, f"data.root={tmp / 'images'}", *extra], []
        else:
            start, allow = [*CIFAR, *extra], ["tune.allow=[batch_size,precision]"]
        preset = tmp / "conf" / "experiment" / "tuned_bench.yaml"
        began = time.perf_counter()
        train([*start, "tune=true", *allow, f"tune.preset={preset}", "tune.cache=", "hydra.run.dir=tune"], tmp)
        tune_s = time.perf_counter() - began
        result = json.loads((tmp / "tune" / "tune.json").read_text())
        print((tmp / "tune" / "tune.md").read_text())
        print(f"tune: {tune_s:.0f} s in all (process start-up included), {len(result['results'])} trials\n")
        tuned = [f"hydra.searchpath=[file://{tmp / 'conf'}]", "experiment=tuned_bench"]
        steps = [
            f"trainer.max_steps={opts.steps}",
            "trainer.max_epochs=1000",
            "trainer.progress=false",
            "trainer.eval_interval=1000",
        ]
        configs = {"start": start, "tuned": tuned}
        if opts.case == "cifar":
            configs["hand-picked"] = [*start, *HAND_PICKED]
        rates: dict[str, list[float]] = {name: [] for name in configs}
        for r in range(opts.rounds):
            for name, args in configs.items():
                train([*args, *steps, f"hydra.run.dir=runs/{name}{r}"], tmp)
                rates[name].append(
                    json.loads((tmp / "runs" / f"{name}{r}" / "metrics.json").read_text())[names.SAMPLES_PER_S]
                )
    for name, values in rates.items():
        print(f"{name:>11}: {statistics.mean(values):8,.0f} samples/s  ({', '.join(f'{v:,.0f}' for v in values)})")
    mean = {name: statistics.mean(values) for name, values in rates.items()}
    print(
        f"tuned / start = {mean['tuned'] / mean['start']:.2f}x" + (" (target >= 1.5x)" if opts.case == "folder" else "")
    )
    if opts.case == "cifar":
        print(f"tuned / hand-picked = {mean['tuned'] / mean['hand-picked']:.2f}x (target >= 0.9x)")
    print(f"the preset's changes: {' '.join(result['changes']) or '(none)'}")


if __name__ == "__main__":
    main()
