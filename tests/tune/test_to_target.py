"""With a target set, the leading candidates (not only the fastest by samples/s) are each
trained to it over seeds beside the start; one is kept only if it met the target sooner at the
median, and the table says which met it first, at what final value."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from saturate.tune import Result, render
from saturate.tune.rules import changes_numerics, choose_by_target
from tests.conftest import run_cli
from tests.test_tune import scripted_tuner


@pytest.mark.parametrize(
    ("start", "rivals", "first_is_fastest", "chosen"),
    [
        ([10.0, 12.0, 11.0], [[12.0, 13.0, 14.0], [9.0, 10.0, None]], True, 1),  # the second met it sooner
        ([10.0, 12.0, 11.0], [[8.0, 9.0, 9.5], [7.0, 8.0, None]], True, 1),  # both sooner: the soonest
        ([10.0, 12.0, 11.0], [[11.0, 11.0, 11.0]], True, None),  # as soon is not sooner
        ([10.0, 12.0, 11.0], [[None, 5.0, None]], True, None),  # met it with one seed of three
        ([None, None, 30.0], [[30.0, None, None], [None, None, None]], True, 0),  # none at the median: samples/s
        ([None, None, 30.0], [[30.0, None, None]], False, None),  # ... and the start is the fastest
        ([None, 40.0, None], [[None, None, None], [20.0, 25.0, None]], True, 1),
    ],
)
def test_the_candidate_kept_is_the_one_that_met_the_target_soonest_at_the_median(
    start, rivals, first_is_fastest, chosen
):
    assert choose_by_target(start, rivals, first_is_fastest=first_is_fastest) == chosen


def test_batch_size_precision_and_compile_change_the_numerics():
    assert changes_numerics(["loader.batch_size=16"]) and changes_numerics(["precision.mode=amp"])
    assert changes_numerics(["device.threads=1", "trainer.compile=true"])
    assert not changes_numerics(["device.threads=1", "loader.num_workers=2", "trainer.channels_last=true"])


def searched(extra_rows: list[Result]):
    """A tune after its search: the start (100 samples/s), channels_last kept (150), then the
    rows given."""
    tuner = scripted_tuner([])
    tuner.target, tuner.changes = True, ["trainer.channels_last=true"]
    tuner.best = Result(1, ["trainer.channels_last=true"], samples_per_s=150.0, outcome="kept")
    tuner.best.config = ["trainer.channels_last=true"]
    tuner.results += [tuner.best, *extra_rows]
    tuner.speedup, tuner.rate, tuner.confirmed, tuner.searchpath = 1.5, 150.0, True, []
    return tuner


def rows() -> list[Result]:
    threads = Result(2, ["device.threads=1"], samples_per_s=140.0, outcome="no gain")
    threads.config = ["trainer.channels_last=true", "device.threads=1"]
    batch = Result(3, ["loader.batch_size=auto"], samples_per_s=80.0, outcome="slower", batch_size=16)
    batch.config = ["trainer.channels_last=true", "loader.batch_size=auto"]
    workers = Result(4, ["loader.num_workers=1"], samples_per_s=120.0, outcome="slower")
    workers.config = ["trainer.channels_last=true", "loader.num_workers=1"]
    again = Result(5, [], samples_per_s=148.0, outcome="again", config=["trainer.channels_last=true"])
    return [threads, batch, workers, again]


def test_the_leading_candidates_and_one_that_changes_the_numerics_are_run_to_the_target():
    """The fastest kept, the next by samples/s; a smaller batch (fewer samples/s, but perhaps
    sooner to a figure) in place of the third, since none of the others changes the numerics."""
    tuner = searched(rows())
    contenders = [r.config for r in tuner.contenders()]
    assert contenders == [
        ["trainer.channels_last=true"],
        ["trainer.channels_last=true", "device.threads=1"],
        ["trainer.channels_last=true", "loader.batch_size=16"],  # the size its search chose
    ]


def test_a_candidate_other_than_the_fastest_that_met_the_target_sooner_is_kept_and_the_table_says_so():
    tuner = searched(rows())
    tuner.trial.rates = [100.0] * 12
    # per seed: the start, the fastest, threads=1, batch 16
    tuner.trial.to_target = [10.0, 11.0, 10.5, 8.0, 12.0, 12.5, 12.0, 9.0, 11.0, 11.5, None, 9.5]
    finals = iter([0.95, 0.95, 0.95, 0.93] * 3)
    scripted = tuner.trial

    def trial(*args, **kwargs):
        result = scripted(*args, **kwargs)
        result.final = next(finals)
        return result

    tuner.trial = trial
    tuner.to_target()
    batch = ["trainer.channels_last=true", "loader.batch_size=16"]
    assert tuner.changes == batch and tuner.dropped == ["trainer.channels_last=true"]
    assert tuner.to_target_s == [11.0, 11.5, 12.0, 9.0]  # a seed that never met it counts as never
    assert tuner.best is tuner.results[3] and tuner.best.outcome == "soonest to the target"
    assert tuner.speedup == pytest.approx(0.8)  # its samples/s: fewer, and still sooner to the target
    candidates = tuner.target_runs["candidates"]
    assert [c["numerics"] for c in candidates] == [False, False, False, True]
    assert candidates[3]["finals"] == [0.93] * 3 and tuner.target_runs["seeds"] == [5, 6, 7]
    for r in tuner.results:
        r.data_wait, r.verdict = 0.0, "compute-bound"
    table = render(tuner, preset=Path("t.yaml"))
    row = next(line for line in table.splitlines() if line.startswith("| `trainer.channels_last=true loader.batch"))
    assert row == (
        "| `trainer.channels_last=true loader.batch_size=16` | yes | 3 | 9.0 s | 8.0 s, 9.0 s, 9.5 s | 0.93 "
        "| first to the target, kept |"
    )
    assert (
        "First to the target: `trainer.channels_last=true loader.batch_size=16`, median 9.0 s at val/acc 0.93" in table
    )
    assert "1.22x sooner than the starting config" in table
    assert "**Soonest to the target: `trainer.channels_last=true loader.batch_size=16`**" in table


def test_no_candidate_sooner_keeps_the_start():
    tuner = searched(rows())
    tuner.trial.rates = [100.0] * 8
    tuner.trial.to_target = [10.0, 11.0, 10.5, 12.0, 9.0, 11.5, 12.0, 13.0]
    tuner.tune.target_seeds = 2
    tuner.to_target()
    assert tuner.changes == [] and tuner.best is tuner.results[0] and tuner.speedup == 1.0
    assert tuner.dropped == ["trainer.channels_last=true"] and tuner.results[1].outcome == "later to the target"


@pytest.mark.slow
def test_a_tune_with_a_target_trains_its_leading_candidates_to_it_over_seeds(tmp_path):
    """digits with a worker, target val/acc 0.9, two seeds, batch size allowed: the start and
    each contender trained to the target with both seeds, read back from tune.json and each
    run's own record."""
    start = ["data=digits", "loader.num_workers=1", "trainer.max_epochs=10", "trainer.seed=7", "target.metric=val/acc"]
    done = run_cli(
        *start,
        "target.value=0.9",
        "tune=true",
        "tune.budget_s=240",
        "tune.trial_s=0.5",
        "tune.target_seeds=2",
        "tune.allow=[batch_size]",
        f"tune.preset={tmp_path / 'conf' / 'experiment' / 'tuned.yaml'}",
        "tune.cache=",
        "hydra.run.dir=tune",
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "tune" / "tune.json").read_text())
    runs = [r for r in result["results"] if r["outcome"].startswith("to target") or r["seed"] is not None]
    target = result["target_runs"]
    sides = [c["changes"] for c in target["candidates"]]
    assert target["seeds"] == [7, 8] and sides[0] == [] and 2 <= len(sides) <= 4
    assert [(r["config"], r["seed"]) for r in runs] == [(side, seed) for seed in (7, 8) for side in sides]
    for side, median in zip(target["candidates"], result["to_target_s"], strict=True):
        assert side["numerics"] == any(c.startswith(("loader.batch_size", "trainer.compile")) for c in side["changes"])
        met = [t for t in side["times"] if t is not None]
        assert median == (statistics.median(met) if len(met) == 2 else None)
    for run in runs:  # each stopped at the target with its own seed, as its own record says
        folder = next((tmp_path / "tune" / "trials").glob(f"{run['number']:02d}_*_to_target_seed{run['seed']}"))
        record = json.loads((folder / "metrics.json").read_text())
        assert record["time/to_target_s"] == run["to_target_s"] and run["final"] == record["val/acc"]
        assert f"trainer.seed={run['seed']}" in record["overrides"]
    medians = result["to_target_s"]
    sooner = [m for m in medians[1:] if m is not None and (medians[0] is None or m < medians[0])]
    kept = next((i for i, c in enumerate(target["candidates"]) if c["changes"] == result["changes"]), None)
    if sooner:  # the soonest is kept
        assert kept is not None and medians[kept] == min(sooner)
    table = (tmp_path / "tune" / "tune.md").read_text()
    assert "To the target, each trained to it with seeds 7, 8 (trainer.seed)" in table
    assert "| candidate | changes numerics | seeds | to target (median) | per seed | final val/acc (median) |" in table


def test_the_default_budget_gives_the_runs_to_a_target_their_time():
    from saturate.config.schema import validate
    from saturate.errors import ConfigError
    from saturate.tune.trials import budget_s
    from tests.conftest import compose_config

    assert budget_s(compose_config([])) == 120.0
    assert budget_s(compose_config(["target.metric=val/acc", "target.value=0.9"])) == 600.0
    assert budget_s(compose_config(["target.metric=val/acc", "target.value=0.9", "tune.budget_s=90"])) == 90.0
    with pytest.raises(ConfigError, match=r"tune.budget_s='soon': expected a number >= 1.0 or 'auto'"):
        validate(compose_config(["tune.budget_s=soon"]))
