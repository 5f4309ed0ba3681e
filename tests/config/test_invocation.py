"""Every path that starts a run again carries the user's whole command line (issue 25, item
3): Hydra-level overrides such as `hydra.searchpath` too, not only the task's. Checked with a
user's own config dir (a data option saturate's conf/ does not have) on each path: the
printed resume command, `trainer.devices` ranks, `tune=true` trials."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from saturate.config.invocation import from_hydra
from saturate.trainer.run import resume_hint
from tests.conftest import CONF, ROOT, TINY, read_metrics, run_cli, stopped_after_first_save


def user_conf(tmp_path: Path) -> Path:
    """A user's config dir with a data option of their own, `mine` (the digits under another name)."""
    conf = tmp_path / "my_conf"
    (conf / "data").mkdir(parents=True)
    (conf / "data" / "mine.yaml").write_text(
        "_target_: saturate.data.digits.load_digits\nval_fraction: 0.2\nsplit_seed: 0\n"
    )
    return conf


def hydra_run(overrides: list[str], hydra_overrides: list[str]):
    """HydraConfig as train.py has it for `python train.py HYDRA_OVERRIDES OVERRIDES` (a run's
    Hydra node, made by the compose API)."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*hydra_overrides, *overrides], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.overrides.hydra = [*hydra_overrides, "hydra.mode=RUN"]
        cfg.hydra.overrides.task = overrides
    HydraConfig.instance().set_config(cfg)


@pytest.fixture
def hydra_config():
    before = HydraConfig.instance().cfg
    yield hydra_run
    HydraConfig.instance().cfg = before


def test_the_command_line_holds_hydras_overrides_but_not_where_the_run_went(hydra_config, tmp_path):
    searchpath = f"hydra.searchpath=[file://{user_conf(tmp_path)}]"
    hydra_config(
        ["data=mine", "trainer.max_epochs=2"], [searchpath, "hydra.job.chdir=false", f"hydra.run.dir={tmp_path / 'r'}"]
    )
    invocation = from_hydra()
    assert invocation.command_line() == [searchpath, "hydra.job.chdir=false", "data=mine", "trainer.max_epochs=2"]
    hint = resume_hint(str(tmp_path / "r"), world_size=1, invocation=invocation)
    assert shlex.split(hint)[2:] == [
        searchpath,
        "hydra.job.chdir=false",
        "data=mine",
        "trainer.max_epochs=2",
        f"hydra.run.dir={tmp_path / 'r'}",
        "trainer.resume=auto",
    ]


def test_saturate_train_resumes_and_launches_ranks_as_saturate_train(hydra_config, tmp_path, monkeypatch):
    """The command the user typed: `saturate train ...` resumes as it, and under several
    processes as `torchrun ... -m saturate train`; train.py's path keeps `python train.py`."""
    from saturate.config.invocation import SCRIPT, TRAIN_COMMAND

    hydra_config(["trainer.max_epochs=2"], [f"hydra.run.dir={tmp_path / 'r'}"])
    monkeypatch.setenv(SCRIPT, TRAIN_COMMAND)
    invocation = from_hydra()
    assert invocation.app == TRAIN_COMMAND
    one = resume_hint(str(tmp_path / "r"), world_size=1, invocation=invocation)
    assert one.startswith("saturate train trainer.max_epochs=2 ") and one.endswith(" trainer.resume=auto")
    two = resume_hint(str(tmp_path / "r"), world_size=2, invocation=invocation)
    assert two.startswith("torchrun --nproc_per_node=2 -m saturate train trainer.max_epochs=2 ")
    monkeypatch.setenv(SCRIPT, str(tmp_path / "train.py"))
    assert resume_hint(str(tmp_path / "r"), world_size=1, invocation=from_hydra()).startswith("python ")


@pytest.mark.slow
def test_the_printed_resume_command_runs_verbatim_with_a_users_config_dir(tmp_path):
    conf = user_conf(tmp_path)
    run_dir = tmp_path / "interrupted"
    args = [
        f"hydra.searchpath=[file://{conf}]",
        "data=mine",
        "trainer.max_epochs=40",
        "trainer.progress=false",
        "model.width=8",
        "loader.num_workers=0",
    ]
    returncode, out = stopped_after_first_save(args, run_dir, tmp_path)
    assert returncode == 143, out[-3000:]
    hint = out.split("resume with: ", 1)[1].splitlines()[0]
    assert f"hydra.searchpath=[file://{conf}]" in hint
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    resumed = subprocess.run(
        hint.replace("trainer.max_epochs=40", "trainer.max_epochs=2"),
        shell=True,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PATH": path},
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints'}" in resumed.stdout + resumed.stderr


@pytest.mark.slow
def test_trainer_devices_ranks_compose_with_the_users_config_dir(tmp_path):
    conf = user_conf(tmp_path)
    done = run_cli(
        f"hydra.searchpath=[file://{conf}]",
        "data=mine",
        *TINY,
        "device=cpu",
        "trainer.devices=2",
        "hydra.run.dir=ddp",
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = read_metrics(tmp_path / "ddp")
    assert metrics["world_size"] == 2 and metrics["data"] == "mine"


@pytest.mark.slow
def test_tune_trials_compose_with_the_users_config_dir(tmp_path):
    """The README's own example: examples/sequences with tune=true."""
    preset = tmp_path / "preset.yaml"
    done = run_cli(
        f"hydra.searchpath=[file://{ROOT / 'examples/sequences/conf'}]",
        "experiment=digit_rows",
        "tune=true",
        "tune.budget_s=30",
        "tune.trial_s=0.5",
        "tune.cache=",
        f"tune.preset={preset}",
        "hydra.run.dir=t",
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "t" / "tune.json").read_text())
    assert all(r["status"] == "ok" for r in result["results"]), result["results"]
    assert f"hydra.searchpath=[file://{ROOT / 'examples/sequences/conf'}]" in preset.read_text()
