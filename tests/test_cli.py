"""`python train.py` as a user runs it: the run directory it leaves, and how it answers
bad input (exit status, one short message, no traceback)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch
from hydra.errors import CompactHydraException

from saturate.cli import describe
from tests.conftest import ROOT, TINY, compose_config, popen, read_metrics, run_cli


def run_dirs(cwd):
    return sorted(p.parent for p in (cwd / "outputs" / "runs").glob("*/*/metrics.json"))


def test_cli_run_leaves_the_contract_run_dir(tmp_path):
    result = run_cli(*TINY, "precision=bf16", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (run_dir,) = run_dirs(tmp_path)
    # named by what the command line changed, keys by their last part, whole pairs as many as fit in 80
    # characters: TensorBoard's run list shows it
    name = "_max_epochs-1+limit_train_batches-3+limit_val_batches-2+log_interval-1"
    assert run_dir.name.endswith(name) and len(name + "+progress-False") > 1 + 80, run_dir.name
    for path in (
        ".hydra/config.yaml",
        ".hydra/overrides.yaml",
        "metrics.json",
        "checkpoints/last.pt",
        "checkpoints/best.pt",
    ):
        assert (run_dir / path).is_file(), path
    assert list(run_dir.glob("events.out.tfevents.*"))
    assert read_metrics(run_dir)["progress/step"] == 3


def test_two_runs_started_together_get_their_own_dirs(tmp_path):
    cmd = [ROOT / "train.py", *TINY, "trainer.limit_train_batches=1", "name=my baseline/v1"]
    procs = [popen(*cmd, cwd=tmp_path, stdout=subprocess.DEVNULL) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=240) == 0, p.stderr.read()
    dirs = run_dirs(tmp_path)
    # a given name, made safe for a path
    assert len(dirs) == 2 and all(d.name.endswith("_my-baseline-v1") for d in dirs)


HYDRA_NOISE = ("Traceback", "HYDRA_FULL_ERROR", "Config search path", "reference_type", "Error executing job")


def assert_clean_failure(result, *named: str) -> None:
    assert result.returncode == 1
    assert not [noise for noise in HYDRA_NOISE if noise in result.stderr + result.stdout], result.stderr
    assert "\nerror: " in "\n" + result.stderr, result.stderr
    for text in named:
        assert text in result.stderr, result.stderr


def test_bad_values_exit_with_every_problem_and_no_traceback(tmp_path):
    result = run_cli("loader.num_workers=-1", "trainer.eval_interval=0", "device.memory_fraction=2", cwd=tmp_path)
    assert_clean_failure(
        result,
        "invalid config (3 problems)",
        "loader.num_workers=-1: expected an integer >= 0 or 'auto'",
        "trainer.eval_interval=0: expected an integer >= 1",
        "device.memory_fraction=2.0: expected a number in (0, 1]",
    )
    (run_dir,) = run_dirs(tmp_path)  # a failed run still says so, for sweep reports
    error = read_metrics(run_dir)["error"]  # every problem, on one line, as the sweep report shows it
    assert read_metrics(run_dir)["status"] == "failed" and error.startswith(
        "ConfigError: device.memory_fraction=2.0: expected"
    )
    assert "loader.num_workers=-1" in error and "trainer.eval_interval=0" in error


def test_a_bad_value_is_answered_before_torch_is_imported(tmp_path):
    """The values and their combinations are checked before the heavy imports (5-9 s on a
    2-core CPU), so a mistaken number is answered at once: here a torch that cannot be
    imported is on the path, and the answer is still the one line. The `_target_` nodes,
    which import their modules, are checked next, once the values are right."""
    (tmp_path / "no_torch" / "torch").mkdir(parents=True)
    (tmp_path / "no_torch" / "torch" / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    env = {"PYTHONPATH": str(tmp_path / "no_torch")}
    result = run_cli("loader.batch_size=-1", "model._target_=nowhere.Model", cwd=tmp_path, env=env, fresh=True)
    assert_clean_failure(result, "error: invalid config (1 problem)", "loader.batch_size=-1: expected an integer >= 1")
    assert "nowhere.Model" not in result.stderr  # the targets' turn comes with the values right
    right = run_cli("model._target_=nowhere.Model", cwd=tmp_path)  # torch importable: the zygote's child
    assert_clean_failure(right, "model._target_='nowhere.Model': expected an importable class or function")


def test_a_removed_key_added_with_plus_or_from_a_users_config_is_named_as_removed(tmp_path):
    """`+loader.build_ahead=...` gets past Hydra; the config check names it as the composition does."""
    removed = "loader.build_ahead=False: expected no such key: it was removed (the data is built in the run's process)"
    assert_clean_failure(run_cli("+loader.build_ahead=false", cwd=tmp_path), removed)


def test_unknown_option_lists_the_available_ones(tmp_path):
    assert_clean_failure(
        run_cli("model=vgg", cwd=tmp_path), "error: model='vgg': expected one of airbench, resnet18, small_cnn"
    )


def test_unknown_key_suggests_the_nearest(tmp_path):
    assert_clean_failure(
        run_cli("trainer.max_epoch=3", cwd=tmp_path),
        "error: trainer.max_epoch=3: no such key (did you mean trainer.max_epochs?); the keys of trainer are "
        "max_epochs, max_steps,",
    )


# Hydra raises these while it composes, before saturate sees the config; `describe` turns each
# into one line with the key, the value given and what is allowed.
COMPOSE_ERRORS = [
    (["model=vgg"], "model='vgg': expected one of airbench, resnet18, small_cnn"),
    (["data=mnist"], "data='mnist': expected one of cifar10, digits, image_folder, shards, synthetic"),
    (
        ["trainer.max_epochs=lots"],
        "trainer.max_epochs=lots: Value 'lots' of type 'str' could not be converted to Integer",
    ),
    (["trainer.deterministic=maybe"], "trainer.deterministic=maybe: Value 'maybe' is not a valid bool"),
    (
        ["trainer.max_epoch=3"],
        "trainer.max_epoch=3: no such key (did you mean trainer.max_epochs?); the keys of trainer are",
    ),
    (["augmentation.flip=0.5"], "augmentation.flip=0.5: no such key (did you mean augmentation.hflip?)"),
    (
        ["model.widht=3"],
        "model.widht=3: no such key (did you mean model.width?); the keys of model are _target_, width, norm",
    ),
    (["lr=0.1"], "lr=0.1: no such key; the top-level keys are device, precision, loader,"),
    (  # a key that existed once says what became of it
        ["loader.build_ahead=false"],
        "loader.build_ahead='false': expected no such key: it was removed (the data is built in the run's process)",
    ),
    (["loader.batch_size=[1"], "loader.batch_size=[1: no viable alternative at input '[1'"),
    (  # red team round 4, c67
        ["task.metrics=[{_target_: torchmetrics.classification.MulticlassF1Score, num_classes: 10}]"],
        "task.metrics=[{_target_: torchmetrics.classification.MulticlassF1Score, num_classes: 10}]: expected a "
        "mapping, not a list",
    ),
]


@pytest.mark.parametrize(("overrides", "says"), COMPOSE_ERRORS, ids=[o[0] for o, _ in COMPOSE_ERRORS])
def test_compose_errors_are_one_line_naming_key_value_and_what_is_allowed(overrides, says):
    with pytest.raises(CompactHydraException) as err:
        compose_config(overrides)
    message = describe(err.value, overrides)
    assert message.startswith(says), message
    assert not [noise for noise in HYDRA_NOISE if noise in message] and "full_key" not in message


def test_hydra_full_error_set_by_the_user_gives_the_traceback_back(tmp_path):
    result = run_cli("trainer.max_epoch=3", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode == 1 and "Traceback" in result.stderr and "ConfigAttributeError" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_an_error_not_a_fallback(tmp_path):
    assert_clean_failure(run_cli("device=cuda", *TINY, cwd=tmp_path), "device.type='cuda'", "no CUDA device")


def test_help_names_saturate_its_groups_and_commands_and_cfg_job_resolves(tmp_path):
    helped = run_cli("--help", cwd=tmp_path)
    assert helped.returncode == 0
    assert helped.stdout.startswith("saturate: ") and "task: classification, regression" in helped.stdout
    assert "saturate train precision=amp loader=fast" in helped.stdout and "trainer.resume=auto" in helped.stdout
    shown = run_cli("--cfg", "job", "--resolve", cwd=tmp_path)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr
    assert (
        "run_dir: '<unset: the run dir, made when train.py starts>'" in shown.stdout
        and "max_epochs: 30" in shown.stdout
    )


@pytest.mark.parametrize(
    "args", [["--help"], ["trainer.max_epoch=3"], ["model=vgg"]], ids=["help", "misspelt-key", "unknown-option"]
)
def test_first_answers_import_no_torch(tmp_path, args):
    """--help and a mistake caught while Hydra composes never import torch (1.4 s on a 2-core
    CPU): scripts/bench_startup.py measures the times; here, what is imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "saturate.cli" in imported and not {"torch", "torchmetrics", "numpy"} & imported


def test_help_lists_the_groups_of_a_users_config_dir_too(tmp_path):
    helped = run_cli(f"hydra.searchpath=[file://{ROOT / 'examples/sequences/conf'}]", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "model: airbench, gru, resnet18, small_cnn" in helped.stdout


def test_at_exit_the_heap_is_frozen_after_the_handlers_registered_during_the_run(tmp_path):
    """A finished run's process does not free its ~480k objects one by one at exit (1.0 s of a
    2-core CPU's process end with torch, dynamo, torchmetrics and scipy loaded, 0.4 s frozen;
    scripts/bench_examples.py measures whole processes): run_hydra_app() registers an atexit handler that
    collects what is already garbage, then freezes the rest. Handlers that libraries register
    during the run (MLflow's, wandb's) still run before it, and handlers registered before run_hydra_app()
    after it: what Python guarantees at exit is kept."""
    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, gc\n"
        "from saturate.cli import run_hydra_app\n"
        "atexit.register(lambda: print('before run():', gc.get_freeze_count() > 0))\n"
        "run_hydra_app(lambda: atexit.register(lambda: print('during the run:', gc.get_freeze_count() > 0)))\n"
        "unclosed = open('unclosed.txt', 'w')\n"
        "unclosed.write('kept')  # a file nothing closes, held by a module: still flushed\n"
    )
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["during the run: False", "before run(): True"]
    assert (tmp_path / "unclosed.txt").read_text() == "kept"


class CollectorProbe:
    """A callback that notes the garbage collector's state at the run's start and at each
    step: (on at all, anything frozen), and whether the run's model is among the frozen
    objects (gc.get_objects lists the tracked objects that are not); in collector.json in the
    run dir at the run's end."""

    def __init__(self):
        self.seen: dict[str, list] = {"on_run_start": [], "on_train_batch_end": []}
        self.model_frozen = None

    def note(self, hook: str) -> None:
        state = [gc.isenabled(), gc.get_freeze_count() > 0]
        if state not in self.seen[hook]:
            self.seen[hook].append(state)

    def on_run_start(self, run) -> None:
        self.note("on_run_start")

    def on_train_batch_end(self, run, loss) -> None:
        self.note("on_train_batch_end")
        if self.model_frozen is None:
            self.model_frozen = not any(o is run.model for o in gc.get_objects())

    def on_run_end(self, run, metrics) -> None:
        seen = {**self.seen, "model_frozen": self.model_frozen}
        (run.run_dir / "collector.json").write_text(json.dumps(seen))


def test_train_pys_start_up_imports_without_the_collector_and_freezes_what_they_built(tmp_path):
    """About a second of a 2-core CPU's start-up is the collector walking the heap again and again
    while torch, dynamo, torchmetrics and the rest import (saturate.started). train.py's
    run turns it off until task() has imported them; then everything alive is frozen (the
    collector's later passes skip it) and the collector is on for the whole run. What the
    run builds, its model first, is not frozen."""
    probe = "+callbacks.collector._target_=tests.test_cli.CollectorProbe"
    result = run_cli(*TINY, probe, "hydra.run.dir=run", cwd=tmp_path, env={"PYTHONPATH": str(ROOT)}, fresh=True)
    assert result.returncode == 0, result.stderr
    seen = json.loads((tmp_path / "run" / "collector.json").read_text())
    assert seen == {
        "on_run_start": [[True, True]],
        "on_train_batch_end": [[True, True]],
        "model_frozen": False,
    }


def test_the_collector_is_left_alone_by_python_calls_a_users_off_switch_and_a_multirun(make_cfg, monkeypatch):
    """saturate.train from Python does not touch the collector; a collector the user turned
    off stays off and nothing is frozen; a multirun's parent (which may wait on a launcher for
    hours) keeps its collector on."""
    import saturate
    from saturate.cli import run_hydra_app
    from saturate.config.invocation import SCRIPT
    from saturate.started import pause_collector, resume_collector
    from saturate.trainer.build import UserObjects

    probe = CollectorProbe()
    saturate.train(make_cfg(), objects=UserObjects(callbacks={"probe": probe}))
    assert probe.seen == {"on_run_start": [[True, False]], "on_train_batch_end": [[True, False]]}

    gc.disable()
    try:
        pause_collector()
        resume_collector(freeze=True)  # what task() does once its imports are done
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()

    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "trainer.seed=1,2"])  # as run_hydra_app() sees them
    monkeypatch.setenv(SCRIPT, "unset")  # run_hydra_app() sets it: undone after the test
    on = []
    run_hydra_app(lambda: on.append(gc.isenabled()))
    assert on == [True] and gc.isenabled() and gc.get_freeze_count() == 0


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
