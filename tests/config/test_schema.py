"""Every option of every group composes and validates; bad input is rejected with the key,
the value and what is allowed, every problem at once."""

from __future__ import annotations

import pickle

import pytest
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

import saturate
from saturate.config.schema import RunConfig, validate
from saturate.errors import ConfigError
from tests.conftest import CONF, TINY, compose_config

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "sweep")
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))]


def test_every_group_has_options():
    for group in ("device", "precision", "loader", "augmentation", "model", "data", "task", "optim", "experiment"):
        assert any(g == group for g, _ in OPTIONS), group


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_validates(group, option, tmp_path):
    cfg = compose_config([f"{group}={option}", f"run_dir={tmp_path}"])
    run = validate(cfg)
    assert isinstance(run, RunConfig)
    assert run.run_dir == str(tmp_path)


# (override, what the message must name): checked by our validator, all at once
VALUE_PROBLEMS = [
    ("loader.num_workers=-1", "loader.num_workers=-1"),
    ("loader.batch_size=0", "loader.batch_size=0"),
    ("loader.pin_memory=maybe", "loader.pin_memory='maybe'"),
    ("loader.prefetch_factor=0", "loader.prefetch_factor=0"),
    ("trainer.eval_interval=0", "trainer.eval_interval=0"),
    ("trainer.max_epochs=0", "trainer.max_epochs=0"),
    ("trainer.log_level=LOUD", "trainer.log_level='LOUD'"),
    ("device.memory_fraction=1.5", "device.memory_fraction=1.5"),
    ("device.memory_fraction=0", "device.memory_fraction=0.0"),
    ("device.type=tpu", "device.type='tpu'"),
    ("precision.mode=fp8", "precision.mode='fp8'"),
    ("optim.schedule=linear", "optim.schedule='linear'"),
    ("+data.val_fractoin=0.5", "data.val_fractoin=0.5"),
    ("+task.kind=ranking", "task.kind='ranking': expected an argument of saturate.tasks.Classification"),
    ("task.label_smoothing=abc", "task.label_smoothing='abc': expected a number (Classification's label_smoothing)"),
    ("task._target_=nowhere.Task", "task._target_='nowhere.Task'"),
    ("+task.metrics.f1._target_=torchmetrics.nowhere.F1", "task.metrics.f1._target_='torchmetrics.nowhere.F1'"),
    ("checkpoint.monitor=rmse", "checkpoint.monitor='rmse': expected auto, or a metric the run logs"),
    ("checkpoint.mode=best", "checkpoint.mode='best'"),
    ("+logger.mine._target_=nowhere.Logger", "logger.mine._target_='nowhere.Logger'"),
    ("+callbacks.mine._target_=nowhere.Callback", "callbacks.mine._target_='nowhere.Callback'"),
    ("augmentation.transforms=[{_target_:nowhere.Flip}]", "augmentation.transforms[0]._target_='nowhere.Flip'"),
    ("+model.widht=3", "model.widht=3"),
    ("+trainer.max_epoch=3", "trainer.max_epoch=3"),
    ("+optim.optimizer.momentun=0.9", "optim.optimizer.momentun=0.9"),
    ("model._target_=nowhere.Model", "model._target_='nowhere.Model'"),
    ("augmentation.hflip=1.5", "augmentation.hflip=1.5"),
    ("augmentation.erasing=-0.1", "augmentation.erasing=-0.1"),
    ("augmentation.rotation=-3", "augmentation.rotation=-3.0"),
    ("augmentation.preset=extreme", "augmentation.preset='extreme'"),
    ("augmentation.translate=0.9", "augmentation.translate=0.9"),
    ("augmentation.schedule=[{from_epoch:0,preset:minimal},{from_epoch:0,preset:strong}]", "augmentation.schedule="),
    ("augmentation.schedule=[{from_epoch:2,preset:strong}]", "the first at 0"),
    ("augmentation.placement=tpu", "augmentation.placement='tpu'"),
]


@pytest.mark.parametrize(("override", "named"), VALUE_PROBLEMS, ids=[o for o, _ in VALUE_PROBLEMS])
def test_bad_value_is_named_with_what_is_allowed(override, named, tmp_path):
    with pytest.raises(ConfigError) as err:
        validate(compose_config([override, f"run_dir={tmp_path}"]))
    message = str(err.value)
    assert named in message
    assert "expected" in message
    assert len(err.value.problems) == 1


def test_all_problems_are_reported_together(tmp_path):
    overrides = [o for o, _ in VALUE_PROBLEMS[:8]]
    with pytest.raises(ConfigError) as err:
        validate(compose_config([*overrides, f"run_dir={tmp_path}"]))
    assert len(err.value.problems) == 8
    for _, named in VALUE_PROBLEMS[:8]:
        assert named in str(err.value)


def test_data_keys_are_the_arguments_of_the_data_callable(tmp_path):
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["data=synthetic", "+data.root=/x", "~data.seed", f"run_dir={tmp_path}"]))
    message = str(err.value)
    assert "data.root='/x': expected an argument of saturate.data.synthetic.make_synthetic: num_train" in message
    assert "data.seed='(missing)': expected a value: saturate.data.synthetic.make_synthetic requires it" in message


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["data=synthetic", "data.num_train=0"], "data.num_train=0: expected an integer >= 1"),
        (
            ["data=synthetic", "data.num_train=many"],
            "data.num_train='many': expected an integer (make_synthetic's num_train)",
        ),
        (["data=synthetic", "data.num_classes=1"], "data.num_classes=1: expected an integer >= 2"),
        (["data.val_fraction=1.5"], "data.val_fraction=1.5: expected a number in (0, 1)"),
        (["data=image_folder", "data.channels=2"], "data.channels=2: expected one of 1, 3"),
    ],
)
def test_built_in_data_options_check_their_values(overrides, named, tmp_path):
    """The built-in data callables check their own arguments, as a user's may; a value of
    another type than the argument's annotation is named before they are called."""
    with pytest.raises(ConfigError) as err:
        saturate.train(compose_config([*TINY, *overrides, f"run_dir={tmp_path}"]))
    assert named in str(err.value)


def test_monitor_and_mode_must_agree(tmp_path):
    from saturate.tasks import Classification, Regression

    with pytest.raises(ConfigError) as err:
        validate(compose_config(["checkpoint.monitor=val/loss", "checkpoint.mode=max", f"run_dir={tmp_path}"]))
    assert "checkpoint.mode='max': expected min or auto for checkpoint.monitor=val/loss (lower is better)" in str(
        err.value
    )
    regression, classification = Regression(1), Classification(10)
    run = validate(compose_config(["task=regression", "checkpoint.monitor=val/r2", f"run_dir={tmp_path}"]))
    assert run.checkpoint.resolved(regression, has_val=True).mode == "max"
    assert run.checkpoint.resolved(regression, has_val=True).monitor == "val/r2"
    assert (
        validate(compose_config([f"run_dir={tmp_path}"])).checkpoint.resolved(classification, has_val=True).monitor
        == "val/acc"
    )
    assert (
        validate(compose_config([f"run_dir={tmp_path}"])).checkpoint.resolved(regression, has_val=False).monitor
        == "train/loss"
    )
    with pytest.raises(ConfigError, match="checkpoint.mode='min': expected max or auto for checkpoint.monitor=val/r2"):
        validate(
            compose_config(["checkpoint.monitor=val/r2", "checkpoint.mode=min", f"run_dir={tmp_path}"])
        ).checkpoint.resolved(regression, has_val=True)
    with pytest.raises(
        ConfigError, match="checkpoint.monitor='val/rmse': expected auto or a metric the run logs: train/loss, val/loss"
    ):
        validate(compose_config(["checkpoint.monitor=val/rmse", f"run_dir={tmp_path}"])).checkpoint.resolved(
            classification, True
        )


# Problems Hydra itself catches while composing: wrong types, unknown keys and options.
COMPOSE_PROBLEMS = [
    ("trainer.max_epochs=abc", "trainer.max_epochs"),
    ("trainer.foo=1", "trainer.foo"),
    ("model=vgg", "model/vgg"),
    ("precision=fp8", "precision/fp8"),
    ("trainer.compile=perhaps", "trainer.compile"),
]


@pytest.mark.parametrize(("override", "named"), COMPOSE_PROBLEMS, ids=[o for o, _ in COMPOSE_PROBLEMS])
def test_compose_rejects_wrong_types_and_unknown_names(override, named):
    with pytest.raises((HydraException, OmegaConfBaseException)) as err:
        compose_config([override])
    assert named in str(err.value) + str(err.value.__cause__)


def test_a_config_error_survives_pickling_with_its_problems(tmp_path):
    # a SLURM job's error comes back to the sweep through a pickle (submitit's result file)
    with pytest.raises(ConfigError) as err:
        validate(compose_config([o for o, _ in VALUE_PROBLEMS[:2]] + [f"run_dir={tmp_path}"]))
    back = pickle.loads(pickle.dumps(err.value))
    assert type(back) is ConfigError
    assert back.problems == err.value.problems and str(back) == str(err.value)


COUNTED = """
import atexit, runpy, sys
import saturate.config.schema as schema

checks, validate = [], schema.validate


def counted(cfg, **kwargs):  # installed before anything imports validate by name
    checks.append(1)
    return validate(cfg, **kwargs)


schema.validate = counted
atexit.register(lambda: print(f"config checks: {len(checks)}", file=sys.stderr))
"""


@pytest.mark.parametrize(
    ("how", "composed"),
    [
        (["train.py", "hydra.run.dir=run"], 1),  # a single run: composed once, checked once
        (["train.py", "-m", "trainer.seed=1,2", "hydra.sweep.dir=sweep"], 2),  # one process, two composed configs
        (["train.py", "loader.num_workers=-1", "hydra.run.dir=bad"], 1),  # a mistake: answered by the one check
        (["fit"], 1),
    ],
    ids=["single-run", "multirun-two-jobs", "mistake", "fit"],
)
def test_each_composed_config_is_checked_once(how, composed, tmp_path):
    """train.py's task checks the config and passes the typed result down (train() takes it as
    it is); saturate.fit's call checks its own in train()."""
    from tests.conftest import ROOT, python

    if how == ["fit"]:
        tiny = ", ".join(repr(o) for o in TINY)
        then = (
            "import saturate, torch\n"
            "x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))\n"
            "data = torch.utils.data.TensorDataset(x, y)\n"
            "saturate.fit(lambda in_features, num_classes: torch.nn.Linear(in_features, num_classes), data, data,\n"
            f"             overrides=[{tiny}], run_dir='fitted')\n"
        )
    else:
        flags = [a for a in how[1:] if a.startswith("-")]
        argv = [str(ROOT / how[0]), *flags, *TINY, *(a for a in how[1:] if a not in flags)]
        then = f"sys.argv = {argv!r}\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    done = python("-c", COUNTED + then, cwd=tmp_path, timeout=240)
    assert f"config checks: {composed}\n" in done.stderr, done.stderr[-3000:]
    assert done.returncode == (1 if "loader.num_workers=-1" in how else 0), done.stderr[-3000:]
