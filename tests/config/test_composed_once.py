"""train.py's config is composed once (saturate.config.composed_once), and it is the config
Hydra's own second composition makes."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
from hydra import initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from omegaconf import OmegaConf

from saturate.config.composed_once import RUN_OVERRIDE, applies, composed_once
from tests.conftest import CONF, ROOT


@pytest.fixture
def compositions(monkeypatch):
    """How many times Hydra composed the config (its loader's load_configuration)."""
    count = [0]
    load = ConfigLoaderImpl.load_configuration

    @functools.wraps(load)  # the same signature: composed_once checks it
    def counted(*args, **kwargs):
        count[0] += 1
        return load(*args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted)
    return count


def _run_config(overrides: list[str]):
    """What Hydra.run composes for a single run after get_mode: the mode, then the config with
    the override hydra._internal.utils._run_app adds when the mode is unset."""
    hydra = GlobalHydra.instance().hydra
    mode = hydra.get_mode(config_name="config", overrides=overrides)
    run_overrides = [*overrides, RUN_OVERRIDE] if mode is None else list(overrides)
    return mode, hydra.compose_config(config_name="config", overrides=run_overrides, run_mode=RunMode.RUN)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [f"hydra.searchpath=[file://{ROOT}/examples/forecast/conf]", "experiment=forecast", "trainer.seed=3"],
        ["data=digits", "loader.batch_size=64", "hydra.run.dir=somewhere", "hydra.job.chdir=true", "precision=bf16"],
    ],
)
def test_a_single_run_is_composed_once_into_hydras_own_config(overrides, compositions):
    assert applies()  # the Hydra this project pins: otherwise the block changes nothing
    with initialize_config_dir(str(CONF), version_base="1.3"):
        mode, hydras = _run_config(overrides)
        assert mode is None and compositions[0] == 2  # Hydra's own way: the mode's composition, then the run's
        with composed_once():
            mode, once = _run_config(overrides)
    assert mode is None and compositions[0] == 3
    assert OmegaConf.to_container(once, resolve=False) == OmegaConf.to_container(hydras, resolve=False)
    assert once.hydra.mode == RunMode.RUN and once.hydra.overrides.hydra[-1] == RUN_OVERRIDE
    assert OmegaConf.is_struct(once) and not OmegaConf.is_readonly(once.hydra)


def test_a_mode_that_cannot_be_read_goes_hydras_own_way(compositions):
    """Hydra's get_mode says None for a mode it cannot read; the run's composition then adds
    hydra.mode=RUN after it, and the run goes ahead."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        mode, hydras = _run_config(["hydra.mode=???"])
        with composed_once():
            again, once = _run_config(["hydra.mode=???"])
    assert mode is None and again is None and compositions[0] == 2 + 3
    assert once.hydra.mode == hydras.hydra.mode == RunMode.RUN
    assert OmegaConf.to_container(once, resolve=False) == OmegaConf.to_container(hydras, resolve=False)


def test_a_config_that_sets_its_mode_and_a_mistake_go_hydras_own_way(tmp_path, compositions):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "swept.yaml").write_text("# @package _global_\nhydra:\n  mode: MULTIRUN\n")
    swept = [f"hydra.searchpath=[file://{tmp_path}]", "experiment=swept"]
    with initialize_config_dir(str(CONF), version_base="1.3"), composed_once():
        hydra = GlobalHydra.instance().hydra
        assert hydra.get_mode(config_name="config", overrides=swept) == RunMode.MULTIRUN
        hydra.compose_config(config_name="config", overrides=swept, run_mode=RunMode.MULTIRUN)
        assert compositions[0] == 2  # the sweep's own composition: nothing was kept for it
        # a sweep without --multirun: the first composition fails, Hydra's get_mode decides, the run's raises
        mistake = ["loader.batch_size=16,32"]
        assert hydra.get_mode(config_name="config", overrides=mistake) is None
        with pytest.raises(ConfigCompositionException, match="requires --multirun|Ambiguous value"):
            hydra.compose_config(config_name="config", overrides=[*mistake, RUN_OVERRIDE], run_mode=RunMode.RUN)
    assert compositions[0] == 2 + 3


def test_train_py_composes_a_single_runs_config_once(tmp_path):
    """The real command: a mistake that saturate answers after Hydra has composed the config
    (before the heavy imports), Hydra's loader counted."""
    count = (
        "import atexit, functools, runpy, sys\n"
        "from hydra._internal.config_loader_impl import ConfigLoaderImpl as L\n"
        "n, load = [0], L.load_configuration\n"
        "@functools.wraps(load)\n"
        "def counted(*a, **k):\n"
        "    n[0] += 1\n"
        "    return load(*a, **k)\n"
        "L.load_configuration = counted\n"
        "atexit.register(lambda: print(f'compositions: {n[0]}', file=sys.stderr))\n"
        f"sys.argv = [{str(ROOT / 'train.py')!r}, 'trainer.max_epochs=-5', 'hydra.run.dir=r']\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", count], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "trainer.max_epochs=-5" in done.stderr, done.stderr[-2000:]
    assert "compositions: 1" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_an_experiment_that_sets_multirun_still_sweeps_without_dash_m(tmp_path):
    """lightning-hydra-template's hparams_search configs set hydra.mode: MULTIRUN themselves:
    train.py, without -m, runs the sweep they name."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "swept.yaml").write_text(
        "# @package _global_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      trainer.seed: 1,2\n"
    )
    command = [sys.executable, str(ROOT / "train.py"), f"hydra.searchpath=[file://{tmp_path / 'conf'}]"]
    command += ["experiment=swept", "data=synthetic", "trainer.max_epochs=1", "trainer.limit_train_batches=2"]
    command += ["trainer.limit_val_batches=1", "trainer.progress=false", "hydra.sweep.dir=sweep"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0_seed-1", "1_seed-2"]
    assert all((tmp_path / "sweep" / job / "metrics.json").exists() for job in ("0_seed-1", "1_seed-2"))
