"""How fast a newcomer's first answers come, measured side by side with `import torch`, and
how soon the default run's first optimizer step ends, beside a plain loop's.

    python scripts/bench_startup.py [--rounds 5] [--first-step]

Times, in fresh processes, alternately: `python -c "import torch"`, `python train.py --help`,
a misspelt key (`trainer.max_epoch=3`) and an out-of-range value (`loader.num_workers=-1`),
and prints each one's median and its ratio to `import torch`; `saturate --help`, `saturate
train --help` and the misspelt key through the installed command too. The target: --help
and the misspelt key at most 0.5x. An out-of-range value is answered by the config's check
before torch is imported (the values come before the targets): printed for the record.

With `--first-step`, also alternately: the default run (`python train.py`, one epoch) and
PLAIN_LOOP (the same digits, model, optimizer and batch in a hand-written loop), each timed
from its process's start to the end of its first optimizer step (the run's
`time/first_step_s`; the loop prints its own), medians, the ratio and the run's start-up
spans (`startup/*`: where the difference goes).

With `--sides LABEL=CHECKOUT[,override ...] ...`, the default run (the whole of `python
train.py`, each side from its own checkout with its own `src/` first on the path and its
overrides) alternately, each side's whole process and first step (`time/first_step_s`),
medians and, paired by round, the whole process's ratio and the first step's difference to
the first side, with `val/acc` (it must not move): a change against
its parent commit (a `git worktree` of it), or a setting on and off in one checkout.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from saturate import names

ROOT = Path(__file__).resolve().parents[1]
SATURATE = str(Path(sys.executable).with_name("saturate"))  # the installed command, beside this Python
COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "train.py --help": [sys.executable, str(ROOT / "train.py"), "--help"],
    "saturate --help": [SATURATE, "--help"],
    "saturate train --help": [SATURATE, "train", "--help"],
    "a misspelt key": [sys.executable, str(ROOT / "train.py"), "trainer.max_epoch=3"],
    "saturate train, a misspelt key": [SATURATE, "train", "trainer.max_epoch=3"],
    "an out-of-range value": [
        sys.executable,
        str(ROOT / "train.py"),
        "loader.num_workers=-1",
        "hydra.run.dir=/tmp/saturate-bench-startup",
    ],
}


# The default run as its user would write it by hand: digits, SmallCNN, SGD, batch 128.
PLAIN_LOOP = """
import torch
from sklearn.datasets import load_digits
from torch import nn
from saturate.models.small_cnn import SmallCNN
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16
y = torch.tensor(digits.target)
model = SmallCNN(1, 10)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
loss = nn.functional.cross_entropy(model(x[:128]), y[:128])
loss.backward()
optimizer.step()
from saturate.started import process_age  # the process's age as the run's start-up takes it
print(process_age())
"""


def first_steps(rounds: int) -> None:
    """The default run's first step against the plain loop's, alternately, from process start."""
    import json
    import tempfile

    loop, run, spans = [], [], []
    for _ in range(rounds):
        done = subprocess.run([sys.executable, "-c", PLAIN_LOOP], capture_output=True, text=True, cwd=ROOT)
        loop.append(float(done.stdout.strip().splitlines()[-1]))
        with tempfile.TemporaryDirectory() as out:
            args = ["trainer.max_epochs=1", "trainer.progress=false", f"hydra.run.dir={out}"]
            subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, cwd=ROOT)
            metrics = json.loads((Path(out) / "metrics.json").read_text())
        run.append(metrics[names.FIRST_STEP_S])
        spans.append({k: v for k, v in metrics.items() if k.startswith("startup/")})
    a, b = statistics.median(loop), statistics.median(run)
    print(f"\n| to the end of the first step ({rounds} rounds) | median s | vs the plain loop |")
    print("|---|---:|---:|")
    print(f"| plain loop | {a:.2f} | 1.00x |")
    print(f"| python train.py | {b:.2f} | {b / a:.2f}x |")
    spanned = list(spans[0])
    print(
        "\nthe run's start-up spans, median s: "
        + ", ".join(f"{n[8:-2]} {statistics.median(s.get(n, 0.0) for s in spans):.2f}" for n in spanned)
    )


def sides(specs: list[str], rounds: int) -> None:
    """The default run from each side, alternately: whole process, first step, val/acc."""
    import json
    import os
    import tempfile

    parsed = []
    for spec in specs:
        label, _, rest = spec.partition("=")
        checkout, *overrides = rest.split(",")
        parsed.append((label, Path(checkout).resolve(), [o for o in overrides if o]))
    seen: dict[str, dict[str, list[float]]] = {label: {"whole": [], "first": [], "acc": []} for label, _, _ in parsed}
    for _ in range(rounds):
        for label, checkout, overrides in parsed:
            env = {**os.environ, "PYTHONPATH": str(checkout / "src")}
            with tempfile.TemporaryDirectory() as out:
                args = ["trainer.progress=false", f"hydra.run.dir={out}", *overrides]
                start = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, str(checkout / "train.py"), *args], capture_output=True, cwd=checkout, env=env
                )
                whole = time.perf_counter() - start
                if done.returncode != 0:
                    raise SystemExit(f"{label}: exit {done.returncode}\n{done.stderr.decode()[-2000:]}")
                metrics = json.loads((Path(out) / "metrics.json").read_text())
            seen[label]["whole"].append(whole)
            seen[label]["first"].append(metrics[names.FIRST_STEP_S])
            seen[label]["acc"].append(metrics["val/acc"])
    base = seen[parsed[0][0]]
    header = "whole process, median s | paired ratio | first step, median s | paired difference s | val/acc"
    print(f"\n| side ({rounds} rounds, alternating) | {header} |")
    print("|---|---:|---:|---:|---:|---|")
    for label, _, _ in parsed:
        side = seen[label]
        # paired by round: a shared machine's drift moves both sides of a round alike
        ratio = statistics.median(w / w0 for w, w0 in zip(side["whole"], base["whole"], strict=True))
        later = statistics.median(f - f0 for f, f0 in zip(side["first"], base["first"], strict=True))
        accs = ", ".join(sorted({f"{a:.4f}" for a in side["acc"]}))
        whole, first = statistics.median(side["whole"]), statistics.median(side["first"])
        print(f"| {label} | {whole:.2f} | {ratio:.3f} | {first:.2f} | {later:+.2f} | {accs} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--first-step", action="store_true", help="also the default run's first step vs a plain loop")
    parser.add_argument("--sides", nargs="+", metavar="LABEL=CHECKOUT[,override]", help="the default run, per side")
    args = parser.parse_args()
    if args.sides:
        sides(args.sides, args.rounds)
        return
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
    if args.first_step:
        first_steps(args.rounds)


if __name__ == "__main__":
    main()
