"""Sweeps as real `python train.py -m` subprocesses, read back: run dirs, HParams entries,
the sweep report, and a failing job that does not lose the others."""

from __future__ import annotations

import contextlib
import csv
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import CONF, TINY, python, run_cli
from tests.trainer.test_run import session_hparams

QUICK = [o for o in TINY if not o.startswith(("loader.batch_size", "loader.num_workers"))]


def sweep_dir(cwd):
    (found,) = (cwd / "outputs" / "multirun").glob("*/*")
    return found


@contextlib.contextmanager
def tensorboard(logdir):
    """A real `tensorboard --logdir` server; yields post(route, body) -> JSON of its HParams
    data routes, with the server's address as post.url."""
    with socket.socket() as free:
        free.bind(("localhost", 0))
        port = free.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(logdir),
            "--port",
            str(port),
            "--host",
            "localhost",
            "--reload_interval",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )

    def post(route: str, body: dict):
        request = urllib.request.Request(
            f"http://localhost:{port}/data/plugin/hparams/{route}",
            data=json.dumps(body).encode(),
            headers={"X-XSRF-Protected": "1", "Content-Type": "application/json"},
        )
        return json.loads(urllib.request.urlopen(request, timeout=30).read())

    post.url = f"http://localhost:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://localhost:{port}/data/runs", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, server.stdout.read().decode()[-2000:]
                time.sleep(0.3)
        yield post
    finally:
        server.kill()
        server.wait()


def report(directory):
    return python("-m", "saturate", "sweep-report", directory, timeout=120)


def test_a_sweep_of_four_jobs_leaves_four_runs_hparams_and_a_report(tmp_path):
    plain = run_cli(*QUICK, "hydra.run.dir=outputs/a_plain_run", cwd=tmp_path)  # the run TensorBoard reads first
    assert plain.returncode == 0, plain.stderr
    result = run_cli("-m", "loader.batch_size=32,64", "loader.num_workers=0,2", *QUICK, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    root = sweep_dir(tmp_path)
    jobs = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.name)
    assert [p.name for p in jobs] == [  # each job named by its swept values: TensorBoard's run list shows them
        "0_batch_size-32+num_workers-0",
        "1_batch_size-32+num_workers-2",
        "2_batch_size-64+num_workers-0",
        "3_batch_size-64+num_workers-2",
    ]
    seen = set()
    for job in jobs:
        assert json.loads((job / "metrics.json").read_text())["status"] == "completed"
        acc = EventAccumulator(str(job))
        acc.Reload()
        hp = session_hparams(job)  # the swept overrides are columns, integers as numbers
        seen.add((hp["loader.batch_size"], hp["loader.num_workers"]))
        assert "val/acc" in acc.Tags()["scalars"]
    assert seen == {(32, 0), (32, 2), (64, 0), (64, 2)}
    # `tensorboard --logdir outputs` over the plain run (read first) and the sweep: the HParams tab's own data routes
    with tensorboard(tmp_path / "outputs") as post:
        experiment = post("experiment", {"experimentName": ""})
        statuses = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]
        groups = post(
            "session_groups",
            {"experimentName": "", "allowedStatuses": statuses, "colParams": [], "startIndex": 0, "sliceSize": 100},
        )["sessionGroups"]
    # TensorBoard lists differing columns first, and ticks them
    columns = {h["name"]: h for h in experiment["hparamInfos"]}
    assert {n for n, h in columns.items() if h.get("differs")} == {
        "loader.batch_size",
        "loader.num_workers",
        "loader.resident",  # what ran: the digits resident without workers (loader.resident=auto), not with 2
        "overrides",
    }
    assert columns["loader.batch_size"]["type"] == "DATA_TYPE_FLOAT64"  # numeric axes: 64 after 32, a range filter
    # the plain run's 128 too
    assert columns["loader.batch_size"]["domainInterval"] == {
        "minValue": 32.0,
        "maxValue": 128.0,
    }
    assert columns["trainer.compile"]["domainDiscrete"] == ["false"]  # a boolean reads false, not 0.0000
    # the metric columns are every scalar of a session's run (its session is in its own run: no `<run>/tb/hparams`
    # group), sorted; the table shows the first five: the compared metrics' final values, compare/*
    metrics = [(m["name"]["tag"], m["name"].get("group", "")) for m in experiment["metricInfos"]]
    compared = ["memory/peak_mb", "perf/data_wait_frac", "perf/samples_per_s", "train/loss", "val/acc", "val/loss"]
    assert metrics[:6] == [(f"compare/{tag}", "") for tag in compared] and {group for _, group in metrics} == {""}
    overrides = sorted(g["hparams"]["overrides"] for g in groups)
    # swept keys first
    assert len(groups) == 5 and overrides[0].startswith("loader.batch_size=32 loader.num_workers=0 ")

    done = report(root)
    assert done.returncode == 0, done.stderr
    table = [
        line for line in (root / "sweep.md").read_text().splitlines() if line.startswith("| ") and line[2].isdigit()
    ]
    assert len(table) == 4 and "**best** completed" in table[0]
    header = (root / "sweep.md").read_text().split("| job |")[1].splitlines()[0]
    assert (
        "loader.batch_size | loader.num_workers | samples/s | data wait | peak MB | val/acc | wall s | status" in header
    )
    rates = [float(line.split("|")[4].replace(",", "")) for line in table]
    assert rates == sorted(rates, reverse=True)  # sorted by throughput
    rows = list(csv.DictReader((root / "sweep.csv").open()))
    assert len(rows) == 4 and {r["batch_size"] for r in rows} == {"32", "64"}
    for png in ("samples_per_s.png", "data_wait.png"):
        assert (root / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a second real multirun (11 s): the default run keeps the four-job sweep
def test_a_failing_job_does_not_lose_the_others(tmp_path):
    result = run_cli(
        "-m", "loader.batch_size=auto,5000", "batch_search.steps=1", "batch_search.cache=", *QUICK, cwd=tmp_path
    )
    assert result.returncode == 1  # the sweep as a whole failed ...
    assert "loader.batch_size=5000: larger than the training set" in result.stderr and "Traceback" not in result.stderr
    root = sweep_dir(tmp_path)
    ok = json.loads((root / "0_batch_size-auto" / "metrics.json").read_text())
    assert ok["status"] == "completed" and ok["batch_size"] >= 16  # ... but the auto-sized job ran
    failed = json.loads((root / "1_batch_size-5000" / "metrics.json").read_text())
    assert failed == {
        "status": "failed",
        "error": "UserError: loader.batch_size=5000: larger than the training set (1437 samples)",
    }

    done = report(root)
    assert done.returncode == 0, done.stderr
    assert (
        "2 jobs, 1 completed" in done.stdout
        and "Failed: job 1 (failed: UserError: loader.batch_size=5000" in done.stdout
    )
    assert "**best** completed" in done.stdout


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF / "sweep").glob("*.yaml")))
def test_every_sweep_preset_composes_with_its_parameters(preset):
    from hydra import compose, initialize_config_dir

    if preset == "optuna":
        pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"sweep={preset}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert len(params) >= 2, params


def test_optuna_preset_searches_lr_and_batch_size(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    result = run_cli("-m", "sweep=optuna", "hydra.sweeper.n_trials=2", *QUICK, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Best parameters: {'optim.optimizer.lr':" in result.stdout and "Best value: " in result.stdout
    assert len(list(sweep_dir(tmp_path).glob("*/metrics.json"))) == 2


def test_plot_lines_follow_the_keys_that_varied():
    """A sweep of augmentation x batch size is drawn one line per augmentation, not per
    worker count (which did not vary)."""
    from saturate.diagnostics.sweep import Job, lines

    jobs = [
        Job(
            n,
            Path(str(n)),
            {"augmentation": aug, "loader.batch_size": str(b)},
            {"status": "completed", "batch_size": b, "num_workers": 2, "perf/samples_per_s": float(b)},
        )
        for n, (aug, b) in enumerate([("cpu", 64), ("cpu", 128), ("gpu", 64), ("gpu", 128)])
    ]
    assert lines(jobs, "perf/samples_per_s") == {
        "augmentation=cpu": [(64, 64.0), (128, 128.0)],
        "augmentation=gpu": [(64, 64.0), (128, 128.0)],
    }


def test_the_report_shows_the_monitored_metric_and_the_test_split():
    """Columns for what the jobs logged: the monitor first (a user's metric too), then the
    task's metrics, then their test-set counterparts."""
    from saturate.diagnostics.sweep import Job, figures

    logged = {
        "status": "completed",
        "monitor": "val/ter",
        "val/ter": 0.1,
        "val/loss": 0.5,
        "test/ter": 0.2,
        "test/loss": 0.6,
        "perf/samples_per_s": 10.0,
    }
    names = [name for _, name, _ in figures([Job(0, Path("."), {}, logged)])]
    assert names.index("val/ter") < names.index("test/ter") < names.index("wall s") and "val/loss" not in names
    plain = [name for _, name, _ in figures([Job(0, Path("."), {}, {"val/acc": 0.9, "val/loss": 0.3})])]
    assert "val/acc" in plain and not any(n.startswith("test/") for n in plain)


def test_the_report_compares_the_jobs_time_to_target_where_one_met_it():
    from saturate.diagnostics.sweep import Job, figures

    met = Job(0, Path("."), {}, {"val/acc": 0.99, "time/to_target_s": 12.5})
    missed = Job(1, Path("."), {}, {"val/acc": 0.90})
    columns = [name for _, name, _ in figures([met, missed])]
    assert columns.index("val/acc") < columns.index("to target s") < columns.index("wall s")
    assert "to target s" not in [name for _, name, _ in figures([missed])]
