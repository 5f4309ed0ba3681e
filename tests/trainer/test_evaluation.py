"""`saturate eval`: a finished run's checkpoints evaluated again reproduce the run's own
figures exactly on the CPU; a checkpoint of another model is refused in one line; a run
dir's saved config is used only when asked, old module names read as today's."""

from __future__ import annotations

import datetime
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import saturate
from saturate.cli import checkpoint_command
from saturate.errors import UserError
from saturate.trainer.evaluation import saved_config
from tests.conftest import ROOT, TINY, python, read_metrics

# three epochs at a learning rate high enough that a later one is worse: best.pt is the first's
RUN = [*TINY, "trainer.max_epochs=3", "optim.optimizer.lr=3.0", "logger=[]", "monitor.costs=false"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run: its run dir, and the overrides it was trained with."""
    from tests.conftest import compose_config

    run_dir = tmp_path_factory.mktemp("evaluated") / "run"
    saturate.train(compose_config([*RUN, f"run_dir={run_dir}"]))
    return run_dir


def evaluated(capsys, checkpoint, out, *args: str) -> dict:
    assert checkpoint_command("eval", [str(checkpoint), *RUN, "--out", str(out), *args]) == 0, capsys.readouterr()
    return json.loads((out / "metrics.json").read_text())


def test_eval_of_last_pt_reproduces_the_runs_final_validation_and_best_pt_the_evaluation_that_chose_it(
    finished, tmp_path, capsys
):
    final = read_metrics(finished)
    last = evaluated(capsys, finished / "checkpoints" / "last.pt", tmp_path / "last")
    vals = {k: v for k, v in final.items() if k.startswith("val/")}
    assert vals and {k: last[k] for k in vals} == vals  # exactly: the same batches through the same evaluation
    printed = capsys.readouterr().out
    assert "val/acc" in printed and str(tmp_path / "last" / "metrics.json") in printed

    best_file = finished / "checkpoints" / "best.pt"
    chosen = torch.load(best_file, weights_only=True)
    best = evaluated(capsys, finished, tmp_path / "best")  # a run dir: its best.pt
    assert best["checkpoint"] == str(best_file) and best["step"] == chosen["step"] == final["best"]["step"]
    assert best[final["best"]["metric"]] == final["best"]["value"]
    assert {k: best[k] for k in chosen["metrics"] if k.startswith("val/")} == {
        k: v for k, v in chosen["metrics"].items() if k.startswith("val/")
    }
    assert best["step"] < last["step"], "the run was meant to get worse after its best epoch"


def test_eval_under_a_new_name_writes_predictions_as_plain_arrays(finished, tmp_path, capsys):
    # another seed's split of the data, named on the command line
    got = evaluated(capsys, finished, tmp_path / "t", "data.split_seed=7", "--name", "reshuffled", "--predict")
    assert got["split"] == "val" and "reshuffled/acc" in got and "reshuffled/loss" in got
    with np.load(tmp_path / "t" / "predictions" / "reshuffled.npz", allow_pickle=False) as saved:
        assert len(saved["index"]) == 2 * 32 and (np.diff(saved["index"]) > 0).all()
        assert saved["output"].shape == (64, 10) and saved["target"].shape == (64,)


def test_a_checkpoint_of_another_model_is_refused_in_one_line(finished, tmp_path, capsys):
    code = checkpoint_command("eval", [str(finished), *RUN, "model.width=8", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: saturate eval: ") and "another model" in err and "shapes differ" in err
    assert not (tmp_path / "metrics.json").exists()


def test_no_checkpoint_and_a_split_the_data_lacks_are_one_line_each(finished, tmp_path, capsys):
    assert checkpoint_command("eval", [str(tmp_path)]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    assert checkpoint_command("eval", [str(finished), *RUN, "--split", "test", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no test split" in err, err
    # read as data only: a file that needs arbitrary unpickling is refused, never loaded
    torch.save({"model": {}, "step": 0, "when": datetime.date(2026, 11, 27)}, tmp_path / "pickled.pt")
    assert checkpoint_command("eval", [str(tmp_path / "pickled.pt"), *RUN, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing" in err and "arbitrary unpickling" in err, err


@pytest.mark.slow  # evaluates the whole validation set
def test_a_run_dirs_saved_config_is_used_only_when_asked(finished, tmp_path, capsys):
    from tests.conftest import compose_config

    (finished / ".hydra").mkdir(exist_ok=True)  # the run's config, saved as train.py saves it
    OmegaConf.save(compose_config(RUN), finished / ".hydra" / "config.yaml")
    chosen = torch.load(finished / "checkpoints" / "best.pt", weights_only=True)["metrics"]
    # without the flag: conf/ and the command line (no overrides: the whole validation set)
    assert checkpoint_command("eval", [str(finished), "--out", str(tmp_path / "conf")]) == 0
    from_conf = json.loads((tmp_path / "conf" / "metrics.json").read_text())
    assert checkpoint_command("eval", [str(finished), "--run-saved-config", "--out", str(tmp_path / "saved")]) == 0
    from_saved = json.loads((tmp_path / "saved" / "metrics.json").read_text())
    assert from_saved["batches"] == 2 < from_conf["batches"]  # the run's trainer.limit_val_batches=2
    assert {k: from_saved[k] for k in chosen if k.startswith("val/")} == {
        k: v for k, v in chosen.items() if k.startswith("val/")
    }
    capsys.readouterr()


@pytest.mark.slow  # evaluates the whole validation set
def test_a_config_saved_before_the_restructuring_is_read(finished, tmp_path, capsys):
    """A real run dir's config saved by an older layout of the config (norm: a group there;
    this run's model has BatchNorm, given on top as a run's own override would be)."""
    run_dir = tmp_path / "old"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "checkpoints").symlink_to(finished / "checkpoints")
    (run_dir / ".hydra" / "config.yaml").write_text((ROOT / "tests" / "trainer" / "old_run_config.yaml").read_text())
    args = [
        str(run_dir),
        "--run-saved-config",
        "model.norm=batch",
        "loader.num_workers=0",
        "--out",
        str(tmp_path / "o"),
    ]
    assert checkpoint_command("eval", args) == 0, capsys.readouterr()
    got = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert got["batches"] == 12 and 0 <= got["val/acc"] <= 1  # the whole validation set at the old batch size, 32
    capsys.readouterr()


def test_a_saved_config_naming_a_module_this_saturate_lacks_is_refused_naming_it(tmp_path):
    run_dir = tmp_path / "old"
    (run_dir / ".hydra").mkdir(parents=True)
    old = (ROOT / "tests" / "trainer" / "old_run_config.yaml").read_text()
    (run_dir / ".hydra" / "config.yaml").write_text(old.replace("saturate.models.SmallCNN", "saturate.old_models.Net"))
    with pytest.raises(UserError, match=r"names saturate\.old_models\.Net, which this saturate does not have"):
        saved_config(run_dir, [], OmegaConf.create({}))
    (run_dir / ".hydra" / "config.yaml").write_text("- a list\n")
    with pytest.raises(UserError, match="holds a list, not a run's config"):
        saved_config(run_dir, [], OmegaConf.create({}))


@pytest.mark.slow
def test_the_command_refuses_another_models_checkpoint_with_status_1_and_no_traceback(finished, tmp_path):
    result = python("-m", "saturate", "eval", finished, *RUN, "model.width=8", "--out", tmp_path, timeout=240)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "another model" in result.stderr
