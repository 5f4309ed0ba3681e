"""`saturate eval` and `saturate export` against a hostile working dir, run dir and --out: no
code imported from a run dir, no finished run written over, no link followed, no export's
files mixed with another's, every bad flag and every failed write one line before (or
without) a traceback, a saved config checked before it is read."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest
import torch

from saturate.cli import checkpoint_command
from saturate.export.formats import FILES
from tests.conftest import TINY, compose_config, python

RUN = [*TINY, "trainer.limit_train_batches=1", "logger=[]", "monitor.costs=false"]
PLANT = 'import pathlib\npathlib.Path({marker!r}).touch()\nraise ImportError("planted")\n'


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A run dir as train.py leaves it (checkpoints/, metrics.json, .hydra/config.yaml), its
    checkpoint of the default model written directly (a run adds seconds, and nothing here)."""
    from omegaconf import OmegaConf

    from saturate.models.small_cnn import SmallCNN

    run_dir = tmp_path_factory.mktemp("after_run") / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / ".hydra").mkdir()
    torch.manual_seed(0)
    torch.save({"model": SmallCNN(1, 10).state_dict(), "step": 1, "epoch": 1}, run_dir / "checkpoints" / "last.pt")
    (run_dir / "metrics.json").write_text(json.dumps({"status": "completed", "val/acc": 0.5}) + "\n")
    OmegaConf.save(compose_config([*RUN, f"run_dir={run_dir}"]), run_dir / ".hydra" / "config.yaml")
    return run_dir


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_no_command_imports_from_a_run_dir_it_runs_in(finished, tmp_path, monkeypatch, capsys):
    """A run dir holding a conf/ and a module named by the config is not a project: `cd RUN &&
    saturate eval .` (and `python -m saturate`, whose folder Python puts first) imports nothing
    from it."""
    run_dir = tmp_path / "run"
    (run_dir / "conf").mkdir(parents=True)
    (run_dir / "checkpoints").symlink_to(finished / "checkpoints")
    (run_dir / "planted.py").write_text(PLANT.format(marker=str(tmp_path / "ran")))
    monkeypatch.delenv("SATURATE_CONFIG_DIR", raising=False)
    monkeypatch.setattr("sys.path", [str(run_dir), *__import__("sys").path])
    monkeypatch.chdir(run_dir)
    code = checkpoint_command("eval", [".", *RUN, "model._target_=planted.Net", "--out", str(tmp_path / "ev")])
    err = capsys.readouterr().err
    assert code == 1 and "planted.Net" in err and "Traceback" not in err, err
    assert not (tmp_path / "ran").exists()


def test_out_never_a_run_dir_and_name_a_plain_name(finished, tmp_path, capsys):
    before = (finished / "metrics.json").read_bytes()
    assert checkpoint_command("eval", [str(finished), *RUN, "--out", str(finished), "--predict"]) == 1
    assert "--out" in one_line(capsys) and (finished / "metrics.json").read_bytes() == before
    assert checkpoint_command("export", [str(finished), *RUN, "--out", str(finished)]) == 1
    assert "--out" in one_line(capsys) and not (finished / "export.json").exists()
    for name in ("../../other/predictions/val", "a/b", "..", ".hidden", "tab\there", ""):
        assert checkpoint_command("eval", [str(finished), *RUN, "--name", name, "--out", str(tmp_path / "o")]) == 1
        assert "--name" in one_line(capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "command, flag, value",
    [
        ("export", "--batches", "0"),
        ("export", "--batches", "-2"),
        ("export", "--tolerance", "nan"),
        ("export", "--tolerance", "-1"),
        ("export", "--tolerance", "inf"),
        ("export", "--to", "onnx,tflite"),
        ("export", "--to", ""),
    ],
)
def test_a_bad_flag_value_is_one_line_before_any_work(command, flag, value, tmp_path, capsys):
    missing = tmp_path / "no-such-checkpoint.pt"  # the flag is answered before the checkpoint is looked at
    assert checkpoint_command(command, [str(missing), f"{flag}={value}", "--out", str(tmp_path / "o")]) == 1
    err = one_line(capsys)
    assert flag in err and "no such checkpoint" not in err, err


def test_out_an_existing_file_or_under_one_is_one_line_before_any_work(tmp_path, capsys):
    (tmp_path / "file").write_text("kept\n")
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        for command in ("eval", "export"):
            assert checkpoint_command(command, [str(tmp_path / "none.pt"), "--out", str(out)]) == 1
            err = one_line(capsys)
            assert "--out" in err and "no such checkpoint" not in err, err
    assert (tmp_path / "file").read_text() == "kept\n"


def test_export_never_writes_through_a_link_and_leaves_no_earlier_exports_files(finished, tmp_path, capsys):
    out = tmp_path / "josé dir" / "データ $x=1 'q\""  # a path Hydra's override grammar cannot take unquoted
    out.mkdir(parents=True)
    victims = {name: tmp_path / f"victim-{name}" for name in ("model.safetensors", "export.json")}
    for name, victim in victims.items():
        victim.write_text("precious\n")
        (out / name).symlink_to(victim)
    args = [str(finished), *RUN, "--out", str(out), "--to", "safetensors"]
    assert checkpoint_command("export", args) == 0, capsys.readouterr()
    assert all(v.read_text() == "precious\n" for v in victims.values())
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "model.safetensors"]
    assert not any((out / n).is_symlink() for n in victims)
    assert list(json.loads((out / "export.json").read_text())["formats"]) == ["safetensors"]
    # an earlier export's forms that this one does not write go; a file no export.json lists is the user's: kept
    (out / "export.json").write_text(json.dumps({"formats": {"onnx": {}, "program": {}, "safetensors": {}}}))
    for name in ("model.onnx", "model.pt2", "model.ts"):
        (out / name).write_text("written before\n")
    assert checkpoint_command("export", args) == 0, capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "model.safetensors", "model.ts"]
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # another export writing there
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert checkpoint_command("export", args) == 1 and "another saturate export" in one_line(capsys)
    finally:
        os.close(fd)


def test_eval_never_writes_through_a_link_from_a_folder_named_in_any_script(finished, tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "josé dir" / "データ"
    elsewhere = tmp_path / "elsewhere"
    (cwd / "ev").mkdir(parents=True)
    elsewhere.mkdir()
    (tmp_path / "victim.json").write_text("precious\n")
    (cwd / "ev" / "metrics.json").symlink_to(tmp_path / "victim.json")
    (cwd / "ev" / "predictions").symlink_to(elsewhere)
    monkeypatch.chdir(cwd)
    assert checkpoint_command("eval", [str(finished), *RUN, "--out", "ev", "--predict"]) == 0, capsys.readouterr()
    assert (tmp_path / "victim.json").read_text() == "precious\n" and not list(elsewhere.iterdir())
    assert json.loads((cwd / "ev" / "metrics.json").read_text())["split"] == "val"
    assert (cwd / "ev" / "predictions" / "val.npz").is_file()
    assert checkpoint_command("eval", [str(finished), *RUN]) == 0, capsys.readouterr()  # the default --out
    assert len(list((cwd / "outputs" / "eval").glob("*/*/metrics.json"))) == 1


FILE_SIZE_LIMIT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
from saturate.cli import checkpoint_command
from saturate.export.formats import FILES
sys.exit(checkpoint_command("export", sys.argv[1:]))
"""


@pytest.mark.slow  # two exports, each in a process of its own under a file size limit
def test_a_full_disk_during_an_export_is_one_line_and_leaves_no_partial_file(finished, tmp_path):
    out = tmp_path / "out"
    for form in ("program", "safetensors"):
        result = python("-c", FILE_SIZE_LIMIT, finished, *RUN, "--out", out, "--to", form, cwd=tmp_path)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # (a library's own
        # cache warnings may come before it)
        assert len(errors) == 1 and errors[0].startswith(f"error: cannot write {out / FILES[form]}: "), result.stderr
        assert "File too large" in errors[0]
        assert not out.exists() or not list(out.iterdir()), result.stderr  # nothing written, no part of a file


def test_non_finite_weights_are_named_and_a_faithful_export_is_within_tolerance(finished, tmp_path, capsys):
    checkpoint = torch.load(finished / "checkpoints" / "last.pt", weights_only=True)
    name = next(k for k, t in checkpoint["model"].items() if t.is_floating_point() and t.ndim == 1)
    checkpoint["model"][name] = torch.full_like(checkpoint["model"][name], float("nan"))
    torch.save(checkpoint, tmp_path / "nan.pt")
    assert checkpoint_command("eval", [str(tmp_path / "nan.pt"), *RUN, "--out", str(tmp_path / "ev")]) == 0
    assert f"NaN or inf: {name}" in capsys.readouterr().err
    code = checkpoint_command(
        "export", [str(tmp_path / "nan.pt"), *RUN, "--out", str(tmp_path / "ex"), "--to", "safetensors"]
    )
    printed = capsys.readouterr()
    assert code == 0 and "OVER" not in printed.out and f"NaN or inf: {name}" in printed.err, printed


def saved(run_dir: Path, text: str) -> Path:
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra" / "config.yaml").write_text(text)
    return run_dir


@pytest.mark.parametrize(
    "text, overrides, says",
    [
        ("a0: &a0 [lol, lol]\na1: [*a0, *a0]\n", [], "YAML anchors or aliases"),
        ("name: " + "x" * (2 << 20) + "\n", [], "larger than"),
        (None, ["model=small_cnn"], "model=small_cnn: a group option"),
        (None, ["~trainer.seed"], "~trainer.seed: "),
        (None, ["trainer.max_epochs=[1"], "trainer.max_epochs=[1: "),
    ],
)
def test_a_saved_config_is_checked_before_it_is_read_and_its_overrides_are_keys(
    finished, tmp_path, capsys, text, overrides, says
):
    run_dir = saved(tmp_path / "run", text if text is not None else (finished / ".hydra" / "config.yaml").read_text())
    (run_dir / "checkpoints").symlink_to(finished / "checkpoints")
    args = [str(run_dir), "--run-saved-config", *overrides, "--out", str(tmp_path / "o")]
    assert checkpoint_command("eval", args) == 1
    assert says in one_line(capsys)


@pytest.mark.slow  # a fresh interpreter, as a user starts it, and an ONNX export
def test_planted_modules_in_a_run_dir_and_the_working_dir_never_run(finished, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "conf").mkdir(parents=True)
    (run_dir / "checkpoints").symlink_to(finished / "checkpoints")
    for module in ("sklearn", "onnxruntime"):
        (run_dir / f"{module}.py").write_text(PLANT.format(marker=str(tmp_path / module)))
    for command in ("eval", "export"):
        result = python("-m", "saturate", command, ".", *RUN, "--out", tmp_path / command, cwd=run_dir, fresh=True)
        assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "sklearn").exists() and not (tmp_path / "onnxruntime").exists()


def test_an_item_call_is_named_as_a_value_used_as_a_number():
    from saturate.export.why import explain

    class Scaled(torch.nn.Module):
        def forward(self, x):
            return x * float(x.abs().max().item())

    example = (torch.randn(2, 3),)
    with pytest.raises(Exception) as failed:
        torch.export.export(Scaled(), example, strict=False)
    said = explain(failed.value, Scaled(), example)
    assert "used as a Python number" in said and "condition" not in said, said
