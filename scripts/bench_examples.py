"""saturate's run of each ported example against the plain PyTorch loop it stands for.

    python scripts/bench_examples.py [--examples har,sign] [--pairs 5] [--threads 1] [--seeds]
                                     [--author-scripts DIR] [--results FILE] [--quick]
    python scripts/bench_examples.py --summarize FILE      # the tables again, from recorded runs (and their logs)
    python scripts/bench_examples.py --summarize FILE --at 42     # time to another value of the target's metric

Each pair runs both sides, one after the other, in fresh processes, alternating which goes
first (saturate then the reference, then the reference then saturate, ...):

- saturate: the example's own command from the README (`python train.py
  hydra.searchpath=[file://examples/<name>/conf] experiment=<name>`) with no loader,
  precision or monitor key added: only `target.metric=... target.value=...` (the example's
  target) and `hydra.run.dir` (where the run is written). Its time to the first step, to the
  target and its start-up spans are read from the run's metrics.json (`time/first_step_s`,
  `time/to_target_s`, `startup/*`: seconds since the process started).
- the reference: `examples/<name>/reference.py` where the author's licence lets it be shipped,
  else `DIR/<name>/reference.py` from `--author-scripts DIR` (made from the author's own
  checkout as `examples/<name>/REFERENCE.md` says). It is called with `--target VALUE` and
  prints, in seconds since its process started: `BENCH first_step t=...`, one
  `BENCH eval t=... <metric>=...` per evaluation and `BENCH final <key>=<value> ...`.

Both sides: whole-process wall time measured here (from before the fork to the end of
wait4), CPU seconds (user + sys, with children). Per example it prints each side's median
whole-process wall, first step, time to target and final metric, and the ratios
saturate / reference over the pairs: median, 80th percentile and spread (min-max). The
issue's target: median <= 1.0 and p80 <= 1.05 for time to target and whole process. The
ratio "per epoch" is the time from the end of the first step to the end of the last
evaluation over the epochs trained, on each side: where early stopping ends a run (pm25),
whole-process time compares the two sides' stopping epochs, and this compares the loops.
"Epochs to target" is where each side's training met the target (its step there over the
steps in an epoch): the same seed does not give the two sides the same draws (their own
initialisation, order and augmentation), so each learns along its own path, except where the
example draws as its author's script does (pm25: `loader.order=global` and the author's
unfused Adam give the script's validation loss after every epoch, so both stop at one epoch). Time to target
compares the two as a user sees them; with epochs to target beside it, the part the speed
explains (first step, per epoch) can be told from the part the path does.

`--seeds` trains pair N with seed N on both sides (saturate's `trainer.seed=N`, the
reference's `--seed N`; the data stay the example's). Time to a target depends on the seed
(the U-Net reference met Dice 0.7 between 26.0 and 52.4 s over seeds 1-5), so
without it a pair compares one seed's luck with another's; with it both medians are over the
same seeds. A third table gives each side against itself: its time to target (and whole
process) in each pair over the same side's in every other pair. With --seeds that is what
the seed alone does to a ratio when the loop is the same on both sides, the yardstick for
the saturate / reference spread beside it.

Both sides run as Python does by default, its compiled modules written once and reused:
an environment's PYTHONDONTWRITEBYTECODE=1 (the project machines set it) is dropped for
them, since with it every start compiles the project's own modules again (saturate's
60-odd: 0.15-0.2 s on a 2-core CPU; a plain script's two or three: milliseconds), which no
user's runs pay after their first.

`--at VALUE` (with `--summarize`) times both sides to another value of the example's target
metric, recomputed from each side's own record of its evaluations: the reference's `BENCH eval`
lines, saturate's TensorBoard file (`time/eval_at_s` and the metric, paired by step). A run
whose files are gone has no time to it. A target that one side rarely meets gives few pairs
(pm25's 40 µg/m³: the reference met it on one seed in ten); several values show whether a
ratio is the loops' or the one threshold's.

`--threads N` sets OMP_NUM_THREADS=N for both sides (an environment variable, not a
saturate key; on a shared 2-core machine torch's default of one thread per core waits on
descheduled threads and makes a single run 5-10x slower at random). `--quick` runs one
short pair (each side's `quick` settings) for a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from saturate import names

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Example:
    metric: str  # saturate's target metric (a val/* tag)
    value: float  # the target
    better: str  # "max" or "min"
    ref_metric: str  # the reference's name for it on its BENCH eval lines
    final: str  # saturate's final metric in metrics.json
    ref_final: str  # the reference's, on its BENCH final line
    ref_args: tuple[str, ...] = ()  # more arguments for the reference ({out}: its own folder)
    quick_sat: tuple[str, ...] = ("trainer.max_epochs=2",)  # --quick only
    quick_ref: tuple[str, ...] = ("--epochs", "2")


EXAMPLES = {
    "pm25": Example("val/rmse_raw", 40.0, "min", "val_rmse_raw", "test/rmse_raw", "test_rmse_raw"),
    "har": Example("val/acc", 0.65, "max", "val_acc", "test/acc", "test_acc"),
    "sign": Example("val/ter", 0.05, "min", "val_ter", "test/ter", "test_ter", ("--out", "{out}")),
    "gray128": Example("val/acc", 0.80, "max", "val_acc", "val/acc", "last_val_acc", ("--out", "{out}")),
    "segmentation": Example("val/dice", 0.70, "max", "val_dice", "val/dice", "last_val_dice"),
    "forecast": Example(
        names.VAL_LOSS, 0.015, "min", "val_loss", names.VAL_LOSS, "last_val_loss", quick_ref=("--train_epochs", "2")
    ),
    "mixup": Example("val/acc", 0.90, "max", "val_acc", "val/acc", "last_val_acc", quick_ref=("--epoch", "2")),
    "chargpt": Example(
        names.VAL_LOSS,
        1.75,
        "min",
        "val_loss",
        names.VAL_LOSS,
        "last_val_loss",
        quick_sat=("trainer.max_steps=300",),
        quick_ref=("--max_iters", "300"),
    ),
    "wordlm": Example(
        names.VAL_LOSS, 6.1, "min", "val_loss", names.VAL_LOSS, "last_val_loss", quick_ref=("--epochs", "2")
    ),
    "vae": Example(
        names.VAL_LOSS, 24.2, "min", "val_loss", names.VAL_LOSS, "last_val_loss", quick_ref=("--epochs", "2")
    ),
    "dcgan": Example(
        "val/fd_pixels",
        2.0,
        "min",
        "fd_pixels",
        "val/fd_pixels",
        "last_fd_pixels",
        ("--outf", "{out}"),
        quick_ref=("--niter", "2"),
    ),
}
SIDES = ("saturate", "reference")


# ---------------------------------------------------------------- the figures of one side


def meets(value: float, target: float, better: str) -> bool:
    return value >= target if better == "max" else value <= target


_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"


def parse_reference(text: str, spec: Example) -> dict:
    """The reference's own figures from its BENCH lines: first step, each evaluation's (t,
    value), the time its metric first met the target (recomputed here from the evaluations)
    and its final figures."""
    # not anchored to the line's start: a progress bar (tqdm, \r without \n) may precede them
    first = re.search(rf"BENCH first_step t={_NUMBER}", text)
    evals, at = [], []  # at: each evaluation's (epoch, step) (1-based epoch, as every reference prints it)
    for line in re.findall(r"BENCH eval (.*)$", text, re.M):
        t = re.search(rf"\bt={_NUMBER}", line)
        v = re.search(rf"\b{re.escape(spec.ref_metric)}={_NUMBER}", line)
        if t and v:
            evals.append((float(t.group(1)), float(v.group(1))))
            e, s = re.search(r"\bepoch=(\d+)", line), re.search(r"\bstep=(\d+)", line)
            at.append((float(e.group(1)) if e else math.nan, float(s.group(1)) if s else math.nan))
    hit_at = next((i for i, (_, v) in enumerate(evals) if meets(v, spec.value, spec.better)), None)
    hit = evals[hit_at][0] if hit_at is not None else math.nan
    epoch = at[-1][0] if at else math.nan
    final_line = re.search(r"BENCH final (.*)$", text, re.M)
    final = {}
    for word in final_line.group(1).split() if final_line else ():
        key, _, value = word.partition("=")
        try:
            final[key] = float(value)
        except ValueError:
            continue
    first_step = float(first.group(1)) if first else math.nan
    return {
        "first_step_s": first_step,
        "to_target_s": hit,
        "epochs_to_target": epochs_at(at, hit_at),
        "per_epoch_s": per_epoch(first_step, evals[-1][0] if evals else math.nan, epoch),
        "evals": evals,
        "final": final.get(spec.ref_final, evals[-1][1] if evals else math.nan),
    }


def epochs_at(at: list[tuple[float, float]], index: int | None) -> float:
    """The epochs trained at the reference's evaluation `index` (None: none met the target):
    its step over the steps in an epoch (the last evaluation's step over its epoch: every
    reference's last evaluation ends an epoch) when its lines print steps, else its epoch."""
    if index is None:
        return math.nan
    epoch, step = at[index]
    last_epoch, last_step = at[-1]
    return step / (last_step / last_epoch) if step > 0 and last_step > 0 and last_epoch > 0 else epoch


def per_epoch(first_step: float, last_eval: float, epochs: float) -> float:
    """Seconds an epoch, from the end of the first step to the end of the last evaluation
    (seconds since the process started), over the epochs trained: the same span on both
    sides, the figure for runs whose length is set by where early stopping ends."""
    return (last_eval - first_step) / epochs if epochs > 0 else math.nan


def read_saturate(metrics: dict, spec: Example, evals: list[tuple[float, float, int]] | None = None) -> dict:
    """saturate's own figures from its run's metrics.json; with `evals` (saturate_evals: each
    evaluation's time, value and step), the time to spec.value is recomputed from them
    instead of read (the run's own target may have been another value)."""
    first_step = float(metrics.get(names.FIRST_STEP_S, math.nan))
    last_eval, epochs = (float(metrics.get(k, math.nan)) for k in (names.EVAL_AT_S, names.EPOCH))
    steps, target_step = (float(metrics.get(k, math.nan)) for k in (names.STEP, names.TO_TARGET_STEP))
    to_target = float(metrics.get(names.TO_TARGET_S, math.nan))
    if evals is not None:
        hit = next(((t, step) for t, v, step in evals if meets(v, spec.value, spec.better)), (math.nan, math.nan))
        to_target, target_step = hit
    return {
        "first_step_s": first_step,
        "per_epoch_s": per_epoch(first_step, last_eval, epochs),
        "to_target_s": to_target,
        "epochs_to_target": target_step / (steps / epochs) if steps > 0 and epochs > 0 else math.nan,
        "final": float(metrics.get(spec.final, math.nan)),
        "startup": {k: float(v) for k, v in metrics.items() if k.startswith(("startup/", names.IMPORTS_PREFIX))},
    }


def saturate_evals(run_dir: Path, metric: str) -> list[tuple[float, float, int]] | None:
    """Each evaluation of a saturate run as (seconds since the process started, `metric`,
    step) in step order, from its TensorBoard file: `time/eval_at_s` and the metric paired by
    step (a step's first value of each; a step without both is left out). The values are the
    file's float32, as the run's own target compared them (0.9 is 0.8999999761...: an
    accuracy of exactly 0.9 does not meet 0.9 here, while the reference's printed 0.9 does).
    None without a file or either tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not any(run_dir.glob("events.out.tfevents.*")):
        return None
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags().get("scalars", [])
    if names.EVAL_AT_S not in tags or metric not in tags:
        return None
    at: dict[int, float] = {}
    values: dict[int, float] = {}
    for tag, into in ((names.EVAL_AT_S, at), (metric, values)):
        for e in events.Scalars(tag):
            into.setdefault(e.step, e.value)
    return [(at[step], values[step], step) for step in sorted(at) if step in values]


# ---------------------------------------------------------------- running the two sides


def run_process(cmd: list[str], cwd: Path, log: Path, threads: int) -> dict:
    # this checkout's saturate (src/) and examples (the root), whatever is installed: the code timed is the code here
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), PYTHONUNBUFFERED="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # both sides as Python runs by default: compiled modules kept and reused
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    load = os.getloadavg()[0]
    with open(log, "w") as out:
        start = time.perf_counter()
        process = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
    return {
        "rc": os.waitstatus_to_exitcode(status),
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "load1": load,
        "log": str(log),
    }


def saturate_command(name: str, spec: Example, run_dir: Path, *, quick: bool, seed: int | None) -> list[str]:
    """The example's own command, its target and run dir added (and trainer.seed with --seeds)."""
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.searchpath=[file://examples/{name}/conf]"]
    cmd += [f"experiment={name}", f"target.metric={spec.metric}", f"target.value={spec.value}"]
    cmd += [f"hydra.run.dir={run_dir}", *(spec.quick_sat if quick else ())]
    return cmd + ([f"trainer.seed={seed}"] if seed is not None else [])


def run_saturate(name: str, spec: Example, out: Path, args, seed: int | None) -> dict:
    run_dir = out / "run"
    cmd = saturate_command(name, spec, run_dir, quick=args.quick, seed=seed)
    record = run_process(cmd, ROOT, out / "saturate.log", args.threads)
    path = run_dir / "metrics.json"
    metrics = json.loads(path.read_text()) if path.exists() else {}
    return {**record, **read_saturate(metrics, spec), "command": " ".join(cmd[1:])}


def reference_script(name: str, author_scripts: Path | None) -> Path | None:
    shipped = ROOT / "examples" / name / "reference.py"
    if shipped.exists():
        return shipped
    if author_scripts is not None and (author_scripts / name / "reference.py").exists():
        return author_scripts / name / "reference.py"
    return None


def reference_command(spec: Example, script: Path, out: Path, *, quick: bool, seed: int | None) -> list[str]:
    """The reference with the example's target (and --seed with --seeds)."""
    extra = [a.replace("{out}", str(out / "out")) for a in spec.ref_args]
    cmd = [sys.executable, str(script), "--target", str(spec.value), *extra, *(spec.quick_ref if quick else ())]
    return cmd + (["--seed", str(seed)] if seed is not None else [])


def run_reference(name: str, spec: Example, script: Path, out: Path, args, seed: int | None) -> dict:
    cmd = reference_command(spec, script, out, quick=args.quick, seed=seed)
    record = run_process(cmd, out, out / "reference.log", args.threads)
    parsed = parse_reference(Path(record["log"]).read_text(errors="replace"), spec)
    return {**record, **parsed, "command": " ".join(cmd[1:])}


def reread(record: dict, at: float | None = None) -> dict:
    """A recorded run read again where its files are still there: the reference's log, or
    saturate's metrics.json beside its log (so that a fix to the reading, or a figure added
    since, applies to recorded runs). With `at`, the time to that value of the target's
    metric, from the run's own evaluations; a run whose files are gone has none."""
    log = Path(record.get("log", ""))
    spec = EXAMPLES.get(record.get("example"))
    lost = {"to_target_s": math.nan, "epochs_to_target": math.nan} if at is not None else {}
    if spec is None or not log.is_file():
        return {**record, **lost}
    if at is not None:
        spec = dataclasses.replace(spec, value=at)
    if record.get("side") == "reference":
        return {**record, **parse_reference(log.read_text(errors="replace"), spec)}
    run_dir = log.parent / "run"
    evals = saturate_evals(run_dir, spec.metric) if at is not None else None
    if not (run_dir / "metrics.json").is_file() or (at is not None and evals is None):
        return {**record, **lost}
    return {**record, **read_saturate(json.loads((run_dir / "metrics.json").read_text()), spec, evals)}


# ---------------------------------------------------------------- summarising


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's default);
    NaNs are left out; NaN when nothing is left."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return xs[low] + (xs[high] - xs[low]) * (pos - low)


def median(values: list[float]) -> float:
    return percentile(values, 50)


@dataclass
class Ratio:
    median: float
    p80: float
    low: float
    high: float
    n: int

    def text(self) -> str:
        if not self.n:
            return "-"
        return f"{self.median:.2f} (p80 {self.p80:.2f}, {self.low:.2f}-{self.high:.2f}, n={self.n})"


def _ratio(rs: list[float]) -> Ratio:
    rs = [r for r in rs if not math.isnan(r)]
    if not rs:
        return Ratio(math.nan, math.nan, math.nan, math.nan, 0)
    return Ratio(median(rs), percentile(rs, 80), min(rs), max(rs), len(rs))


def ratios(pairs: list[dict], key: str) -> Ratio:
    """saturate / reference for each pair where both sides have the figure (a file recorded
    before a figure existed lacks it)."""
    both = [(p["saturate"].get(key, math.nan), p["reference"].get(key, math.nan)) for p in pairs]
    return _ratio([sat / ref for sat, ref in both if sat > 0 and ref > 0])


def against_itself(pairs: list[dict], side: str, key: str) -> Ratio:
    """One side's figure in each pair over its figure in every other pair, both orders (its
    median about 1): the spread a ratio of two runs has when the command is the same and only the
    pair differs. With --seeds that is the seed (each run its own path to the target), without
    it the machine's timing. A bound on saturate / reference tighter than a side's own p80 is
    one that the side's loop would not meet against itself."""
    xs = [p[side].get(key, math.nan) for p in pairs]
    return _ratio([a / b for i, a in enumerate(xs) for j, b in enumerate(xs) if i != j and a > 0 and b > 0])


@dataclass
class Summary:
    example: str
    pairs: int
    sides: dict = field(default_factory=dict)  # side -> {figure: median}
    ratio: dict = field(default_factory=dict)  # figure -> Ratio
    itself: dict = field(default_factory=dict)  # (side, figure) -> Ratio: against_itself
    startup: dict = field(default_factory=dict)  # startup/* -> median
    load: tuple[float, float] = (math.nan, math.nan)
    failed: int = 0


FIGURES = ("wall_s", "cpu_s", "first_step_s", "to_target_s", "epochs_to_target", "per_epoch_s", "final")
RATIOS = ("wall_s", "cpu_s", "first_step_s", "to_target_s", "epochs_to_target", "per_epoch_s")
ITSELF = ("to_target_s", "wall_s")


def summarize(records: list[dict]) -> list[Summary]:
    """One Summary per example from the recorded pairs (records: one per side and pair, as
    --results writes them). A pair where either side failed (non-zero exit) is left out."""
    by_example: dict[str, dict[int, dict]] = {}
    for r in records:
        by_example.setdefault(r["example"], {}).setdefault(r["pair"], {})[r["side"]] = r
    out = []
    for example, pairs in by_example.items():
        complete = [p for p in pairs.values() if all(s in p for s in SIDES)]
        good = [p for p in complete if all(p[s]["rc"] == 0 for s in SIDES)]
        summary = Summary(example, len(good), failed=len(complete) - len(good))
        for side in SIDES:
            summary.sides[side] = {f: median([p[side].get(f, math.nan) for p in good]) for f in FIGURES}
            summary.sides[side]["reached"] = sum(not math.isnan(p[side]["to_target_s"]) for p in good)
        summary.ratio = {f: ratios(good, f) for f in RATIOS}
        summary.itself = {(side, f): against_itself(good, side, f) for side in SIDES for f in ITSELF}
        keys = sorted(  # the spans (by name: metrics.json keeps no order), then the imports timed within them
            {k for p in good for k in p["saturate"].get("startup", {})},
            key=lambda k: (k.startswith(names.IMPORTS_PREFIX), k),
        )
        summary.startup = {k: median([p["saturate"]["startup"].get(k, math.nan) for p in good]) for k in keys}
        loads = [p[s]["load1"] for p in good for s in SIDES]
        summary.load = (min(loads), max(loads)) if loads else (math.nan, math.nan)
        out.append(summary)
    return out


def _s(x: float, digits: int = 1) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def _span(key: str) -> str:
    """startup/data_s: data; imports/torchmetrics_s: import torchmetrics (within the imports' span)."""
    if key.startswith(names.IMPORTS_PREFIX):
        return "import " + key.removeprefix(names.IMPORTS_PREFIX).removesuffix("_s")
    return key.removeprefix("startup/").removesuffix("_s")


def table(summaries: list[Summary]) -> str:
    head = (
        "| example | pairs | side | whole process s | CPU s | first step s | to target s (reached) | epochs to target "
        "| final |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for s in summaries:
        for side in SIDES:
            f = s.sides[side]
            rows.append(
                f"| {s.example} | {s.pairs} | {side} | {_s(f['wall_s'])} | {_s(f['cpu_s'])} | "
                f"{_s(f['first_step_s'])} | {_s(f['to_target_s'])} ({f['reached']}/{s.pairs}) | "
                f"{_s(f['epochs_to_target'])} | {_s(f['final'], 4)} |"
            )
    ratio_head = (
        "\n| example | whole process, saturate / reference | to target | epochs to target | first step | per epoch "
        "| CPU s | load1 |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    ratio_rows = [
        f"| {s.example} | {s.ratio['wall_s'].text()} | {s.ratio['to_target_s'].text()} | "
        f"{s.ratio['epochs_to_target'].text()} | "
        f"{s.ratio['first_step_s'].text()} | {s.ratio['per_epoch_s'].text()} | {s.ratio['cpu_s'].text()} | "
        f"{_s(s.load[0])}-{_s(s.load[1])} |"
        for s in summaries
    ]
    itself_head = (
        "\n| example | to target, saturate against itself | the reference against itself | whole process, saturate "
        "against itself | the reference against itself |\n"
        "|---|---|---|---|---|\n"
    )
    itself_rows = [
        f"| {s.example} | " + " | ".join(s.itself[(side, f)].text() for f in ITSELF for side in SIDES) + " |"
        for s in summaries
    ]
    startup = [
        f"{s.example}: saturate's start-up (median s): "
        + ", ".join(f"{_span(k)} {v:.2f}" for k, v in s.startup.items())
        for s in summaries
        if s.startup
    ]
    failed = [f"{s.example}: {s.failed} pair(s) left out (a side exited non-zero)" for s in summaries if s.failed]
    ratio_part = ratio_head + "\n".join(ratio_rows) + "\n" + itself_head + "\n".join(itself_rows)
    return head + "\n".join(rows) + "\n" + ratio_part + "\n\n" + "\n".join(startup + failed)


# ---------------------------------------------------------------- the command


def summarize_file(path: Path, at: float | None) -> int:
    """--summarize: the tables of a results file, its runs read again (reread); with `at`,
    the time to that value, each example's metric named first."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    summaries = summarize([reread(r, at) for r in records])
    for s in summaries if at is not None else ():
        spec = EXAMPLES.get(s.example)
        if spec is None:
            print(f"{s.example}: not an example of this bench: no time to {at:g}")
            continue
        sign = ">=" if spec.better == "max" else "<="
        print(f"{s.example}: to target is to {spec.metric} {sign} {at:g} (its own: {spec.value:g})")
    print(table(summaries))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", default=",".join(EXAMPLES), help="comma-separated names")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--first-pair", type=int, default=1, help="the first pair's number (to add pairs to a file)")
    parser.add_argument("--author-scripts", type=Path, default=None, help="DIR/<name>/reference.py for the unshipped")
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for both sides (0: unset)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_examples")
    parser.add_argument("--results", type=Path, default=None, help="append one JSON line per run (default: OUT/...)")
    parser.add_argument("--quick", action="store_true", help="one short pair per example (a test)")
    parser.add_argument(
        "--seeds", action="store_true", help="pair N trains with seed N on both sides (default: each side's own seed)"
    )
    parser.add_argument("--summarize", type=Path, default=None, help="print the tables of a results file and exit")
    parser.add_argument("--at", type=float, default=None, help="with --summarize: the time to this value of the metric")
    args = parser.parse_args(argv)
    if args.at is not None and not args.summarize:
        parser.error("--at VALUE: only with --summarize FILE (a run times the example's own target)")
    if args.summarize:
        return summarize_file(args.summarize, args.at)
    names = [n for n in args.examples.split(",") if n]
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        parser.error(f"unknown example(s) {', '.join(unknown)}; known: {', '.join(EXAMPLES)}")
    pairs = 1 if args.quick else args.pairs
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results = args.results or args.out / f"results-{stamp}.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    records = []
    for name in names:
        spec, script = EXAMPLES[name], reference_script(name, args.author_scripts)
        if script is None:
            print(f"{name}: no reference (examples/{name}/REFERENCE.md says how to make one; --author-scripts DIR)")
            continue
        for pair in range(args.first_pair, args.first_pair + pairs):
            order = SIDES if pair % 2 else SIDES[::-1]
            for side in order:
                out = args.out / stamp / f"{name}-{pair}-{side}"
                out.mkdir(parents=True, exist_ok=True)
                seed = pair if args.seeds else None
                r = (
                    run_saturate(name, spec, out, args, seed)
                    if side == "saturate"
                    else run_reference(name, spec, script, out, args, seed)
                )
                r.update(example=name, pair=pair, side=side, threads=args.threads or "unset", quick=args.quick)
                r.update(seed=seed)
                records.append(r)
                with open(results, "a") as f:
                    f.write(json.dumps(r) + "\n")
                print(
                    f"{name} pair {pair} {side}: rc {r['rc']}, wall {r['wall_s']:.1f} s, first step "
                    f"{_s(r['first_step_s'])} s, to target {_s(r['to_target_s'])} s, final {_s(r['final'], 4)}",
                    flush=True,
                )
    print(f"\nresults: {results}\n")
    print(table(summarize(records)))
    return 0 if records and all(r["rc"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
