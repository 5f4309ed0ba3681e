"""The user's own data, model, loss, metrics, loggers and callbacks: from their own package
and config dir (hydra.searchpath), or from one Python call (saturate.fit). Nothing of
saturate is edited; the package is written to a temp dir and put on PYTHONPATH."""

from __future__ import annotations

import csv
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import saturate
from saturate.errors import ConfigError, DataError, UserError
from tests.conftest import ROOT, TINY, compose_config, read_metrics, run_cli
from tests.trainer.test_run import events

PACKAGE = {
    "sensorpkg/__init__.py": "",
    "sensorpkg/data.py": '''
        import numpy as np
        from torch.utils.data import Dataset

        class Arrays(Dataset):
            """numpy float64 windows (T, F) with values in the hundreds, as a sensor gives them."""

            def __init__(self, x, y):
                self.x, self.y = x, y

            def __len__(self):
                return len(self.y)

            def __getitem__(self, i):
                return self.x[i], self.y[i]

        def windows(kind, n_train=192, n_val=64, window=6, features=3, seed=0):
            rng = np.random.default_rng(seed)
            x = rng.uniform(100.0, 900.0, (n_train + n_val, window, features))
            level = x[:, -1, 0] / 900.0
            y = level.astype(np.float32) if kind == "regression" else (level > 0.55).astype(np.int64)
            return Arrays(x[:n_train], y[:n_train]), Arrays(x[n_train:], y[n_train:])
    ''',
    "sensorpkg/model.py": """
        import math
        from torch import nn

        class MLP(nn.Module):
            def __init__(self, input_shape, num_outputs, hidden=32):
                super().__init__()
                self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                                         nn.Linear(hidden, num_outputs))

            def forward(self, x):
                return self.net(x / 900.0)  # the model scales its own inputs: saturate must not
    """,
    "conf/data/sensors.yaml": """
        _target_: sensorpkg.data.windows
        kind: regression
        n_train: 192
        n_val: 64
    """,
    "conf/model/mlp.yaml": """
        _target_: sensorpkg.model.MLP
        hidden: 32
    """,
}


@pytest.fixture(scope="module")
def user_package(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user")
    for name, text in PACKAGE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip())
    sys.path.insert(0, str(root))  # for the in-process tests; the CLI tests get PYTHONPATH
    yield root
    sys.path.remove(str(root))


def user_cfg(root: Path, run_dir: Path, *overrides: str):
    return compose_config(
        [*TINY, f"hydra.searchpath=[file://{root}/conf]", "data=sensors", "model=mlp", f"run_dir={run_dir}", *overrides]
    )


@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_a_user_package_and_config_dir_train_through_train_py(user_package, tmp_path, kind):
    result = run_cli(
        f"hydra.searchpath=[file://{user_package}/conf]",
        "data=sensors",
        "model=mlp",
        f"task={kind}",
        f"data.kind={kind}",
        *TINY,
        "trainer.max_epochs=2",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        env={"PYTHONPATH": str(user_package)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert metrics["status"] == "completed" and metrics["task"] == kind and metrics["data"] == "sensors"
    expected = {"regression": ["val/loss", "val/mae", "val/rmse", "val/r2"], "classification": ["val/loss", "val/acc"]}[
        kind
    ]
    assert all(np.isfinite(metrics[k]) for k in expected)
    assert "val/top5" not in metrics  # 2 classes
    assert ("val/acc" in metrics) == (kind == "classification")
    scalars = events(tmp_path / "run").Tags()["scalars"]
    assert all(k in scalars for k in expected)


class Recording(nn.Module):
    """A model that keeps the first batch it is given (from the loop or the evaluator)."""

    def __init__(self, in_features: int, num_outputs: int):
        super().__init__()
        self.linear = nn.Linear(in_features, num_outputs)
        self.inputs: list[torch.Tensor] = []

    def forward(self, x):  # x: (B, T, F)
        self.inputs.append(x.detach().clone())
        return self.linear(x[:, -1] / 900.0)


def test_float_inputs_reach_the_model_unscaled(user_package, tmp_path):
    from sensorpkg.data import windows

    train, val = windows("regression")
    model = Recording(in_features=3, num_outputs=1)
    saturate.fit(
        model, train, val, task="regression", overrides=[*TINY, "trainer.limit_val_batches=1"], run_dir=tmp_path
    )
    # the last evaluation: the first 32 validation samples, in order (the advice checks after it take 2)
    evaluated = [x for x in model.inputs if len(x) == 32][-1]
    torch.testing.assert_close(evaluated, torch.from_numpy(val.x[:32]).float(), rtol=0, atol=0)
    assert evaluated.dtype == torch.float32 and evaluated.max() > 100  # float64 -> float32, values untouched


def test_loader_resident_materialises_any_dataset(user_package, tmp_path):
    metrics = saturate.train(user_cfg(user_package, tmp_path, "task=regression", "loader=resident"))
    assert metrics["progress/step"] == 3 and np.isfinite(metrics["val/rmse"])


def test_a_model_taking_only_num_classes(tmp_path):
    """A timm-style factory: only `num_classes`; saturate passes nothing else."""
    root = ROOT / "examples" / "my_images" / "conf"
    cfg = compose_config([*TINY, f"hydra.searchpath=[file://{root}]", "experiment=my_images", f"run_dir={tmp_path}"])
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 3 and read_metrics(tmp_path)["status"] == "completed"


def test_fit_end_to_end_writes_the_run_dir(user_package, tmp_path):
    from sensorpkg.data import windows
    from sensorpkg.model import MLP

    train, val = windows("regression")
    metrics = saturate.fit(
        MLP((6, 3), 1), train, val, task="regression", overrides=[*TINY, "trainer.max_epochs=3"], run_dir=tmp_path
    )
    # no .hydra/: fit runs no Hydra app
    for name in (
        "metrics.json",
        "report.md",
        "checkpoints/last.pt",
        "checkpoints/best.pt",
    ):
        assert (tmp_path / name).exists(), name
    assert list(tmp_path.glob("events.out.tfevents.*"))  # TensorBoard's, in the run dir
    written = read_metrics(tmp_path)
    assert written["status"] == "completed" and written["monitor"] == "val/loss" and written["data"] == "Arrays"
    assert float(metrics) == metrics["val/loss"] == written["val/loss"]
    assert events(tmp_path).Scalars("val/rmse")[-1].value == pytest.approx(metrics["val/rmse"])
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=False)["config"]
    assert (
        saved["model"] == {"object": "sensorpkg.model.MLP"} and saved["task"]["_target_"] == "saturate.tasks.Regression"
    )


def test_fit_without_a_validation_set_monitors_the_training_loss(user_package, tmp_path):
    from sensorpkg.data import windows
    from sensorpkg.model import MLP

    train, _ = windows("classification")
    metrics = saturate.fit(MLP((6, 3), 2), train, overrides=TINY, run_dir=tmp_path)
    assert metrics.objective == "train/loss" and not any(k.startswith("val/") for k in metrics)
    assert (tmp_path / "checkpoints" / "best.pt").is_file()


def test_a_user_loss_replaces_the_task_loss(user_package, tmp_path):
    """From the config (a `_target_` node) and from fit (a callable): the loss the step and
    the evaluator call, while the task's metrics stay."""
    cfg = user_cfg(
        user_package, tmp_path / "cfg", "task=regression", "+task.loss={_target_: torch.nn.HuberLoss, delta: 0.001}"
    )
    metrics = saturate.train(cfg)
    huber = metrics["val/loss"]
    assert huber < 0.001 * metrics["val/mae"] + 1e-9  # Huber with a tiny delta is about delta x |error|, far below MSE
    assert "val/rmse" in metrics

    from sensorpkg.data import windows
    from sensorpkg.model import MLP

    calls = []

    def loss(outputs, targets):
        calls.append(outputs.shape)
        assert outputs.shape == targets.shape
        return (outputs - targets).abs().mean()  # (B,) and (B,): the model's (B, 1) is given in the targets' shape

    train, val = windows("regression")
    metrics = saturate.fit(
        MLP((6, 3), 1), train, val, task="regression", loss=loss, overrides=TINY, run_dir=tmp_path / "fit"
    )
    assert metrics["val/loss"] == pytest.approx(metrics["val/mae"], rel=1e-5)  # the loss is the MAE here
    assert len(calls) >= 3


def test_checkpoint_monitor_val_rmse_keeps_the_lowest(user_package, tmp_path):
    cfg = user_cfg(
        user_package,
        tmp_path,
        "task=regression",
        "checkpoint.monitor=val/rmse",
        "trainer.max_epochs=4",
        "optim.optimizer.lr=0.5",
    )
    saturate.train(cfg)
    history = [e.value for e in events(tmp_path).Scalars("val/rmse")]
    best = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=False)
    assert best["best"] == pytest.approx(min(history))
    assert read_metrics(tmp_path)["monitor"] == "val/rmse"


class Recorder:
    """A user's logger: it keeps everything it is given (the observer protocol)."""

    def __init__(self):
        self.metrics: dict[tuple[str, int], float] = {}

    def on_log(self, run, metrics, step):
        self.metrics.update({(k, step): float(v) for k, v in metrics.items()})


class Hooks:
    """A user's callback: the hooks it saw, in order."""

    def __init__(self):
        self.hooks: list[str] = []

    def on_run_start(self, run):
        self.hooks.append(f"start:{run.info['task']}")

    def on_eval_end(self, run, metrics):
        self.hooks.append(f"eval:{run.step}")

    def on_checkpoint(self, run, path):
        self.hooks.append(f"checkpoint:{run.step}")

    def on_run_end(self, run, metrics):
        self.hooks.append(f"end:{metrics['status']}")


def test_a_custom_logger_gets_what_tensorboard_gets_and_callbacks_see_the_run(user_package, tmp_path):
    from sensorpkg.data import windows
    from sensorpkg.model import MLP

    recorder, hooks = Recorder(), Hooks()
    train, val = windows("regression")
    overrides = [*TINY, "trainer.max_epochs=2", "logger=[tensorboard,csv]"]
    saturate.fit(
        MLP((6, 3), 1),
        train,
        val,
        task="regression",
        overrides=overrides,
        run_dir=tmp_path,
        loggers=[recorder],
        callbacks=[hooks],
    )
    from saturate.loggers import TensorBoardLogger

    acc = events(tmp_path)
    tensorboard = {  # less the HParams table's copies of the compared metrics' final values
        (tag, e.step): e.value
        for tag in acc.Tags()["scalars"]
        if not tag.startswith(TensorBoardLogger.COMPARE)
        for e in acc.Scalars(tag)
    }

    assert {
        k for k in recorder.metrics if k[0] not in TensorBoardLogger.HIDDEN
    } == tensorboard.keys()  # less the x axis
    for key, value in tensorboard.items():
        assert recorder.metrics[key] == pytest.approx(value, rel=1e-6), key  # TensorBoard stores float32
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = {(r["name"], int(r["step"])): float(r["value"]) for r in csv.DictReader(f)}
    assert rows == recorder.metrics
    # checkpoint_interval=auto: a run under a minute saves at its end only
    assert hooks.hooks == ["start:regression", "eval:3", "eval:6", "checkpoint:6", "end:completed"]


def test_loggers_and_callbacks_from_the_config(user_package, tmp_path):
    (user_package / "sensorpkg" / "hooks.py").write_text(
        "import json\nclass Ends:\n    def __init__(self, path):\n        self.path = path\n    def on_run_end(self, "
        "run, metrics):\n        open(self.path, 'w').write(json.dumps(metrics['status']))\n"
    )
    out = tmp_path / "ended.json"
    cfg = user_cfg(
        user_package,
        tmp_path / "run",
        "task=regression",
        "logger=[csv]",
        "+callbacks.ends._target_=sensorpkg.hooks.Ends",
        f"+callbacks.ends.path='{out}'",
    )
    saturate.train(cfg)
    assert json.loads(out.read_text()) == "completed"
    assert (tmp_path / "run" / "metrics.csv").is_file() and not list(
        (tmp_path / "run").glob("**/events.out.tfevents.*")
    )


@pytest.mark.parametrize(
    ("override", "named"),
    [
        (
            "augmentation=gpu",
            "augmentation.placement='gpu': expected none: augmentation works on image inputs (C, H, W)",
        ),
        ("augmentation=cpu", "augmentation.placement='cpu': expected none"),
        (
            "trainer.channels_last=true",
            "trainer.channels_last=True: expected false: channels_last is a layout of image inputs",
        ),
    ],
)
def test_image_only_options_on_sequences_are_a_clean_error(user_package, tmp_path, override, named):
    result = run_cli(
        f"hydra.searchpath=[file://{user_package}/conf]",
        "data=sensors",
        "model=mlp",
        "task=regression",
        *TINY,
        override,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        env={"PYTHONPATH": str(user_package)},
    )
    assert result.returncode == 1
    assert named in result.stderr and "6x3 float64 inputs" in result.stderr
    assert "Traceback" not in result.stderr


def test_data_and_model_that_do_not_fit_are_clean_errors(user_package, tmp_path):
    with pytest.raises(DataError, match="task=classification: the targets are float32 of shape"):
        saturate.train(user_cfg(user_package, tmp_path / "a"))  # regression targets, classification task
    with pytest.raises(
        UserError, match=r"returns outputs of shape \(2, 1\) for a batch of 2; task=classification with 2 classes"
    ):
        saturate.train(user_cfg(user_package, tmp_path / "b", "data.kind=classification", "+model.num_outputs=1"))
    shapes = (
        r"\(6x3 float64 inputs, real targets of shape \(\)\) and task regression: RuntimeError: mat1 and mat2 "
        r"shapes cannot"
    )
    with pytest.raises(UserError, match=r"model: Linear does not fit the data " + shapes):
        from sensorpkg.data import windows

        saturate.fit(nn.Linear(5, 1), *windows("regression"), task="regression", overrides=TINY, run_dir=tmp_path / "c")
    with pytest.raises(
        ConfigError, match="checkpoint.monitor='val/acc': expected auto or a metric the run logs: train/loss, val/loss"
    ):
        saturate.train(user_cfg(user_package, tmp_path / "d", "task=regression", "checkpoint.monitor=val/acc"))


class Pairs(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((4,), i % 7, dtype=np.float32), float(i % 7)


def test_data_sources_that_break_the_contract_are_named(tmp_path):
    class Single(Pairs):
        def __getitem__(self, i):
            return np.zeros(4, dtype=np.float32)

    with pytest.raises(DataError, match=r"a training sample is a ndarray; expected a pair \(input, target\)"):
        saturate.fit(nn.Linear(4, 1), Single(64), task="regression", overrides=TINY, run_dir=tmp_path / "a")
    with pytest.raises(DataError, match="the training set is empty"):
        saturate.fit(nn.Linear(4, 1), Pairs(0), task="regression", overrides=TINY, run_dir=tmp_path / "b")
    metrics = saturate.fit(
        nn.Linear(4, 1), Pairs(96), Pairs(32), task="regression", overrides=TINY, run_dir=tmp_path / "c"
    )
    assert np.isfinite(metrics["val/r2"])


def test_resume_with_a_user_dataset_is_bit_exact(user_package, tmp_path):
    exact = [
        "device=cpu",
        "task=regression",
        "trainer.deterministic=true",
        "trainer.limit_train_batches=-1",
        "trainer.limit_val_batches=-1",
    ]
    whole = user_cfg(user_package, tmp_path / "whole", *exact, "trainer.max_epochs=2")
    saturate.train(whole)
    first = user_cfg(user_package, tmp_path / "parts", *exact, "trainer.max_epochs=1")
    saturate.train(first)
    second = user_cfg(user_package, tmp_path / "parts", *exact, "trainer.max_epochs=2", "trainer.resume=auto")
    saturate.train(second)
    a = torch.load(tmp_path / "whole" / "checkpoints" / "last.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "parts" / "checkpoints" / "last.pt", weights_only=False)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
