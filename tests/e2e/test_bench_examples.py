"""scripts/bench_examples.py: its summary (ratios, medians, 80th percentiles) from recorded
runs and its reading of a reference's BENCH lines, without running anything; and (slow) its
quick mode on the references this repository ships (har, pm25 and forecast, MIT)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from scripts.bench_examples import (
    EXAMPLES,
    main,
    parse_reference,
    percentile,
    read_saturate,
    reference_command,
    reread,
    run_process,
    saturate_command,
    summarize,
    table,
)
from tests.conftest import ROOT, TINY, compose_config

REFERENCE_LOG = """\
Training on CPU
BENCH first_step t=3.512
2026-11-27 07:11:40.123 | DEBUG | models - epoch:1/15 step=100
BENCH eval t=6.001 epoch=1 step=19 val_acc=0.4100 val_loss=1.20000
BENCH eval t=9.250 epoch=2 step=38 val_acc=0.6600 val_loss=0.90000
BENCH eval t=12.500 epoch=3 step=57 val_acc=0.6400 val_loss=0.95000
BENCH target val_acc>=0.65 t=9.250 epoch=2 step=38
BENCH final test_acc=0.7125 test_f1_macro=0.7000 test_n=384 last_val_acc=0.6400 best_val_acc=0.6600 t_end=13.1
"""


def test_the_references_lines_give_first_step_time_to_target_and_final_metric():
    got = parse_reference(REFERENCE_LOG, EXAMPLES["har"])
    assert got["first_step_s"] == pytest.approx(3.512)
    assert got["evals"] == [(6.001, 0.41), (9.25, 0.66), (12.5, 0.64)]
    assert got["to_target_s"] == pytest.approx(9.25)  # the first evaluation at or above 0.65
    assert got["final"] == pytest.approx(0.7125)  # test_acc from the final line


def test_epochs_to_target_are_where_each_side_met_it():
    """The reference's: its step there over the steps in an epoch (its last evaluation's), or
    its epoch where its lines print none; saturate's: its target step over its steps an epoch."""
    assert parse_reference(REFERENCE_LOG, EXAMPLES["har"])["epochs_to_target"] == pytest.approx(2.0)  # 38 / 19
    inside = "BENCH eval t=4.0 step=9 epoch=1 val_dice=0.5\nBENCH eval t=6.0 step=12 epoch=1 val_dice=0.75\n"
    inside += "BENCH eval t=8.0 step=30 epoch=2 val_dice=0.8\n"  # 15 steps an epoch, met at step 12
    assert parse_reference(inside, EXAMPLES["segmentation"])["epochs_to_target"] == pytest.approx(0.8)
    epochs_only = "BENCH eval t=5.0 epoch=1 val_ter=0.2\nBENCH eval t=8.0 epoch=2 val_ter=0.04\n"
    assert parse_reference(epochs_only, EXAMPLES["sign"])["epochs_to_target"] == 2.0
    assert math.isnan(parse_reference("BENCH eval t=5.0 epoch=1 val_ter=0.2\n", EXAMPLES["sign"])["epochs_to_target"])
    metrics = {"progress/step": 400, "progress/epoch": 40.0, "progress/target_step": 210.0}
    assert read_saturate(metrics, EXAMPLES["mixup"])["epochs_to_target"] == pytest.approx(21.0)
    assert math.isnan(
        read_saturate({"progress/step": 400, "progress/epoch": 40.0}, EXAMPLES["mixup"])["epochs_to_target"]
    )


def test_lines_after_a_progress_bar_are_read():
    log = "Epoch 1/1:   7%|  | 16/240 [00:00<00:05, 38.21img/s]BENCH first_step t=6.019\n"
    log += "Epoch 1/1:  20%|  | 48/240 [00:01<00:05]BENCH eval t=6.809 step=3 epoch=1 val_dice=0.7568\n"
    got = parse_reference(log, EXAMPLES["segmentation"])
    assert got["first_step_s"] == pytest.approx(6.019) and got["to_target_s"] == pytest.approx(6.809)


def test_a_lower_is_better_target_and_a_reference_that_never_reached_it():
    log = "BENCH eval t=5.0 epoch=1 val_ter=0.2000\nBENCH eval t=8.0 epoch=2 val_ter=0.0400\n"
    assert parse_reference(log, EXAMPLES["sign"])["to_target_s"] == pytest.approx(8.0)
    never = parse_reference("BENCH eval t=5.0 epoch=1 val_ter=0.2000\n", EXAMPLES["sign"])
    assert math.isnan(never["to_target_s"]) and math.isnan(never["first_step_s"])
    assert never["final"] == pytest.approx(0.2)  # no final line: the last evaluation


def test_saturates_side_is_read_from_metrics_json():
    metrics = {"time/first_step_s": 4.2, "time/to_target_s": 11.0, "test/acc": 0.93, "startup/data_s": 0.1}
    metrics |= {"imports/torchmetrics_s": 0.9}
    metrics |= {"time/eval_at_s": 34.2, "progress/epoch": 15.0}
    got = read_saturate(metrics, EXAMPLES["har"])
    assert (got["first_step_s"], got["to_target_s"], got["final"]) == (4.2, 11.0, 0.93)
    assert got["per_epoch_s"] == pytest.approx(2.0)  # (34.2 - 4.2) / 15
    assert got["startup"] == {"startup/data_s": 0.1, "imports/torchmetrics_s": 0.9}
    assert math.isnan(read_saturate({}, EXAMPLES["har"])["to_target_s"])  # target never met
    assert math.isnan(read_saturate({}, EXAMPLES["har"])["per_epoch_s"])


def test_time_per_epoch_is_from_the_first_step_to_the_last_evaluation_on_both_sides():
    """The figure for runs that stop early (pm25: each side's early stopping ends at its own
    epoch, so whole-process time compares epoch counts): the end of the first step to the end
    of the last evaluation, over the epochs trained, the same span on both sides."""
    got = parse_reference(REFERENCE_LOG, EXAMPLES["har"])
    assert got["per_epoch_s"] == pytest.approx((12.5 - 3.512) / 3)
    inside = "BENCH first_step t=2.0\nBENCH eval t=4.0 step=3 epoch=1 val_dice=0.5\n"
    inside += "BENCH eval t=8.0 step=30 epoch=2 val_dice=0.6\n"  # evaluations inside the epoch: the last one's
    assert parse_reference(inside, EXAMPLES["segmentation"])["per_epoch_s"] == pytest.approx(3.0)
    assert math.isnan(parse_reference("BENCH eval t=5.0 val_ter=0.2\n", EXAMPLES["sign"])["per_epoch_s"])


def test_percentile_is_numpys_linear_one():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2, 3, 4, 5], 80) == pytest.approx(4.2)
    assert percentile([10.0], 80) == 10.0
    assert percentile([1.0, math.nan, 3.0], 50) == 2.0
    assert math.isnan(percentile([], 50))


def _side(example, pair, side, wall, first, target, final=0.9, rc=0, load=3.0):
    return dict(
        example=example,
        pair=pair,
        side=side,
        wall_s=wall,
        cpu_s=wall / 2,
        first_step_s=first,
        to_target_s=target,
        final=final,
        rc=rc,
        load1=load,
        startup={"startup/data_s": 0.5, "imports/torch_s": 1.2} if side == "saturate" else {},
        per_epoch_s=1.0 if side == "saturate" else 2.0,
        epochs_to_target=target / (1.0 if side == "saturate" else 2.0),
    )


def test_the_summary_pairs_the_sides_and_takes_ratios_median_p80_and_spread():
    walls = [(20, 25), (22, 20), (30, 30), (18, 24), (26, 20)]  # (saturate, reference) per pair
    records = []
    for pair, (sat, ref) in enumerate(walls, 1):
        records += [
            _side("har", pair, "saturate", sat, 4.0, sat / 2),
            _side("har", pair, "reference", ref, 2.0, ref / 2),
        ]
    records += [_side("har", 6, "saturate", 99, 4.0, 50, rc=1), _side("har", 6, "reference", 20, 2.0, 10)]
    records.append(_side("har", 7, "saturate", 20, 4.0, 10))  # no reference side: left out
    (s,) = summarize(records)
    assert s.pairs == 5 and s.failed == 1
    ratios = sorted(sat / ref for sat, ref in walls)  # 0.75 0.8 1.0 1.1 1.3
    assert s.ratio["wall_s"].median == pytest.approx(ratios[2])
    assert s.ratio["wall_s"].p80 == pytest.approx(ratios[3] + 0.2 * (ratios[4] - ratios[3]))
    assert (s.ratio["wall_s"].low, s.ratio["wall_s"].high) == (pytest.approx(0.75), pytest.approx(1.3))
    assert s.ratio["cpu_s"].median == pytest.approx(ratios[2])  # cpu_s is wall_s / 2 on both sides
    assert s.ratio["first_step_s"].median == pytest.approx(2.0)
    assert s.ratio["per_epoch_s"].median == pytest.approx(0.5)  # saturate's 1.0 s an epoch, the reference's 2.0
    # each side's time to target over its time an epoch: saturate's path to the target twice the reference's
    assert s.ratio["epochs_to_target"].median == pytest.approx(2 * ratios[2])
    assert s.sides["saturate"]["wall_s"] == 22 and s.sides["reference"]["wall_s"] == 24
    assert s.startup == {"startup/data_s": 0.5, "imports/torch_s": 1.2}


def test_each_side_against_itself_is_its_own_runs_over_each_other_in_every_order():
    """The spread a ratio has when the command is the same on both sides: each side's figure in
    one pair over its figure in every other pair, both orders (so its median is about 1)."""
    targets = [(10.0, 8.0), (12.0, 10.0), (15.0, math.nan), (11.0, 9.0)]  # (saturate, reference) per pair
    records = []
    for pair, (sat, ref) in enumerate(targets, 1):
        records += [_side("mixup", pair, "saturate", 20, 4, sat), _side("mixup", pair, "reference", 25, 3, ref)]
    (s,) = summarize(records)
    sat = [10.0, 12.0, 15.0, 11.0]
    expected = sorted(a / b for i, a in enumerate(sat) for j, b in enumerate(sat) if i != j)
    mine = s.itself[("saturate", "to_target_s")]
    assert mine.n == 12 and mine.median == pytest.approx(percentile(expected, 50)) and 1 <= mine.median < 1.01
    assert mine.p80 == pytest.approx(percentile(expected, 80)) and mine.high == pytest.approx(1.5)
    ref = s.itself[("reference", "to_target_s")]  # the run that missed the target is left out: 3 runs, 6 ratios
    assert ref.n == 6 and ref.high == pytest.approx(10 / 8) and ref.low == pytest.approx(8 / 10)
    assert s.itself[("reference", "wall_s")].n == 12 and s.itself[("reference", "wall_s")].p80 == pytest.approx(1.0)
    out = table([s])
    assert "| mixup | " + mine.text() + " | " + ref.text() + " |" in out


def test_a_pair_where_one_side_missed_the_target_has_no_target_ratio():
    records = [_side("sign", 1, "saturate", 20, 4, math.nan), _side("sign", 1, "reference", 20, 4, 10)]
    records += [_side("sign", 2, "saturate", 20, 4, 12), _side("sign", 2, "reference", 20, 4, 10)]
    (s,) = summarize(records)
    assert s.ratio["to_target_s"].n == 1 and s.ratio["to_target_s"].median == pytest.approx(1.2)
    assert s.sides["saturate"]["reached"] == 1 and s.sides["reference"]["reached"] == 2


def test_summarize_prints_the_tables_of_a_results_file(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    rows = [_side("har", 1, "saturate", 20, 4, 10), _side("har", 1, "reference", 25, 3, 12)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["--summarize", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| har | 1 | saturate | 20.0 | 10.0 | 4.0 | 10.0 (1/1) | 10.0 | 0.9000 |" in out
    assert "0.80 (p80 0.80, 0.80-0.80, n=1)" in out  # whole process 20 / 25
    assert "0.50 (p80 0.50, 0.50-0.50, n=1)" in out  # per epoch 1.0 / 2.0
    assert "har: saturate's start-up (median s): data 0.50, import torch 1.20" in out
    rows[0].pop("per_epoch_s")  # a file recorded before the figures existed: still summarised
    rows[0].pop("epochs_to_target")
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["--summarize", str(path)]) == 0


def test_recorded_runs_are_read_again_from_their_files_where_these_are_still_there(tmp_path, capsys):
    """--summarize rereads each side's own files (the reference's log, saturate's
    metrics.json beside its log): a figure added since a run was recorded is still had."""
    (tmp_path / "sat" / "run").mkdir(parents=True)
    (tmp_path / "ref").mkdir()
    metrics = {"time/first_step_s": 4.0, "time/eval_at_s": 34.0, "progress/epoch": 15.0, "test/acc": 0.9}
    (tmp_path / "sat" / "run" / "metrics.json").write_text(json.dumps(metrics))
    (tmp_path / "ref" / "reference.log").write_text(REFERENCE_LOG)
    rows = [_side("har", 1, "saturate", 20, 4, 10), _side("har", 1, "reference", 25, 3, 12)]
    rows[0]["log"], rows[1]["log"] = str(tmp_path / "sat" / "saturate.log"), str(tmp_path / "ref" / "reference.log")
    (tmp_path / "sat" / "saturate.log").write_text("")
    for row in rows:
        row.pop("per_epoch_s")
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["--summarize", str(path)]) == 0
    ratio = 2.0 / ((12.5 - 3.512) / 3)  # (34 - 4) / 15 against the log's three epochs
    assert f"| {ratio:.2f} (p80 {ratio:.2f}, {ratio:.2f}-{ratio:.2f}, n=1) |" in capsys.readouterr().out


def _recorded(tmp_path, side: str, example: str = "har") -> dict:
    """A recorded run of `side` whose files are under tmp_path/side (saturate's run in run/)."""
    folder = tmp_path / side
    (folder / "run").mkdir(parents=True, exist_ok=True)
    log = folder / f"{side}.log"
    if not log.exists():
        log.write_text(REFERENCE_LOG if side == "reference" else "")
    return _side(example, 1, side, 20, 4, 10) | {"log": str(log)}


def test_at_another_value_both_sides_are_timed_from_their_own_evaluations(tmp_path, capsys):
    """--at: the reference's time from its BENCH eval lines, saturate's from its TensorBoard
    file (time/eval_at_s and the metric paired by step: the first value a step has, as the
    run's own target reads it); a run whose files are gone has no time to it."""
    from torch.utils.tensorboard import SummaryWriter

    sat, ref = _recorded(tmp_path, "saturate"), _recorded(tmp_path, "reference")
    run = tmp_path / "saturate" / "run"
    metrics = {"time/first_step_s": 4.0, "time/eval_at_s": 34.0, "progress/epoch": 3.0, "progress/step": 30}
    metrics |= {"time/to_target_s": 24.0, "progress/target_step": 20.0, "test/acc": 0.9}
    (run / "metrics.json").write_text(json.dumps(metrics))
    with SummaryWriter(str(run)) as writer:
        for step, t, acc in ((10, 14.0, 0.5), (20, 24.0, 0.7), (30, 34.0, 0.8)):
            writer.add_scalar("val/acc", acc, step)
            writer.add_scalar("time/eval_at_s", t, step)
        writer.add_scalar("val/acc", 0.1, 30)  # a second value at a step: not the evaluation's
        writer.add_scalar("val/acc", 0.95, 35)  # a step without its time, and a time without its value:
        writer.add_scalar("time/eval_at_s", 40.0, 40)  # paired by step, neither is an evaluation met at 40 s
    got = reread(sat, at=0.75)
    assert got["to_target_s"] == pytest.approx(34.0) and got["epochs_to_target"] == pytest.approx(3.0)
    assert reread(sat, at=0.65)["to_target_s"] == pytest.approx(24.0)  # the run's own figure, recomputed
    assert math.isnan(reread(sat, at=0.9)["to_target_s"]) and math.isnan(reread(sat, at=0.9)["epochs_to_target"])
    assert reread(sat)["to_target_s"] == 24.0  # without --at: metrics.json's
    assert reread(ref, at=0.6)["to_target_s"] == pytest.approx(9.25)  # the log's second evaluation (0.66)
    assert reread(ref, at=0.5)["to_target_s"] == pytest.approx(9.25) and reread(ref, at=0.4)["to_target_s"] == 6.001
    gone = sat | {"log": str(tmp_path / "elsewhere" / "saturate.log")}
    assert math.isnan(reread(gone, at=0.75)["to_target_s"]) and reread(gone)["to_target_s"] == 10
    (run / "metrics.json").rename(run / "kept.json")
    assert math.isnan(reread(sat, at=0.75)["to_target_s"])
    (run / "kept.json").rename(run / "metrics.json")
    (events,) = run.glob("events.out.tfevents.*")
    events.rename(tmp_path / events.name)  # metrics.json without its evaluations: none, not its own target's time
    assert math.isnan(reread(sat, at=0.65)["to_target_s"]) and reread(sat)["to_target_s"] == 24.0
    (tmp_path / events.name).rename(events)
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(sat) + "\n" + json.dumps(ref) + "\n")
    assert main(["--summarize", str(path), "--at", "0.75"]) == 0
    out = capsys.readouterr().out
    assert "har: to target is to val/acc >= 0.75 (its own: 0.65)" in out
    assert "| har | 1 | saturate | 20.0 | 10.0 | 4.0 | 34.0 (1/1) |" in out
    assert "| har | 1 | reference | 20.0 | 10.0 | 3.5 | - (0/1) |" in out  # the log's best is 0.66
    other = _side("old_name", 1, "saturate", 20, 4, 10) | {"log": sat["log"]}  # an example since renamed
    path.write_text(json.dumps(other) + "\n")
    assert main(["--summarize", str(path), "--at", "0.75"]) == 0
    assert "old_name: not an example of this bench: no time to 0.75" in capsys.readouterr().out
    assert math.isnan(reread(other, at=0.75)["to_target_s"]) and reread(other)["to_target_s"] == 10
    with pytest.raises(SystemExit):
        main(["--at", "0.75"])  # a run times the example's own target
    assert "--at VALUE: only with --summarize FILE" in capsys.readouterr().err


def test_at_the_runs_own_target_a_real_runs_evaluations_give_its_recorded_time(tmp_path):
    """A saturate run's TensorBoard file, read back: the time and step at which it first met
    its own target are what its metrics.json recorded."""
    import saturate

    sat = _recorded(tmp_path, "saturate")
    run = tmp_path / "saturate" / "run"
    overrides = [*TINY, "trainer.max_epochs=2", f"run_dir={run}", "target.metric=val/acc", "target.value=0.0"]
    saturate.train(compose_config(overrides))
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["time/to_target_s"] > 0 and metrics["progress/target_step"] == 3  # the first evaluation
    got = reread(sat, at=0.0)
    assert got["to_target_s"] == pytest.approx(metrics["time/to_target_s"], rel=1e-6)  # float32 in the file
    assert got["epochs_to_target"] == pytest.approx(1.0)
    assert math.isnan(reread(sat, at=1.01)["to_target_s"])


def test_with_seeds_pair_n_trains_both_sides_with_seed_n_and_without_each_keeps_its_own(tmp_path):
    """Time to a target depends on the seed (the U-Net reference met Dice 0.7 between 27.0 and
    50.6 s over seeds 1-5): --seeds gives pair N seed N on both sides."""
    spec, script = EXAMPLES["har"], ROOT / "examples" / "har" / "reference.py"
    seeded = saturate_command("har", spec, tmp_path, quick=False, seed=3)
    assert seeded[-1] == "trainer.seed=3" and f"hydra.run.dir={tmp_path}" in seeded
    assert reference_command(spec, script, tmp_path, quick=False, seed=3)[-2:] == ["--seed", "3"]
    own = saturate_command("har", spec, tmp_path, quick=False, seed=None)
    assert not any(a.startswith("trainer.seed") for a in own) and own == seeded[:-1]
    assert "--seed" not in reference_command(spec, script, tmp_path, quick=False, seed=None)


def test_every_example_has_a_shipped_reference_or_says_how_to_make_one():
    for name in EXAMPLES:
        folder = ROOT / "examples" / name
        assert folder.is_dir(), name
        assert (folder / "reference.py").exists() or (folder / "REFERENCE.md").exists(), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, final_range",
    # har: test accuracy; pm25: test RMSE in µg/m³; forecast: the last validation MSE
    [("har", (0, 1)), ("pm25", (0, 1000)), ("forecast", (0, 1))],
)
def test_the_quick_bench_runs_both_sides_of_a_shipped_reference(tmp_path, name, final_range):
    assert (ROOT / "examples" / name / "reference.py").is_file()  # shipped: no --author-scripts below
    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_examples.py"), "--quick", "--examples", name]
    cmd += ["--threads", "1", "--out", str(tmp_path), "--results", str(results)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted(r["side"] for r in records) == ["reference", "saturate"]
    for r in records:
        assert r["rc"] == 0 and r["wall_s"] > 0 and 0 < r["first_step_s"] < r["wall_s"], r
        assert final_range[0] < r["final"] < final_range[1], r
    sat = next(r for r in records if r["side"] == "saturate")
    assert f"target.metric={EXAMPLES[name].metric}" in sat["command"] and sat["startup"], sat
    assert f"| {name} | 1 | saturate |" in done.stdout


def test_both_sides_run_with_pythons_compiled_module_cache(tmp_path, monkeypatch):
    """A project machine's PYTHONDONTWRITEBYTECODE=1 is not passed on: no side compiles its modules on every start."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    code = "import os, sys; print(os.environ.get('PYTHONDONTWRITEBYTECODE'), sys.dont_write_bytecode)"
    record = run_process([sys.executable, "-c", code], tmp_path, tmp_path / "log", threads=1)
    assert record["rc"] == 0 and (tmp_path / "log").read_text().split() == ["None", "False"]
