"""What `tune=true` buys on an input-bound image-folder run, measured side by side.

    python scripts/bench_tune.py [--rounds 2] [--steps 150] [extra overrides for the start]

The starting config: scikit-learn's digits written as 1,797 JPEG files (64 px, resized to
32 on load), a narrow SmallCNN, per-sample augmentation in the main process (0 workers):
what many pipelines look like. It runs `python train.py tune=true ...` with the default
budget (no cache), then trains the start and `experiment=<the preset>` for `--steps`
steps each, alternately (`--rounds` times: the machine's noise hits both alike), and
prints the mean samples/s of each and their ratio.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts.make_image_folder import write_digits  # noqa: E402

START = ["data=image_folder", "data.image_size=32", "model.width=8", "augmentation=cpu", "loader.num_workers=0"]


def train(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"train.py {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    opts, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_digits(tmp / "images", size=64, fmt="jpg")
        start = [*START, f"data.root={tmp / 'images'}", *extra]
        preset = tmp / "conf" / "experiment" / "tuned_bench.yaml"
        began = time.perf_counter()
        train([*start, "tune=true", f"tune.preset={preset}", "tune.cache=", "hydra.run.dir=tune"], tmp)
        tune_s = time.perf_counter() - began
        result = json.loads((tmp / "tune" / "tune.json").read_text())
        print((tmp / "tune" / "tune.md").read_text())
        print(f"tune: {tune_s:.0f} s in all (process start-up included), {len(result['results'])} trials\n")
        tuned = [f"hydra.searchpath=[file://{tmp / 'conf'}]", "experiment=tuned_bench"]
        steps = [f"trainer.max_steps={opts.steps}", "trainer.max_epochs=1000", "trainer.progress=false", "trainer.eval_interval=1000"]
        rates: dict[str, list[float]] = {"start": [], "tuned": []}
        for r in range(opts.rounds):
            for name, args in (("start", start), ("tuned", tuned)):
                train([*args, *steps, f"hydra.run.dir=runs/{name}{r}"], tmp)
                rates[name].append(json.loads((tmp / "runs" / f"{name}{r}" / "metrics.json").read_text())["perf/samples_per_s"])
    for name, values in rates.items():
        print(f"{name:>6}: {statistics.mean(values):8,.0f} samples/s  ({', '.join(f'{v:,.0f}' for v in values)})")
    print(f"tuned / start = {statistics.mean(rates['tuned']) / statistics.mean(rates['start']):.2f}x "
          f"(target >= 1.5x); the preset's changes: {' '.join(result['changes']) or '(none)'}")  # fmt: skip


if __name__ == "__main__":
    main()
