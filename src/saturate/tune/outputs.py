"""What a tune leaves besides its preset: the table (console, tune.md, TensorBoard text)
and tune.json."""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from saturate.record import write_json
from saturate.tune.preset import reproduce, write_preset

if TYPE_CHECKING:
    from saturate.tune.search import Tuner
    from saturate.tune.trials import Result

log = logging.getLogger("saturate.tune")  # one logger for the whole tune, whichever module writes a line


def record_tune(tuner: Tuner, preset: Path, run_dir: Path) -> None:
    """The preset, tune.md, tune.json and the TensorBoard text."""
    speedup = tuner.speedup
    write_preset(
        preset,
        tuner.start_overrides,
        tuner.changes,
        groups={k for k in tuner.invocation.choices if not k.startswith("hydra")},
        searchpath=tuner.searchpath,
        speedup=speedup,
        rate=tuner.rate,
        confirmed=tuner.confirmed,
    )
    text = render(tuner, preset=preset)
    (run_dir / "tune.md").write_text(text)
    write_json(
        run_dir / "tune.json",
        {
            "results": [dataclasses.asdict(r) for r in tuner.results],
            "changes": tuner.changes,
            "speedup": speedup,
            "confirmed": tuner.confirmed,
            "to_target_s": tuner.to_target_s,  # the start's and each contender's median time to the target
            # the seeds, and per candidate (the start first) its changes, whether they change the
            # numerics, its time to the target per seed (null: not met) and the metric's final value
            "target_runs": tuner.target_runs,
            "dropped": tuner.dropped,  # the fastest's changes, dropped for its time to the target
            "preset": str(preset),
            "interrupted": tuner.interrupted,
        },
    )
    write_tensorboard(run_dir, lambda tb, run: tb.on_text(run, "tune", text, 0))
    log.info("\n%s", text)


def write_tensorboard(run_dir: Path, write) -> None:
    """Write into `run_dir`'s TensorBoard events with the built-in logger (a tune's own table,
    a failed trial's HParams row)."""
    from types import SimpleNamespace

    from saturate.loggers import TensorBoardLogger

    tb, run = TensorBoardLogger(), SimpleNamespace(run_dir=run_dir, start_step=0, step=0, metrics={})
    tb.on_run_start(run)
    try:
        write(tb, run)
    finally:
        tb.on_run_end(run, {})


def _rows(results: list[Result], start: Result) -> Iterator[str]:
    for r in results:
        ok = r.status == "ok"
        cells = [
            str(r.number),
            "`" + (" ".join(r.changes) or "(start)") + "`",
            f"{r.samples_per_s:,.0f}" if ok else "-",
            ("undecided" if r.outcome.startswith("undecided") else f"{r.speed() / start.speed():.2f}x") if ok else "-",
            f"{r.data_wait:.0%}" if ok else "-",
            f"{r.gpu_util:.0f}%" if r.gpu_util is not None else "-",
            f"{r.peak_mb:,.0f}" if r.peak_mb is not None else "-",
            r.verdict or "-",
            r.outcome,
        ]
        yield "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def _to_target_lines(tuner: Tuner) -> list[str]:
    """What the runs to the target measured (with a target set): a row per candidate, the start
    first, with its median time to the target, each seed's, the metric's final value, and
    whether it changes the numerics; the one that met it first said."""
    runs, medians = tuner.target_runs, tuner.to_target_s
    if runs is None or medians is None:
        return []
    said = lambda seconds: f"{seconds:.1f} s" if seconds is not None else "not met"
    metric, seeds = tuner.target_metric, runs["seeds"]
    met = [(m, i) for i, m in enumerate(medians) if m is not None]
    first = min(met)[1] if met else None
    how = f"with seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} (trainer.seed)"
    lines = [
        "",
        f"To the target, each trained to it {how} within the budget:",
        "",
        f"| candidate | changes numerics | seeds | to target (median) | per seed | final {metric} (median) | result |",
        "|---|---|---:|---:|---|---:|---|",
    ]
    for i, (side, median) in enumerate(zip(runs["candidates"], medians, strict=True)):
        finals = [f for f in side["finals"] if f is not None]
        cells = [
            "`" + (" ".join(side["changes"]) or "(start)") + "`",
            "yes" if side["numerics"] else "no",
            str(len(side["times"])),
            said(median),
            ", ".join(said(t) for t in side["times"]),
            f"{statistics.median(finals):.4g}" if finals else "-",
            ", ".join(["first to the target"] * (i == first) + ["kept"] * (side["changes"] == tuner.changes and i > 0))
            or "-",
        ]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    if first is None:
        lines += ["", "No candidate met the target at the median: samples/s decided."]
    else:
        winner = " ".join(runs["candidates"][first]["changes"]) or "the starting config"
        finals = [f for f in runs["candidates"][first]["finals"] if f is not None]
        at = f" at {metric} {statistics.median(finals):.4g}" if finals else ""
        start_s, first_s = medians[0], medians[first]
        sooner = f", {start_s / first_s:.2f}x sooner than the starting config" if first and start_s and first_s else ""
        lines += ["", f"First to the target: `{winner}`, median {said(medians[first])}{at}{sooner}."]
    return lines


def render(tuner: Tuner, *, preset: Path) -> str:
    """The tune as Markdown (console, tune.md, TensorBoard text)."""
    start = tuner.results[0]
    lines = [
        "## Tune",
        "",
        "| trial | overrides | samples/s | vs start | data wait | GPU util | peak MB | verdict | result |",
        "|---:|---|---:|---:|---:|---:|---:|---|---|",
        *_rows(tuner.results, start),
        "",
    ]
    if tuner.interrupted:
        lines += ["Interrupted: the best so far is kept.", ""]
    rounds = sum(r.outcome == "again" for r in tuner.results) // 2 + 1
    how = (
        f"the median of {rounds} paired measurements of the start and the fastest"
        if tuner.confirmed
        else "one trial each"
    )
    soonest = tuner.best is not None and tuner.best.outcome == "soonest to the target"
    if tuner.changes and tuner.confirmed and not soonest:
        lines.append(
            f"**Fastest: {tuner.rate:,.0f} samples/s, {tuner.speedup:.2f}x the starting config** ({how}) with "
            f"`{' '.join(tuner.changes)}`."
        )
    elif tuner.changes and not soonest:
        lines.append(
            f"**Fastest: {tuner.rate:,.0f} samples/s, {tuner.speedup:.2f}x the starting config in one trial each, not "
            f"confirmed** with `{' '.join(tuner.changes)}`: the budget (or an interrupt) left no room to measure the "
            "start and the fastest again side by side; a single trial is at the mercy of a noisy machine. Tune again "
            "with a larger tune.budget_s to confirm it."
        )
    elif tuner.changes and tuner.target_runs is not None:
        lines.append(
            f"**Soonest to the target: `{' '.join(tuner.changes)}`** ({tuner.rate:,.0f} samples/s, "
            f"{tuner.speedup:.2f}x the starting config's in one trial each)."
        )
    elif tuner.dropped:
        met = tuner.to_target_s is not None and tuner.to_target_s[1] is not None
        lines.append(
            f"**Keep the starting config** ({tuner.rate:,.0f} samples/s): the fastest in samples/s, "
            f"`{' '.join(tuner.dropped)}`, {'met the target later' if met else 'did not meet the target'} "
            "(the median over the seeds)."
        )
    else:
        lines.append(
            f"**Nothing measured faster than the starting config** ({tuner.rate:,.0f} samples/s): keep it as it is."
        )
    lines += _to_target_lines(tuner)
    lines += ["", f"Preset: `{preset}`; run it with `{reproduce(preset, tuner.searchpath)}`."]
    return "\n".join(lines) + "\n"
