"""saturate in a project of the user's own: `saturate init` writes one that trains at once, its
`./conf` (or `[tool.saturate] config-dir`) comes first on the search path and its folder on
sys.path, parent folders are never searched, and nothing is imported from a folder without one."""

from __future__ import annotations

import json

import pytest

from saturate.commands.init import main as init
from saturate.config.dirs import CONF, project_conf, project_pythonpath
from saturate.errors import UserError
from tests.conftest import TINY, python

QUICK = [*TINY, "trainer.max_epochs=2"]


def train(*args: str, cwd, **kwargs):
    return python("-m", "saturate", "train", *args, cwd=cwd, **kwargs)


def test_init_writes_a_project_that_trains_at_once_and_refuses_a_folder_that_is_not_empty(tmp_path, capsys):
    assert init([str(tmp_path / "my-proj")]) == 0
    proj = tmp_path / "my-proj"
    assert (proj / "my_proj" / "data.py").is_file() and (proj / "conf" / "config.yaml").is_file()
    done = train("experiment=quick", "trainer.progress=false", "loader.num_workers=0", "hydra.run.dir=run", cwd=proj)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((proj / "run" / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["data"] == "my_proj_data" and metrics["val/acc"] > 0.5
    assert f"config: the project config dir {proj / 'conf'}, then saturate's" in done.stdout
    assert init([str(proj)]) == 1 and "is not empty" in capsys.readouterr().err
    assert init([str(proj), "--force"]) == 1 and "init writes no file over another" in capsys.readouterr().err
    assert init([str(tmp_path / "x"), "--package", "class"]) == 1 and "--package='class'" in capsys.readouterr().err


def test_the_project_conf_is_found_here_or_by_pyproject_never_in_a_parent(tmp_path):
    (tmp_path / "conf").mkdir()
    assert project_conf(tmp_path) == (tmp_path / "conf").resolve()
    (tmp_path / "sub").mkdir()
    assert project_conf(tmp_path / "sub") is None  # parents are never searched
    (tmp_path / "configs").mkdir()
    (tmp_path / "pyproject.toml").write_text('[tool.saturate]\nconfig-dir = "configs"\n')
    assert project_conf(tmp_path) == (tmp_path / "configs").resolve()
    (tmp_path / "pyproject.toml").write_text('[tool.saturate]\nconfig-dir = "nowhere"\n')
    with pytest.raises(UserError, match="config-dir='nowhere'.*expected a folder"):
        project_conf(tmp_path)
    assert project_conf(CONF.parent) is None  # saturate's own groups are not a project's
    (tmp_path / "pyproject.toml").write_text('[tool.saturate]\npythonpath = ["src", ".."]\n')
    assert project_pythonpath(tmp_path) == [(tmp_path / "src").resolve(), tmp_path.parent.resolve()]
    assert project_pythonpath(tmp_path / "sub") == [(tmp_path / "sub").resolve()]  # the folder itself by default
    mistakes = [
        ("pythonpath = 'src'", "pythonpath='src'.*expected a list of folders"),
        ("confdir = 'c'", "expected one of the keys config-dir, pythonpath"),
    ]
    for bad, says in mistakes:
        (tmp_path / "pyproject.toml").write_text(f"[tool.saturate]\n{bad}\n")
        with pytest.raises(UserError, match=says):
            project_conf(tmp_path)


def test_a_projects_option_shadows_saturates_and_a_mistake_there_is_one_line(tmp_path):
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "small_cnn.yaml").write_text(
        "_target_: saturate.models.small_cnn.SmallCNN\nwidth: 3\n"
    )
    shown = train("--cfg", "job", cwd=tmp_path)
    assert shown.returncode == 0 and "width: 3\n" in shown.stdout, shown.stderr[-2000:]
    elsewhere = train("--cfg", "job", cwd=tmp_path / "conf")  # a folder without a conf/ of its own
    assert elsewhere.returncode == 0 and "width: 32\n" in elsewhere.stdout
    mistake = train("trainer.max_epoch=3", cwd=tmp_path)
    assert mistake.returncode == 1 and "did you mean trainer.max_epochs?" in mistake.stderr
    assert "Traceback" not in mistake.stderr


def test_the_working_dir_goes_on_sys_path_only_when_it_holds_a_project(tmp_path, monkeypatch):
    """`saturate train`, `eval` and `export` import a project's package from its folder; from a
    folder that is no project (a run dir: `cd RUN && saturate export .`) nothing is imported."""
    import os
    import sys

    from saturate.cli import project_first
    from saturate.config.dirs import PROJECT_ENV

    monkeypatch.delenv(PROJECT_ENV, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    project_first()
    assert str(tmp_path) not in sys.path and PROJECT_ENV not in os.environ
    (tmp_path / "conf").mkdir()
    project_first()
    assert sys.path[0] == str(tmp_path) and os.environ[PROJECT_ENV] == str((tmp_path / "conf").resolve())
