"""The README's examples, run as a user runs them: each workload from its own config dir
(hydra.searchpath) through train.py, each through its saturate.fit script, and one under
torchrun. Nothing in saturate is edited for them."""

from __future__ import annotations

import ast
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, TINY, python, read_metrics, run_cli
from tests.scale.test_distributed import torchrun
from tests.trainer.test_run import events

EXAMPLES = [  # (folder, experiment, task, a metric it logs, a test metric it logs or None)
    ("timeseries", "co2", "regression", "val/rmse", None),
    ("sequences", "digit_rows", "classification", "val/acc", None),
    ("my_images", "my_images", "classification", "val/acc", None),
    ("pm25", "pm25", "regression", "val/mape_raw", "test/rmse_raw"),
    ("har", "har", "classification", "val/f1/walking", "test/f1/laying"),
    ("sign", "sign", "sequence", "val/ter", "test/seq_acc"),
    ("gray128", "gray128", "classification", "val/acc", None),
    ("segmentation", "segmentation", "segmentation", "val/dice", None),
    ("forecast", "forecast", "regression", "val/rmse", None),
    ("mixup", "mixup", "classification", "val/acc", "test/acc"),
]


def example_cli(tmp_path, folder: str, experiment: str, *overrides: str) -> dict:
    conf = ROOT / "examples" / folder / "conf"
    result = run_cli(
        f"hydra.searchpath=[file://{conf}]",
        f"experiment={experiment}",
        *TINY,
        *overrides,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(tmp_path / "run")


def fit_script(tmp_path, folder: str, script: str, *overrides: str) -> tuple[str, dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    result = python(ROOT / "examples" / folder / script, *TINY, *overrides, f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, read_metrics(tmp_path / "run")


@pytest.mark.slow  # ten end-to-end CLI runs
@pytest.mark.parametrize(
    ("folder", "experiment", "kind", "metric", "test_metric"), EXAMPLES, ids=[e[1] for e in EXAMPLES]
)
def test_example_trains_from_its_config_dir(tmp_path, folder, experiment, kind, metric, test_metric):
    metrics = example_cli(tmp_path, folder, experiment)
    assert metrics["status"] == "completed" and metrics["task"] == kind and metric in metrics
    assert test_metric is None or test_metric in metrics


def test_fit_example(tmp_path):
    stdout, metrics = fit_script(tmp_path, "timeseries", "fit_co2.py")
    assert "val/rmse" in stdout and metrics["data"] == "Windows"


def test_pm25_reports_the_test_days_in_micrograms(tmp_path):
    """The PM2.5 port: a time-ordered test split evaluated with best.pt, its metrics also in
    µg/m³ through the data's target_inverse (the scaler's inverse: every error scales by its
    std), MAPE included; early stopping listed as the original had it."""
    from examples.pm25.pm25 import load_pm25

    stdout, metrics = fit_script(tmp_path, "pm25", "fit_pm25.py")
    assert "test (µg/m³): r2" in stdout
    std = float(load_pm25()["target_inverse"](torch.ones(1)) - load_pm25()["target_inverse"](torch.zeros(1)))
    for name in ("rmse", "mae"):
        assert metrics[f"test/{name}_raw"] == pytest.approx(metrics[f"test/{name}"] * std, rel=1e-4)
    assert metrics["test/r2_raw"] == pytest.approx(metrics["test/r2"], abs=1e-4)  # R² has no units
    assert 0 < metrics["test/mape_raw"] < 10 and metrics["test/mape_raw"] != metrics["test/mape"]


@pytest.mark.slow  # the author's script and train.py, three epochs each
def test_pm25_learns_what_its_authors_script_learns(tmp_path):
    """experiment=pm25 with trainer.seed=N against reference.py --seed N (the author's script
    with the example's data): the same validation loss after every epoch, to the five decimals
    the script prints (loader.order=global and Adam not fused; with the defaults they part at
    the first epoch)."""
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ref = python(ROOT / "examples/pm25/reference.py", "--seed", "3", "--epochs", "3", cwd=tmp_path, env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = [float(v) for v in re.findall(r"BENCH eval .* val_loss=([\d.]+)", ref.stdout)]
    assert len(expected) == 3

    def val_losses(name: str, *overrides: str) -> list[float]:
        conf = ROOT / "examples" / "pm25" / "conf"
        run_dir = tmp_path / name
        args = [f"hydra.searchpath=[file://{conf}]", "experiment=pm25", "device=cpu", "trainer.seed=3"]
        args.append("trainer.max_epochs=3")  # the author's script runs on the CPU (DEVICE = torch.device('cpu'))
        result = run_cli(*args, *overrides, f"hydra.run.dir={run_dir}", cwd=ROOT, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        return [round(e.value, 5) for e in events(run_dir).Scalars("val/loss")][:3]

    assert val_losses("port") == expected
    assert val_losses("defaults", "loader.order=seeded", "optim.optimizer.fused=true")[0] != expected[0]


def test_pm25_split_is_in_time_order_without_overlap():
    """Every day is the target of exactly one window, train's days before val's before
    test's; the scaler is fitted on the training days only."""
    from examples.pm25.pm25 import load_pm25, make_days

    data = load_pm25(window_size=30, days=400)
    assert [len(data[k]) for k in ("train", "val", "test")] == [280 - 29, 60, 60]
    pm25 = make_days(400, 0)[1]
    scaled = (pm25 - pm25[:280].mean()) / (pm25[:280].std() + 1e-12)
    ends = {"train": (29, 279), "val": (280, 339), "test": (340, 399)}
    for split, (first, last) in ends.items():
        ds = data[split]
        assert float(ds[0][1]) == pytest.approx(scaled[first], rel=1e-5)
        assert float(ds[len(ds) - 1][1]) == pytest.approx(scaled[last], rel=1e-5)


def test_har_logs_f1_per_activity_and_a_confusion_matrix(tmp_path):
    """The HAR port: per-class F1 (average=None) named by activity, for val and test, and the
    validation confusion matrix as a TensorBoard image."""
    from examples.har.har import ACTIVITIES

    stdout, metrics = fit_script(tmp_path, "har", "fit_har.py")
    for split in ("val", "test"):
        assert {f"{split}/f1/{a}" for a in ACTIVITIES} <= metrics.keys()
        assert all(0 <= metrics[f"{split}/f1/{a}"] <= 1 for a in ACTIVITIES)
    assert "val/top5" not in metrics  # top-5 of 6 classes means nothing
    images = events(tmp_path / "run").Tags()["images"]
    assert any("confusion" in tag for tag in images), images
    assert "F1 per activity" in stdout


def test_sign_trains_ctc_on_padded_variable_length_clips(tmp_path):
    """The sign-language port: dict samples of different lengths, the padding collate, CTC;
    its test predictions written as a pickle-free npz of decoded sign sequences."""
    stdout, metrics = fit_script(tmp_path, "sign", "fit_sign.py", "trainer.predict=test")
    assert metrics["task"] == "sequence" and {"val/ter", "val/seq_acc", "test/ter", "test/seq_acc"} <= metrics.keys()
    with np.load(tmp_path / "run" / "predictions" / "test.npz", allow_pickle=False) as saved:
        assert saved["output"].dtype == np.int64 and len(saved["index"]) == len(saved["output_length"])
        assert (
            (saved["output"] == -1) | ((saved["output"] >= 1) & (saved["output"] <= 10))
        ).all()  # signs, padded with -1
        target, lengths = saved["target"], saved["target_length"]
        assert ((target >= 1).sum(axis=1) == lengths).all() and (
            (target == -1).sum(axis=1) == target.shape[1] - lengths
        ).all()


def test_gray128_fit_and_cli_run_the_same_with_the_users_kornia_transforms(tmp_path):
    """Float images in [0, 1] through the user's own Kornia modules on the device: the fit
    script (a model class as factory) and train.py give the same run, seed for seed."""
    _, fitted = fit_script(tmp_path / "fit", "gray128", "fit_gray128.py")
    cli = example_cli(tmp_path / "cli", "gray128", "gray128")
    assert fitted["val/acc"] == cli["val/acc"] and fitted["train/loss"] == cli["train/loss"]
    plain = example_cli(tmp_path / "plain", "gray128", "gray128", "augmentation=none")
    assert plain["train/loss"] != cli["train/loss"]  # the transforms did change the training batches
    assert cli["perf/copy_ms"] > plain["perf/copy_ms"]  # and ran on the device side of the step


@pytest.mark.slow  # a U-Net on 128x128 images: 30 s here
def test_segmentation_moves_masks_on_the_device_and_exports_them(tmp_path):
    """The U-Net port through fit: evaluations five times an epoch (every 3 of its 15 steps),
    predicted masks exported, previews drawn."""
    overrides = ["loader.batch_size=16", "trainer.limit_train_batches=-1", "trainer.max_steps=6", "trainer.predict=val"]
    stdout, metrics = fit_script(tmp_path, "segmentation", "fit_segment.py", *overrides)
    assert "val/dice" in stdout and metrics["task"] == "segmentation" and metrics["monitor"] == "val/dice"
    steps = sorted({e.step for e in events(tmp_path / "run").Scalars("val/dice")})
    assert steps == [3, 6]  # every 3 steps (0.2 of 15), each at its step
    assert "val/preview" in events(tmp_path / "run").Tags()["images"]
    with np.load(tmp_path / "run" / "predictions" / "val.npz", allow_pickle=False) as saved:
        assert saved["mask"].shape == (32, 128, 128) and set(np.unique(saved["mask"])) <= {0, 1}


def authors_lr(epochs: int, lr: float) -> list[float]:
    """The LR each epoch trains at in the forecaster's reference loop: its own
    `adjust_learning_rate` (taken from reference.py's source alone, none of its imports), called
    as its loop calls it, after each epoch with epoch + 1."""
    source = (ROOT / "examples" / "forecast" / "reference.py").read_text()
    function = next(n for n in ast.parse(source).body if getattr(n, "name", "") == "adjust_learning_rate")
    space: dict = {}
    exec(compile(ast.Module([function], []), "reference.py", "exec"), space)  # noqa: S102 (the repository's own file)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    used = []
    for epoch in range(epochs):
        used.append(optimizer.param_groups[0]["lr"])
        space["adjust_learning_rate"](optimizer, epoch + 1, SimpleNamespace(lradj="type1", learning_rate=lr))
    return used


def test_forecast_feeds_two_inputs_and_keeps_the_authors_lr_schedule(tmp_path):
    """The example's LR per epoch is the one the author's loop trains at: the full LR for two
    epochs, then halved after each (a StepLR(1, 0.5) halves one epoch sooner)."""
    stdout, metrics = fit_script(tmp_path, "forecast", "fit_forecast.py", "trainer.max_epochs=4")
    assert "val/rmse" in stdout and metrics["data"] == "Windows"
    by_step = {e.step: e.value for e in events(tmp_path / "run").Scalars("train/lr")}
    firsts = [by_step[s] for s in (1, 4, 7, 10)]  # 3 steps an epoch (TINY)
    assert firsts == pytest.approx(authors_lr(4, 1e-3)) == [1e-3, 1e-3, 5e-4, 2.5e-4]


def test_mixup_classifier_through_fit(tmp_path):
    stdout, metrics = fit_script(tmp_path, "mixup", "fit_mixup.py", "mix.cutmix=1.0")
    assert "test/acc" in stdout and {"val/acc", "test/acc"} <= metrics.keys()
    assert metrics["facts"]["channels_last_ok"] is False  # LeNet's .view: never advised channels_last
    assert "trainer.channels_last=true" not in metrics["suggestions"]


@pytest.mark.slow  # two short runs
def test_mixup_fit_script_and_experiment_train_the_same(tmp_path):
    """fit_mixup.py writes the experiment's recipe out again (its transforms among it): the two
    must give the same run, seed for seed, or one of them has drifted."""
    _, fitted = fit_script(tmp_path / "fit", "mixup", "fit_mixup.py")
    cli = example_cli(tmp_path / "cli", "mixup", "mixup")
    assert (fitted["val/acc"], fitted["train/loss"]) == (cli["val/acc"], cli["train/loss"])
    plain = example_cli(tmp_path / "plain", "mixup", "mixup", "augmentation=none")
    assert plain["train/loss"] != cli["train/loss"]  # the transforms did change the training batches


@pytest.mark.slow
def test_a_user_dataset_under_ddp(tmp_path):
    """Two gloo processes on the sequence example: one run dir, identical parameters."""
    example = [f"hydra.searchpath=[file://{ROOT / 'examples' / 'sequences' / 'conf'}]", "experiment=digit_rows"]
    args = [*example, "trainer.max_epochs=4", "trainer.progress=false", f"hydra.run.dir={tmp_path / 'run'}"]
    result = torchrun(*args, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert metrics["distributed/params_identical"] == 1.0 and metrics["world_size"] == 2 and metrics["val/acc"] > 0.5


@pytest.mark.slow
def test_a_two_input_model_under_two_cpu_processes(tmp_path):
    """The forecaster (model(past, calendar)) with trainer.devices=2 device=cpu: two gloo
    processes, one run dir, identical parameters at the end, the author's per-epoch LR in both."""
    example = [f"hydra.searchpath=[file://{ROOT / 'examples' / 'forecast' / 'conf'}]", "experiment=forecast"]
    args = [*example, "device=cpu", "trainer.devices=2", "trainer.max_epochs=2", "trainer.progress=false"]
    result = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert metrics["world_size"] == 2 and metrics["distributed/params_identical"] == 1.0
    assert metrics["status"] == "completed" and metrics["train/lr"] == pytest.approx(5e-4)


def test_the_readmes_python_example_runs_as_printed(tmp_path):
    """The fit example on the README's first screens, run verbatim from an empty folder."""
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## Your model, from Python\n\n```python\n(.*?)```", readme, re.S).group(1)
    code += "import json; print(json.dumps({k: metrics[k] for k in ('val/acc', 'progress/epoch')}))\n"
    done = python("-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["progress/epoch"] == 10 and figures["val/acc"] > 0.9
    assert len(list((tmp_path / "outputs" / "runs").glob("*/*/metrics.json"))) == 1
