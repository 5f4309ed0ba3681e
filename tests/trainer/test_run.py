"""Tiny real runs on the CPU: outputs, TensorBoard read back, each precision, presets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import psutil
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2

import saturate
from tests.conftest import python, read_metrics

CONTRACT_METRICS = [
    "train/loss",
    "train/lr",
    "val/loss",
    "val/acc",
    "perf/samples_per_s",
    "perf/data_wait_frac",
    "perf/step_ms",
    "memory/peak_mb",
    "time/wall_s",
    "progress/epoch",
    "progress/step",
]


def events(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def session_hparams(run_dir) -> dict:
    """This run's HParams values, from its session (in the run's own event files)."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


def test_tiny_run_writes_the_contract_outputs(make_cfg):
    cfg = make_cfg("trainer.max_epochs=2")
    metrics = saturate.train(cfg)
    run_dir = Path(cfg.run_dir)

    for name in CONTRACT_METRICS:
        assert math.isfinite(metrics[name]), name
    assert metrics["progress/step"] == 6 and metrics["progress/epoch"] == 2
    on_disk = read_metrics(run_dir)
    assert {k: on_disk[k] for k in CONTRACT_METRICS} == {k: metrics[k] for k in CONTRACT_METRICS}
    assert on_disk["status"] == "completed" and on_disk["data"] == "digits"

    for name in ("last.pt", "best.pt"):
        ckpt = torch.load(run_dir / "checkpoints" / name, weights_only=False)
        assert {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng", "config"} <= ckpt.keys()
    assert ckpt["step"] == 6 and ckpt["config"]["loader"]["batch_size"] == 32

    acc = events(run_dir)
    scalars = set(acc.Tags()["scalars"])
    # the x axes (step, relative time): not charts
    assert set(CONTRACT_METRICS) - {"progress/step", "time/wall_s"} <= scalars
    assert not {"progress/step", "time/wall_s", "cpu/process_util"} & scalars
    assert [e.step for e in acc.Scalars("train/loss")][:3] == [1, 2, 3]  # logged every step (log_interval=1)
    assert acc.Scalars("val/acc")[-1].value == pytest.approx(metrics["val/acc"])
    hp = session_hparams(run_dir)
    assert hp["loader.batch_size"] == 32 and hp["model"] == "SmallCNN" and hp["precision"] == "fp32"
    assert "config" in "".join(acc.Tags()["tensors"])  # the resolved config as text
    (config,) = acc.Tensors("custom_scalars__config__")  # the Custom Scalars tab: loss, validation, speed, why
    charts = {
        c.title: list(c.multiline.tag)
        for c in layout_pb2.Layout.FromString(config.tensor_proto.string_val[0]).category[0].chart
    }
    # top-5 of 10 classes means nothing
    assert charts["loss"] == ["^train/loss$", "^val/loss$"] and charts["validation"] == ["^val/acc$"]
    assert list(charts) == ["loss", "validation", "samples/s", "data wait (fraction of each step)", "utilisation %"]


@pytest.mark.parametrize(
    ("mode", "resolved"), [("auto", "fp32"), ("amp", "bf16"), ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32")]
)
def test_each_precision_option_trains_on_cpu(make_cfg, mode, resolved):
    cfg = make_cfg(f"precision={mode}")
    metrics = saturate.train(cfg)
    assert math.isfinite(metrics["train/loss"]) and metrics["progress/step"] == 3
    assert read_metrics(cfg.run_dir)["precision"] == resolved


def test_debug_experiment_runs_two_steps_per_epoch(make_cfg):
    cfg = make_cfg("experiment=debug", tiny=False)
    assert cfg.trainer.detect_anomaly and cfg.loader.num_workers == 0 and cfg.precision.mode == "fp32"
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 4 and metrics["progress/epoch"] == 2


def test_max_steps_stops_mid_epoch_and_still_evaluates(make_cfg):
    cfg = make_cfg("trainer.limit_train_batches=-1", "trainer.max_steps=5", "trainer.max_epochs=3")
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 5 and 0 < metrics["progress/epoch"] < 1
    assert "val/acc" in metrics
    assert torch.load(Path(cfg.run_dir) / "checkpoints/last.pt", weights_only=False)["step"] == 5


def test_resnet18_on_synthetic_data_is_labelled_synthetic(make_cfg):
    cfg = make_cfg(
        "model=resnet18", "data=synthetic", "data.num_train=96", "data.num_val=32", "data.height=16", "data.width=16"
    )
    metrics = saturate.train(cfg)
    assert math.isfinite(metrics["train/loss"])
    assert read_metrics(cfg.run_dir)["synthetic"] is True


def test_resnet18_with_the_imagenet_stem_does_a_real_resnet18s_work_at_224():
    """torchvision's ResNet-18 is 1.82 GMACs per 224x224 image; the CIFAR stem (stride 1, no
    max-pool) does 16 times the spatial work there."""
    from torch.utils.flop_counter import FlopCounterMode

    from saturate.errors import UserError
    from saturate.models import ResNet18

    flops = {}
    for stem in ("imagenet", "cifar"):
        with FlopCounterMode(display=False) as counter:
            out = ResNet18(3, 1000, stem=stem).eval()(torch.zeros(1, 3, 224, 224))
        flops[stem] = counter.get_total_flops()
    assert out.shape == (1, 1000) and flops["imagenet"] / 2 == pytest.approx(1.82e9, rel=0.01)
    assert flops["cifar"] / flops["imagenet"] == pytest.approx(16, rel=0.1)
    with pytest.raises(UserError, match="model.stem='resnet': expected one of cifar, imagenet"):
        ResNet18(3, 10, stem="resnet")


def test_fast_loader_with_worker_processes(make_cfg):
    cfg = make_cfg("loader=fast", "loader.num_workers=2", "loader.batch_size=64", "trainer.max_epochs=2")
    assert cfg.loader.persistent_workers and cfg.loader.prefetch_factor == 4
    before = {p.pid for p in psutil.Process().children()}
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 6
    left = [p for p in psutil.Process().children() if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []  # the persistent workers end with the run, not when Python collects the loader


def test_adamw_and_channels_last_and_grad_clip(make_cfg):
    metrics = saturate.train(make_cfg("optim=adamw", "trainer.channels_last=true", "trainer.grad_clip=1.0"))
    assert math.isfinite(metrics["train/loss"])


def test_lr_schedule_warms_up_then_decays(make_cfg):
    cfg = make_cfg("trainer.limit_train_batches=-1", "trainer.max_epochs=3", "optim.warmup_epochs=1")
    saturate.train(cfg)
    lrs = [e.value for e in events(cfg.run_dir).Scalars("train/lr")]
    peak = max(lrs)
    assert peak == pytest.approx(0.1, rel=0.05)
    assert lrs[0] < peak and lrs[-1] < 0.01


def test_compile_falls_back_to_eager_with_one_warning(make_cfg, monkeypatch, caplog):
    def broken_compile(model, **kwargs):
        def fail(*args, **kw):
            raise RuntimeError("backend exploded")

        return fail

    monkeypatch.setattr(torch, "compile", broken_compile)
    metrics = saturate.train(make_cfg("trainer.compile=true"))
    assert math.isfinite(metrics["train/loss"])
    warnings = [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(warnings) == 1 and "backend exploded" in warnings[0].getMessage()


@pytest.mark.slow
def test_compile_trains_for_real(make_cfg):
    metrics = saturate.train(make_cfg("trainer.compile=true", "loader.batch_size=64"))
    assert math.isfinite(metrics["train/loss"]) and metrics["progress/step"] == 3


@pytest.mark.slow
def test_default_run_reaches_its_accuracy(make_cfg):
    metrics = saturate.train(make_cfg("trainer.progress=false", tiny=False))
    assert metrics["val/acc"] >= 0.98


def test_airbench_trains(make_cfg):
    metrics = saturate.train(make_cfg("model=airbench"))
    assert math.isfinite(metrics["train/loss"]) and metrics["progress/step"] == 3


def test_fast_preset_sets_the_fast_path(make_cfg):
    cfg = make_cfg("experiment=fast", tiny=False)
    assert cfg.loader.resident and cfg.augmentation.placement == "gpu" and cfg.precision.mode == "amp"
    assert cfg.trainer.compile and cfg.trainer.channels_last and cfg.model._target_ == "saturate.models.AirBench"


@pytest.mark.slow
def test_fast_preset_runs(make_cfg):
    # compile off: compiling on a CPU takes most of a minute (test_compile_trains_for_real covers it)
    data = ["data=synthetic", "data.num_train=128", "data.num_val=32", "data.height=16", "data.width=16"]
    cfg = make_cfg(
        "experiment=fast",
        "trainer.compile=false",
        *data,
        "trainer.max_epochs=1",
        "trainer.progress=false",
        "loader.batch_size=32",
        tiny=False,
    )
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 4 and read_metrics(cfg.run_dir)["precision"] == "bf16"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_engine.py", "bench_loader.py", "bench_augment.py"])
def test_benchmark_scripts_run_and_print_their_tables(script):
    from tests.conftest import ROOT

    args = {
        "bench_engine.py": ["--steps", "5", "--warmup", "1", "--rounds", "1", "--samples", "512", "--batch", "32"],
        "bench_loader.py": ["--batches", "5", "--rounds", "1", "--samples", "1024"],
        "bench_augment.py": [
            "--batches",
            "4",
            "--rounds",
            "1",
            "--workers",
            "0",
            "1",
            "--batch",
            "32",
            "--model",
            "small_cnn",
        ],
    }[script]
    result = python(ROOT / "scripts" / script, *args, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| loop |" in result.stdout or "| loader " in result.stdout or "| placement " in result.stdout
    if script == "bench_augment.py":  # the model step it is compared with, and how that step was set up
        assert (
            "small_cnn step at batch 32 (fp32, channels_last, eager)" in result.stdout
            and "% of the step" in result.stdout
        )


def test_progress_is_one_line_per_epoch_in_train_log_when_output_is_a_pipe(tmp_path):
    from tests.conftest import run_cli

    # stdout and stderr are pipes
    result = run_cli(
        "trainer.max_epochs=3",
        "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=2",
        "loader.batch_size=32",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "run" / "train.log").read_text()
    lines = [line for line in log.splitlines() if "] - epoch " in line]
    assert len(lines) == 3
    assert "epoch 2/3, step 6: train/loss" in lines[1] and "val/acc" in lines[1] and "samples/s" in lines[1]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["best"]["metric"] == "val/acc" and metrics["best"]["value"] == max(
        metrics["best"]["value"], metrics["val/acc"]
    )
    assert (
        metrics["best"]["epoch"] in (1, 2, 3)
        and metrics["overrides"][0] == "trainer.max_epochs=3"
        and metrics["started_at"][:2] == "20"
    )


def test_hparams_hold_the_values_used_and_the_compared_metrics(make_cfg):
    cfg = make_cfg("loader.num_workers=auto", "trainer.channels_last=true")
    metrics = saturate.train(cfg)
    hp = session_hparams(cfg.run_dir)
    # what ran, not "auto" and the unused preset
    assert hp["loader.num_workers"] == 0 and hp["augmentation.preset"] == "none"
    # booleans read true/false, not 0.0000
    assert hp["trainer.channels_last"] == "true" and hp["trainer.compile"] == "false"
    # train(cfg) of a composed config is given none (train.py's: tests/diagnostics/test_sweep.py)
    assert hp["overrides"] == "(none)"
    # one run in TensorBoard's list: the session sits in the run's own event files, no sub-run
    assert len(list(Path(cfg.run_dir).glob("events.out.tfevents.*"))) == 1
    assert not list(Path(cfg.run_dir).glob("*/**/events.out.tfevents.*"))
    session = events(cfg.run_dir)
    # TensorBoard offers every scalar of the session's run as a metric, sorted, and shows the first five: the
    # compared metrics' final values as compare/*, which sort first
    compared = {"val/acc", "val/loss", "train/loss", "perf/samples_per_s", "perf/data_wait_frac", "memory/peak_mb"}
    tags = sorted(session.Tags()["scalars"])
    assert set(tags[: len(compared)]) == {f"compare/{tag}" for tag in compared}
    for tag in compared:
        assert session.Scalars(f"compare/{tag}") == [session.Scalars(f"compare/{tag}")[0]]  # one point
        assert session.Scalars(f"compare/{tag}")[0].value == pytest.approx(metrics[tag]), tag
    shown = set(events(cfg.run_dir).Tags()["scalars"])
    assert (
        not {"cpu/util_mean", "time/loop_s", "cost/flops_per_step", "train/micro_batches", "train/nonfinite_steps"}
        & shown
    )
