"""Time to target (target.metric, target.value, target.stop) and where the time to the first
step went (startup/*): recorded in metrics.json, TensorBoard and the report."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import saturate
from saturate import names
from saturate.errors import ConfigError
from saturate.loop.target import Target
from tests.conftest import read_metrics, run_cli

EPOCHS = ["trainer.max_epochs=3", "trainer.limit_train_batches=-1", "trainer.limit_val_batches=-1"]


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def test_the_time_an_evaluation_first_met_the_target_is_in_metrics_tensorboard_and_the_report(make_cfg):
    cfg = make_cfg(*EPOCHS, "target.metric=val/acc", "target.value=0.5")
    metrics = saturate.train(cfg)
    on_disk = read_metrics(cfg.run_dir)
    evaluations = scalars(cfg.run_dir, names.EVAL_AT_S)
    # 1,400 digits, batch 32, drop_last: 44 steps an epoch (the final metrics repeat the last at the end)
    assert sorted({step for step, _ in evaluations}) == [44, 88, 132]
    reached = scalars(cfg.run_dir, names.TO_TARGET_S)
    assert len(reached) == 1 and reached[0][0] == on_disk[names.TO_TARGET_STEP]
    # met at an evaluation: its time is that evaluation's time, after the first step
    assert (reached[0][0], pytest.approx(reached[0][1])) in [(s, pytest.approx(v)) for s, v in evaluations]
    assert on_disk[names.FIRST_STEP_S] < on_disk[names.TO_TARGET_S] == pytest.approx(reached[0][1])
    assert metrics[names.TO_TARGET_S] == on_disk[names.TO_TARGET_S]
    report = (Path(cfg.run_dir) / "report.md").read_text()
    assert f"target val/acc >= 0.5: met {on_disk[names.TO_TARGET_S]:.1f} s after the start" in report
    assert on_disk["status"] == "completed" and "stopped_early" not in on_disk  # target.stop is off


def test_target_stop_ends_the_run_at_the_evaluation_that_met_it(make_cfg):
    cfg = make_cfg(*EPOCHS, "target.metric=val/loss", "target.value=5.0", "target.stop=true")
    saturate.train(cfg)  # any first evaluation's loss is below 5
    on_disk = read_metrics(cfg.run_dir)
    assert on_disk[names.TO_TARGET_STEP] == 44 and on_disk[names.STEP] == 44
    assert on_disk["stopped_early"] == "target val/loss <= 5 met" and on_disk["status"] == "completed"
    assert {p.name for p in (Path(cfg.run_dir) / "checkpoints").iterdir()} >= {"last.pt", "best.pt"}


def test_a_target_not_met_is_said_and_has_no_time(make_cfg):
    cfg = make_cfg("target.metric=val/acc", "target.value=1.01")
    saturate.train(cfg)
    on_disk = read_metrics(cfg.run_dir)
    assert names.TO_TARGET_S not in on_disk and not scalars(cfg.run_dir, names.TO_TARGET_S)
    assert (
        f"target val/acc >= 1.01: not met (last {on_disk['val/acc']:.4f})"
        in (Path(cfg.run_dir) / "report.md").read_text()
    )


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (
            ["target.metric=val/f1", "target.value=0.9"],
            "target.metric",
            "a metric an evaluation logs: val/loss, val/acc",
        ),
        (["target.value=0.9"], "target.metric", "the metric target.value=0.9 is for"),
        (["target.metric=val/acc"], "target.value", "the value of val/acc to reach"),
        (["target.stop=true"], "target.stop", "with target.metric and target.value set"),
        (["target.metric=train/loss", "target.value=0.1"], "target.metric", "a metric an evaluation logs"),
    ],
)
def test_a_target_that_cannot_be_met_is_refused_before_training(make_cfg, overrides, key, allowed):
    with pytest.raises(ConfigError) as raised:
        saturate.train(make_cfg(*overrides))
    assert key in str(raised.value) and allowed in str(raised.value)


def test_a_target_is_met_once_in_its_direction_and_never_by_nan():
    lower = Target("val/loss", 0.5, "min")
    assert not lower.met({"val/loss": math.nan}, 10, 1.0)
    assert not lower.met({"val/loss": 0.6}, 20, 2.0)
    assert lower.met({"val/loss": 0.5}, 30, 3.0)
    assert not lower.met({"val/loss": 0.1}, 40, 4.0)  # the first time is kept
    assert lower.metrics() == {names.TO_TARGET_S: 3.0, names.TO_TARGET_STEP: 30.0}
    higher = Target("val/acc", 0.9, "max")
    assert not higher.met({"val/acc": 0.89}, 1, 1.0) and higher.met({"val/acc": 0.95}, 2, 2.0)


def test_the_start_up_spans_add_up_to_the_first_step_and_the_report_names_them(tmp_path):
    import torch
    from sklearn.datasets import load_digits
    from torch import nn

    digits = load_digits()
    x, y = torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target)
    data = list(zip(x, y, strict=True))
    saturate.fit(
        lambda: nn.Linear(64, 10), data[:1400], data[1400:], overrides=["trainer.max_epochs=1"], run_dir=tmp_path
    )
    on_disk = read_metrics(tmp_path)
    spans = {k: v for k, v in on_disk.items() if k.startswith("startup/")}
    assert set(spans) >= {"startup/data_s", "startup/model_and_its_checks_s", "startup/optimizer_s"}
    assert "startup/interpreter_and_imports_s" not in spans  # saturate.fit: from the call
    assert all(v >= 0 for v in spans.values())
    assert sum(spans.values()) == pytest.approx(on_disk[names.FIRST_STEP_S], rel=1e-6)
    assert on_disk[names.FIRST_STEP_S] < on_disk[names.WALL_S]
    report = (tmp_path / "report.md").read_text()
    assert f"- start-up: {on_disk[names.FIRST_STEP_S]:.1f} s to the end of the first step" in report


PROCESS_SPANS = ["startup/interpreter_s", "startup/hydra_s", "startup/imports_s"]


@pytest.mark.slow
def test_train_py_counts_the_interpreter_hydra_and_the_imports(tmp_path):
    args = ["trainer.max_epochs=1", "trainer.progress=false", f"hydra.run.dir={tmp_path / 'run'}"]
    done = run_cli(*args, cwd=tmp_path, fresh=True)  # its own imports, timed
    assert done.returncode == 0, done.stderr[-2000:]
    on_disk = read_metrics(tmp_path / "run")
    assert set(PROCESS_SPANS) <= set(on_disk)
    assert on_disk["startup/imports_s"] > 0.1  # torch alone takes longer to import
    assert "startup/interpreter_and_imports_s" not in on_disk
    spans = sum(v for k, v in on_disk.items() if k.startswith("startup/"))
    assert spans == pytest.approx(on_disk[names.FIRST_STEP_S], rel=1e-6)
    # the heavy dependencies task() imports, each timed, within the imports' span
    imports = {k: v for k, v in on_disk.items() if k.startswith(names.IMPORTS_PREFIX)}
    assert {"imports/torch_s", "imports/torchmetrics_s"} <= set(imports)
    assert all(v > 0 for v in imports.values())
    assert sum(imports.values()) < on_disk["startup/imports_s"]
    said = f"interpreter {on_disk['startup/interpreter_s']:.2f} s, hydra {on_disk['startup/hydra_s']:.2f} s, "
    said += f"imports {on_disk['startup/imports_s']:.2f} s (torch {imports['imports/torch_s']:.2f} s"
    assert said in (tmp_path / "run" / "report.md").read_text()  # in the order they ran


def test_train_py_names_hydras_share_of_the_start_up(tmp_path):
    """Hydra's work between train.py's call and the task (the config composed twice, the run
    dir, its logging) is a span of its own, between the interpreter's and the imports'."""
    args = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.progress=false"]
    done = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    on_disk = read_metrics(tmp_path / "run")
    assert set(PROCESS_SPANS) <= set(on_disk) and "startup/interpreter_and_imports_s" not in on_disk
    assert on_disk["startup/hydra_s"] > 0.05  # two compositions of conf/ take longer
    assert all(on_disk[k] >= 0 for k in PROCESS_SPANS)
    spans = sum(v for k, v in on_disk.items() if k.startswith("startup/"))
    assert spans == pytest.approx(on_disk[names.FIRST_STEP_S], rel=1e-6)
    line = next(x for x in (tmp_path / "run" / "report.md").read_text().splitlines() if x.startswith("- start-up:"))
    # the line names spans of 0.05 s and more: here (torch imported by the zygote) the imports' may be less
    shown = [name for name in ("interpreter", "hydra", "imports") if on_disk[f"startup/{name}_s"] >= 0.05]
    at = [line.index(f"{name} {on_disk[f'startup/{name}_s']:.2f} s") for name in shown]
    assert at == sorted(at)  # named (index raises if not), in the order they ran; all three: the fresh-interpreter test


def test_the_process_is_split_where_both_points_came_in_order_and_else_is_one_span(monkeypatch):
    """A process that did not come through train.py's app (the user's own `@hydra.main` calling
    saturate.train), or that was forked after those points were taken: one span, as before."""
    import time

    from saturate import started
    from saturate.diagnostics import timing

    now = time.perf_counter()
    cases = [
        ({"main": now - 0.3, "task": now - 0.1}, [names.INTERPRETER_SPAN, names.HYDRA_SPAN, names.IMPORTS_SPAN]),
        ({}, [names.PROCESS_SPAN]),
        ({"main": now - 1.0}, [names.PROCESS_SPAN]),
        ({"main": now - 0.1, "task": now - 0.3}, [names.PROCESS_SPAN]),  # out of order
        ({"main": now + 5.0, "task": now + 6.0}, [names.PROCESS_SPAN]),  # after the run began
        ({"main": timing.process_origin(now - started.process_age()) - 1.0, "task": now - 0.1}, [names.PROCESS_SPAN]),
    ]  # the last: before the process began (a process forked after train.py's call)
    for reached, expected in cases:
        monkeypatch.setattr(timing.Startup, "runs", 0)
        for point in ("main", "task"):
            monkeypatch.delitem(started.REACHED, point, raising=False)
        for point, at in reached.items():
            monkeypatch.setitem(started.REACHED, point, at)
        startup = timing.Startup(from_process=True)
        assert list(startup.spans) == expected, reached
        assert sum(startup.spans.values()) == pytest.approx(startup.last - startup.origin)
        if len(expected) == 3:  # from train.py's call of its app to the task, and from there to the run
            assert startup.spans[names.HYDRA_SPAN] == pytest.approx(0.2)
            assert startup.spans[names.IMPORTS_SPAN] >= 0.1


def test_a_process_that_began_as_a_shell_counts_from_saturates_import():
    """`pip install ... && python train.py` in one shell: bash exec's python, whose process then
    keeps the shell's start time, before pip ran (the first quick-start run said "interpreter
    and imports 76.61 s"). A start more than PROCESS_SLACK_S before saturate's import is not
    the interpreter's: the clock starts at the import."""
    from saturate.diagnostics.timing import process_origin
    from saturate.started import IMPORTED_AT

    assert process_origin(IMPORTED_AT - 76.0) == IMPORTED_AT  # pip install ran first
    assert process_origin(IMPORTED_AT - 0.3) == IMPORTED_AT - 0.3  # the interpreter and Hydra


def test_a_processs_age_is_the_kernels_to_its_clock_tick(tmp_path):
    """The start-up is counted from the process's start as the kernel keeps it (the bench's
    references read theirs the same way), not from psutil's create_time: on Linux that one
    counts from a boot time in whole seconds, so every process on a machine looked up to a
    second older than it was (0.26 s on the machine that found it, added to every time since
    the start: the first step, each evaluation, the target)."""
    import subprocess
    import sys
    import time

    code = "from saturate.started import process_age; print(process_age())"
    before = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    lived = time.perf_counter() - before  # from before the fork to after the exit: longer than the child's age
    age = float(done.stdout)
    assert 0 < age <= lived + 0.011, (age, lived)  # within a clock tick (10 ms) of the kernel's start


def test_import_timed_times_what_it_imports_and_not_what_was_there(tmp_path, monkeypatch):
    import sys

    from saturate.started import IMPORTS, import_timed

    (tmp_path / "slow_to_import_xyz.py").write_text("import time\ntime.sleep(0.05)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import_timed("json", "slow_to_import_xyz")
        assert "slow_to_import_xyz" in sys.modules and "json" not in IMPORTS  # json: imported already
        assert IMPORTS["slow_to_import_xyz"] >= 0.05
    finally:
        IMPORTS.pop("slow_to_import_xyz", None)
        sys.modules.pop("slow_to_import_xyz", None)
