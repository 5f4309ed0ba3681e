"""saturate as a dependency of the user's own project: its wheel and sdist built from the
checkout (`twine check` passes), the wheel installed non-editable into a fresh venv (torch from
the wheel the machine carries), and in a folder outside the checkout every command a user of
the installed package runs: `saturate init`, `train` (a run, a sweep and its report, tune
writing its preset into the project), `eval`, `export`, the README's `saturate.fit`; the
examples composed from their own folders. Slow: the venv's install takes minutes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
QUICK = ["trainer.max_epochs=2", "trainer.progress=false", "monitor.costs=false"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The built wheel installed into a fresh venv; its bin/ and the dist folder."""
    root = tmp_path_factory.mktemp("wheel")
    dist = root / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], capture_output=True, text=True, timeout=900
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    (wheel,) = dist.glob("saturate-*.whl")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run([*pip, "torch==2.13.0", f"{wheel}[export]"], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"bin": venv / "bin", "dist": dist, "wheel": wheel}


def user(installed: dict, *command: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """A command as the user of the venv runs it: its bin/ first on PATH, nothing of the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SATURATE_"))}
    env["PATH"] = f"{installed['bin']}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(list(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_and_sdist_pass_twine_and_the_wheel_carries_the_configs_plugins_and_types(installed):
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, installed["dist"].iterdir())],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    import zipfile

    names = zipfile.ZipFile(installed["wheel"]).namelist()
    assert "saturate/conf/config.yaml" in names and "saturate/conf/saturate.yaml" in names
    assert "saturate/conf/model/small_cnn.yaml" in names and "saturate/py.typed" in names
    assert "hydra_plugins/saturate_searchpath/__init__.py" in names
    assert "hydra_plugins/saturate_slurm_launcher/slurm_launcher.py" in names


def test_a_project_of_ones_own_trains_sweeps_tunes_evaluates_and_exports(installed, tmp_path):
    from saturate import __version__

    version = user(installed, "saturate", "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"saturate {__version__}"
    assert user(installed, "saturate", "--help", cwd=tmp_path).returncode == 0
    assert user(installed, "saturate", "train", "--help", cwd=tmp_path).returncode == 0
    made = user(installed, "saturate", "init", "proj", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    again = user(installed, "saturate", "init", "proj", cwd=tmp_path)
    assert again.returncode == 1 and "is not empty" in again.stderr and "Traceback" not in again.stderr
    proj = tmp_path / "proj"

    trained = user(installed, "saturate", "train", *QUICK, "hydra.run.dir=outputs/run", cwd=proj)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert f"project config dir {proj / 'conf'}" in trained.stdout  # said at the start of the run
    metrics = json.loads((proj / "outputs" / "run" / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["val/acc"] > 0.5 and metrics["data"] == "proj_data"
    assert "val/acc" in trained.stdout and (proj / "outputs" / "run" / "checkpoints" / "best.pt").is_file()

    swept = user(installed, "saturate", "train", "-m", *QUICK, "model.hidden=16,32", "hydra.sweep.dir=sweep", cwd=proj)
    assert swept.returncode == 0, swept.stderr[-3000:]
    report = user(installed, "saturate", "sweep-report", "sweep", cwd=proj)
    assert report.returncode == 0 and "hidden" in report.stdout, report.stderr[-2000:]
    assert (proj / "sweep" / "sweep.md").is_file()

    evaluated = user(installed, "saturate", "eval", "outputs/run", "--out", "evaluated", cwd=proj)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((proj / "evaluated" / "metrics.json").read_text())["val/acc"] == pytest.approx(
        metrics["val/acc"], abs=1e-6
    )
    exported = user(installed, "saturate", "export", "outputs/run", "--to", "onnx", "--out", "exported", cwd=proj)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert list((proj / "exported").glob("*.onnx"))

    tuned = user(installed, "saturate", "train", "tune=true", "tune.budget_s=40", *QUICK, cwd=proj, timeout=900)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    (preset,) = (proj / "conf" / "experiment").glob("tuned_*.yaml")  # the project's own config dir, not the package
    again = user(installed, "saturate", "train", f"experiment={preset.stem}", "--cfg", "job", cwd=proj)
    assert again.returncode == 0, again.stderr[-2000:]


def test_the_readmes_fit_example_runs_from_any_folder(installed, tmp_path):
    text = (ROOT / "README.md").read_text()
    example = re.search(r"## Your model, from Python\n\n```python\n(.*?)```", text, re.S).group(1)
    example = example.replace('overrides=["trainer.max_epochs=10"]', 'overrides=["trainer.max_epochs=2"]')
    (tmp_path / "fit_example.py").write_text(example + "print('fit val/acc', metrics['val/acc'])\n")
    done = user(installed, "python", "fit_example.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fit val/acc" in done.stdout and list((tmp_path / "outputs" / "runs").rglob("metrics.json"))


def test_the_installed_command_composes_what_the_checkout_composes(installed, tmp_path):
    overrides = ["precision=bf16", "loader.batch_size=64", "trainer.seed=3"]
    installed_cfg = user(installed, "saturate", "train", *overrides, "--cfg", "job", cwd=tmp_path)
    checkout_cfg = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides, "--cfg", "job"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert installed_cfg.returncode == 0 and checkout_cfg.returncode == 0, installed_cfg.stderr + checkout_cfg.stderr
    assert installed_cfg.stdout == checkout_cfg.stdout


def test_the_default_run_learns_the_same_from_the_wheel_and_from_the_checkout(installed, tmp_path):
    args = ["trainer.progress=false"]
    from_wheel = user(installed, "saturate", "train", *args, "hydra.run.dir=wheel", cwd=tmp_path)
    checkout = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, "hydra.run.dir=checkout"], cwd=tmp_path, capture_output=True
    )
    assert from_wheel.returncode == 0 and checkout.returncode == 0, from_wheel.stderr[-2000:]
    learned = [json.loads((tmp_path / d / "metrics.json").read_text())["val/acc"] for d in ("wheel", "checkout")]
    assert learned[0] == learned[1] > 0.98

    def kept(run_dir: Path) -> list[str]:  # an event file's name holds its host, process and second
        return sorted(re.sub(r"tfevents\..*", "tfevents", str(p.relative_to(run_dir))) for p in run_dir.rglob("*"))

    assert kept(tmp_path / "wheel") == kept(tmp_path / "checkout")  # the run dir holds what a checkout run holds


def test_an_example_trains_from_its_own_folder_against_the_installed_package(installed, tmp_path):
    """examples/pm25 as a project: conf/ found there, its modules imported from its
    [tool.saturate] pythonpath (the checkout's root, where examples.pm25 lives)."""
    folder = ROOT / "examples" / "pm25"
    args = ["experiment=pm25", "trainer.max_epochs=1", "trainer.progress=false", f"hydra.run.dir={tmp_path / 'run'}"]
    done = user(installed, "saturate", "train", *args, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("example", sorted(p.parent.name for p in (ROOT / "examples").glob("*/conf")))
def test_every_example_composes_from_its_own_folder_against_the_installed_package(installed, example, tmp_path):
    folder = ROOT / "examples" / example
    experiments = sorted((folder / "conf" / "experiment").glob("*.yaml"))
    chosen = [f"experiment={experiments[0].stem}"] if experiments else []
    done = user(installed, "saturate", "train", *chosen, "--cfg", "job", cwd=folder)
    assert done.returncode == 0, done.stderr[-2000:]
    searched = f"hydra.searchpath=[file://{folder / 'conf'}]"  # the checkout's way: from its root, the dir named
    checkout = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), searched, *chosen, "--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert checkout.returncode == 0 and done.stdout == checkout.stdout, checkout.stderr[-2000:]
