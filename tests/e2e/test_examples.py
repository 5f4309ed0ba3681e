"""The README's examples, run as a user runs them: each workload from its own config dir
(hydra.searchpath) through train.py, each through its saturate.fit script, and one under
torchrun. Nothing in saturate is edited for them."""

from __future__ import annotations

import ast
import json
import math
import re
import subprocess
import sys
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
    ("wordlm", "wordlm", "classification", "val/loss", None),
    ("vae", "vae", "regression", "val/loss", None),
    ("dcgan", "dcgan", "gan", "val/fd_pixels", None),
]
# chargpt counts its run in optimizer steps (its warm-up is 100 of them): run as TINY_STEPS
TINY_STEPS = ["trainer.limit_train_batches=-1", "trainer.max_steps=4", "trainer.eval_every=2"]
TINY_STEPS += ["optim.warmup_steps=3", "optim.decay_steps=4", "trainer.train_est_batches=2"]


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


@pytest.mark.slow  # twelve end-to-end CLI runs
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


# ---------------------------------------------------------------- the ported language models and VAE


def test_chargpt_windows_are_every_window_get_batch_can_draw():
    """One sample per offset of nanoGPT's get_batch (torch.randint(len(data) - block_size)):
    the window and the characters after it; the split is prepare.py's 90/10 by position."""
    from examples.chargpt.chargpt import corpus, encode_chars, load_chars

    chars, train, val = encode_chars()
    assert chars == sorted(set(corpus())) and len(train) == int(len(corpus()) * 0.9)
    data = load_chars(block_size=64)
    for split, ids in (("train", train), ("val", val)):
        ds = data[split]
        assert len(ds) == len(ids) - 64 and ds.classes == chars
        x, y = ds[len(ds) - 1]
        assert torch.equal(x, ids[-65:-1]) and torch.equal(y, ids[-64:])  # the last offset get_batch can draw


def test_chargpt_trains_on_its_own_loss_and_estimates_both_splits_on_random_batches(tmp_path):
    """experiment=chargpt: the model's own loss (`logits, loss = model(X, Y)`), evaluated every
    eval_every steps within the first epoch on random batches of val and of train
    (train_est/loss), the run ended by trainer.max_steps."""
    metrics = example_cli(tmp_path, "chargpt", "chargpt", *TINY_STEPS)
    assert metrics["status"] == "completed" and metrics["task"] == "classification" and metrics["progress/step"] == 4
    run = events(tmp_path / "run")
    for tag in ("val/loss", "train_est/loss"):
        assert {e.step for e in run.Scalars(tag)} == {2, 4}, tag
    assert "val/acc" not in run.Tags()["scalars"]  # the loss only, as estimate_loss
    first = run.Scalars("val/loss")[0].value
    assert math.log(103) - 0.5 < first < math.log(103) + 0.5  # 103 characters, near uniform after two steps
    assert run.Scalars("train_est/loss")[0].value != first  # the training split's own batches


def test_chargpt_fit_script_trains_what_the_experiment_trains(tmp_path):
    """fit_chargpt.py writes nanoGPT's recipe out again as overrides: seed for seed, the
    same run as experiment=chargpt."""
    stdout, fitted = fit_script(tmp_path / "fit", "chargpt", "fit_chargpt.py", *TINY_STEPS)
    cli = example_cli(tmp_path / "cli", "chargpt", "chargpt", *TINY_STEPS)
    assert "train_est/loss" in stdout and fitted["data"] == "CharWindows"
    assert (fitted["val/loss"], fitted["train_est/loss"]) == (cli["val/loss"], cli["train_est/loss"])


def test_wordlm_windows_follow_one_another_and_the_wrapper_is_the_authors_model_batch_first():
    """Sample i + 1 continues sample i (`stream = True`, as batchify's columns); BatchFirst gives
    the author's time-major log-probabilities as (B, T, ntoken) and passes the hidden state on."""
    from examples.wordlm.wordlm import BatchFirst, RNNModel, TokenWindows, encode_words

    dictionary, train, val = encode_words()
    assert dictionary.idx2word[train[0]] == dictionary.idx2word[0] and "<eos>" in dictionary.word2idx
    ds = TokenWindows(train, 35, dictionary.idx2word)
    assert TokenWindows.stream is True and len(ds) == (len(train) - 1) // 35
    (x0, y0), (x1, _) = ds[0], ds[1]
    assert torch.equal(x0[1:], y0[:-1]) and x1[0] == y0[-1]
    torch.manual_seed(0)
    author = RNNModel("LSTM", len(dictionary), 16, 16, 2, dropout=0.0).eval()
    x = torch.stack([ds[0][0], ds[5][0], ds[9][0]])  # (B=3, T=35)
    out, hidden = BatchFirst(author)(x)
    expected, expected_hidden = author(x.t(), author.init_hidden(3))  # (T*B, V), zeros as the author starts
    assert out.shape == (3, 35, len(dictionary))
    assert torch.allclose(out, expected.view(35, 3, -1).transpose(0, 1))
    assert torch.allclose(hidden[0], expected_hidden[0]) and torch.allclose(hidden[1], expected_hidden[1])
    carried, _ = BatchFirst(author)(x, hidden)  # the next window, from the state the first one left
    assert torch.allclose(carried, author(x.t(), hidden)[0].view(35, 3, -1).transpose(0, 1))


def test_wordlm_through_fit_reads_streams_in_order_with_the_state_carried(tmp_path):
    stdout, metrics = fit_script(tmp_path, "wordlm", "fit_wordlm.py", "loader.batch_size=20")
    assert "val ppl" in stdout and metrics["task"] == "classification" and metrics["data"] == "TokenWindows"
    assert 0 < metrics["val/loss"] < math.log(8832) + 1  # per word, in nats


def test_vae_loss_is_per_image_as_the_authors_test_loss(tmp_path):
    """task.loss_reduction=sum: the author's summed loss trains; val/loss is its sum over the
    evaluated images over their count (main.py's `test_loss /= len(test_loader.dataset)`),
    recomputed here with the author's loss_function and the run's last weights (the
    reparameterisation draws noise in evaluation too: equal to a few percent)."""
    from examples.vae.vae import VAE, load_digits_flat, loss_function

    stdout, metrics = fit_script(tmp_path, "vae", "fit_vae.py")  # TINY: two validation batches of 32
    assert metrics["task"] == "regression" and "per image" in stdout and "val/rmse" not in metrics
    model = VAE()
    model.load_state_dict(torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=False)["model"])
    images = load_digits_flat()["val"].x[:64]
    torch.manual_seed(0)
    with torch.no_grad():
        recon, mu, logvar = model.eval()(images)
        per_image = float(loss_function(recon, images, mu, logvar)) / len(images)
    assert metrics["val/loss"] == pytest.approx(per_image, rel=0.05)
    assert metrics["train/loss"] == pytest.approx(per_image, rel=0.2)  # per image too, not per batch of 32


@pytest.mark.parametrize("name", ["vae", *(pytest.param(n, marks=pytest.mark.slow) for n in ("wordlm", "chargpt"))])
def test_a_run_whose_task_has_no_metrics_never_imports_torchmetrics(tmp_path, name):
    """The VAE and the language models log their loss only (their task's metrics nulled, as their
    authors compute none): torchmetrics, whose import brings scipy.signal and matplotlib (about
    a second of a 7-s run's start-up on a 2-core CPU), is never imported, and val/loss is still
    logged."""
    conf = ROOT / "examples" / name / "conf"
    result = python(
        "-X",
        "importtime",
        ROOT / "train.py",
        f"hydra.searchpath=[file://{conf}]",
        f"experiment={name}",
        *TINY,
        *(TINY_STEPS if name == "chargpt" else ()),
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
        fresh=True,  # a new interpreter: the tests' zygote has torchmetrics imported already
    )
    assert result.returncode == 0, result.stderr[-3000:]
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")
    }
    assert "torch._C" in imported and "torchmetrics" not in imported
    metrics = read_metrics(tmp_path / "run")
    assert metrics["val/loss"] > 0 and "imports/torchmetrics_s" not in metrics


LM_TARGETS = [("chargpt", 1.75), ("wordlm", 6.1), ("vae", 24.2)]  # scripts/bench_examples.py's targets


@pytest.mark.slow  # each a whole run: 30 to 60 s
@pytest.mark.parametrize(("name", "target"), LM_TARGETS, ids=[t[0] for t in LM_TARGETS])
def test_the_ported_example_meets_its_target_with_its_whole_recipe(tmp_path, name, target):
    """The example's own command, whole, meets the target its docs and the bench name."""
    from scripts.bench_examples import EXAMPLES as BENCHED

    assert BENCHED[name].value == target and BENCHED[name].metric == "val/loss"
    conf = ROOT / "examples" / name / "conf"
    args = [f"hydra.searchpath=[file://{conf}]", f"experiment={name}", "trainer.seed=1", "trainer.progress=false"]
    result = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    run = events(tmp_path / "run")
    assert min(e.value for e in run.Scalars("val/loss")) <= target
    if name == "chargpt":  # nanoGPT's get_lr(10) = lr * 11 / (warmup_iters + 1): the LR once 10 steps are done
        assert run.Scalars("train/lr")[0].step == 10
        assert run.Scalars("train/lr")[0].value == pytest.approx(1e-3 * 11 / 101, rel=1e-5)


@pytest.mark.slow  # both sides of three short pairs
def test_the_quick_bench_runs_the_language_models_and_the_vae_against_their_references(tmp_path):
    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_examples.py"), "--quick", "--examples", "chargpt,wordlm,vae"]
    cmd += ["--threads", "1", "--out", str(tmp_path), "--results", str(results)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted((r["example"], r["side"]) for r in records) == [
        (name, side) for name in ("chargpt", "vae", "wordlm") for side in ("reference", "saturate")
    ]
    for r in records:
        assert r["rc"] == 0 and 0 < r["first_step_s"] < r["wall_s"] and 0 < r["final"] < 100, r


# ---------------------------------------------------------------- dcgan: two nets, two optimizers


def test_dcgan_nets_are_the_authors_at_32x32_on_the_digits_as_float_images():
    from examples.dcgan.dcgan import GAN, load_digits32

    data = load_digits32()
    (image, digit), val = data["train"][0], data["val"]
    assert (len(data["train"]), len(val)) == (1497, 300) and image.shape == (1, 32, 32)
    assert image.dtype == torch.float32 and 0 <= image.min() < image.max() <= 1 and 0 <= int(digit) <= 9
    assert (val.mean, val.std) == ((0.5,), (0.5,))  # the author's Normalize((0.5,), (0.5,)), done on the device
    torch.manual_seed(0)
    gan = GAN(nz=32, ngf=32, ndf=32, in_channels=1)
    fakes = gan(torch.randn(5, 32))
    assert fakes.shape == (5, 1, 32, 32) and fakes.abs().max() <= 1  # tanh
    assert gan.netD(fakes).shape == (5,)
    convs = [m for m in gan.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.ConvTranspose2d))]
    assert len(convs) == 8 and all(abs(float(m.weight.detach().std()) - 0.02) < 0.004 for m in convs)  # weights_init


def test_dcgan_fd_pixels_is_the_frechet_distance_of_the_pooled_pixels():
    """0 for one set against itself; a shift of every pixel by 0.5 moves each of the 64 pooled
    pixels' means by 0.5: 64 * 0.25 = 16, the covariances unchanged."""
    from examples.dcgan.dcgan import fd_pixels

    images = torch.rand(200, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert fd_pixels(images, images) == pytest.approx(0, abs=1e-3)
    assert fd_pixels(images, images + 0.5) == pytest.approx(16, rel=1e-3)


def test_dcgan_trains_both_nets_from_its_config_dir_each_with_its_own_adam(tmp_path):
    """The experiment's two optimizers, each logged with its own LR (the author's 2e-4, constant,
    no warm-up), and the Fréchet distance of the generated images at evaluation."""
    from examples.dcgan.dcgan import GAN, NOISE_SEED, fd_pixels, load_digits32

    metrics = example_cli(tmp_path, "dcgan", "dcgan", "trainer.seed=1")
    assert metrics["status"] == "completed" and metrics["task"] == "gan"
    run = events(tmp_path / "run")
    for name in ("D", "G"):
        assert [e.value for e in run.Scalars(f"train/lr/{name}")] == pytest.approx([2e-4] * 3)
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=False)
    steps = {name: {float(s["step"]) for s in state["state"].values()} for name, state in saved["optimizer"].items()}
    assert steps == {"D": {3.0}, "G": {3.0}}  # each Adam stepped each of its net's tensors at each of the 3 batches
    # the reference's measure (reference.py: the validation images against as many generated from the
    # evaluation's noise in one batch, eval mode) on the weights saved: what validation logged (2 batches of 32)
    gan = GAN()
    gan.load_state_dict(saved["model"])
    real = (load_digits32()["val"].images[:64] - 0.5) / 0.5
    with torch.no_grad():
        fake = gan.eval()(torch.randn(64, gan.nz, generator=torch.Generator().manual_seed(NOISE_SEED)))
    assert metrics["val/fd_pixels"] == pytest.approx(fd_pixels(real, fake), rel=1e-5) and 10 < fd_pixels(real, fake)


def test_dcgan_through_fit_with_its_task_object(tmp_path):
    stdout, metrics = fit_script(tmp_path, "dcgan", "fit_dcgan.py")
    assert "val/fd_pixels" in stdout and metrics["data"] == "DigitImages" and metrics["task"] == "gan"


@pytest.mark.slow  # a short run, then ONNX and torch.export of the generator
def test_dcgan_exports_its_generator_for_any_number_of_noise_vectors(tmp_path):
    example_cli(tmp_path, "dcgan", "dcgan")
    conf = ROOT / "examples" / "dcgan" / "conf"
    done = python(
        "-m", "saturate", "export", tmp_path / "run", f"hydra.searchpath=[file://{conf}]", "experiment=dcgan",
        "--out", tmp_path / "export", cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "inputs noise (" in done.stdout and "dynamic: noise: batch" in done.stdout
    assert (tmp_path / "export" / "model.onnx").is_file() and (tmp_path / "export" / "model.pt2").is_file()


@pytest.mark.slow  # the whole recipe: about 50 s
def test_dcgan_meets_its_target_with_its_whole_recipe(tmp_path):
    from scripts.bench_examples import EXAMPLES as BENCHED

    spec = BENCHED["dcgan"]
    assert (spec.metric, spec.value, spec.better) == ("val/fd_pixels", 2.0, "min")
    conf = ROOT / "examples" / "dcgan" / "conf"
    args = [f"hydra.searchpath=[file://{conf}]", "experiment=dcgan", "trainer.seed=1", "trainer.progress=false"]
    result = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert min(e.value for e in events(tmp_path / "run").Scalars("val/fd_pixels")) <= spec.value


@pytest.mark.slow  # both sides of one short pair
def test_the_quick_bench_runs_the_dcgan_against_its_reference(tmp_path):
    """Both sides report the same metric: the reference's BENCH lines and saturate's
    metrics.json, each a Fréchet distance of a barely trained generator (tens, not 0 or nan)."""
    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_examples.py"), "--quick", "--examples", "dcgan"]
    cmd += ["--threads", "1", "--out", str(tmp_path), "--results", str(results)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted(r["side"] for r in records) == ["reference", "saturate"]
    for r in records:
        assert r["rc"] == 0 and 0 < r["first_step_s"] < r["wall_s"] and 5 < r["final"] < 60, r
