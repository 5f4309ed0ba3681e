"""What a log step costs in TensorBoard: saturate's TensorBoardLogger.on_log (the step's
scalars as one event) against SummaryWriter.add_scalar once per scalar (one event each, what
the logger wrote before), into event files in a temporary folder, in alternating rounds.

    python scripts/bench_logging.py                  # 15 scalars a log step, 2,000 log steps, 5 rounds
    python scripts/bench_logging.py --scalars 6 --steps 200 --rounds 2

Both write through the same SummaryWriter (its own thread serialises and writes the events); a
round times each way over `--steps` log steps, then flushes the writer, so the time includes
what the writer's thread does with the events. The table gives each way's microseconds per log
step (median over rounds) and the median of the rounds' ratios, one event against one per
scalar (each round's figures first); and checks that TensorBoard reads the same points from
both.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from saturate.loggers import TensorBoardLogger


def metrics(n: int, step: int) -> dict[str, float]:
    return {f"train/m{i:02d}": 1.0 / (step + i + 1) for i in range(n)}


def one_event(logger: TensorBoardLogger, run, n: int, steps: range) -> float:
    start = time.perf_counter()
    for step in steps:
        logger.on_log(run, metrics(n, step), step)
    logger.writer.flush()
    return time.perf_counter() - start


def per_scalar(logger: TensorBoardLogger, n: int, steps: range) -> float:
    start = time.perf_counter()
    for step in steps:
        for tag, value in metrics(n, step).items():
            logger.writer.add_scalar(tag, value, step)
    logger.writer.flush()
    return time.perf_counter() - start


def points(folder: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scalars", type=int, default=15, help="scalars a log step (a CPU run logs 10-15)")
    parser.add_argument("--steps", type=int, default=2000, help="log steps a round, each way")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {"one event": [], "an event per scalar": []}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = {way: Path(tmp) / way.replace(" ", "_") for way in times}
        loggers = {}
        for way, folder in folders.items():
            folder.mkdir()
            run = SimpleNamespace(run_dir=folder, start_step=0, step=0, metrics={})
            loggers[way] = (TensorBoardLogger(), run)
            loggers[way][0].on_run_start(run)
        for r in range(args.rounds):
            steps = range(r * args.steps, (r + 1) * args.steps)
            order = list(times) if r % 2 == 0 else list(reversed(times))
            taken = {}
            for way in order:
                logger, run = loggers[way]
                seconds = (
                    one_event(logger, run, args.scalars, steps)
                    if way == "one event"
                    else per_scalar(logger, args.scalars, steps)
                )
                taken[way] = seconds / args.steps * 1e6
                times[way].append(taken[way])
            ratios.append(taken["one event"] / taken["an event per scalar"])
            print(
                f"round {r + 1}: one event {taken['one event']:.0f} us, an event per scalar "
                f"{taken['an event per scalar']:.0f} us, ratio {ratios[-1]:.3f}",
                flush=True,
            )
        for logger, run in loggers.values():
            logger.on_run_end(run, {})
        same = points(folders["one event"], "train/m03") == points(folders["an event per scalar"], "train/m03")
    print(f"{args.scalars} scalars a log step, {args.steps} log steps a round, {args.rounds} rounds")
    print("| way | us a log step (median) |")
    print("|---|---:|")
    for way, values in times.items():
        print(f"| {way} | {statistics.median(values):.0f} |")
    print(f"one event / an event per scalar, paired by round: {statistics.median(ratios):.3f}")
    print(f"TensorBoard reads the same points from both: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
