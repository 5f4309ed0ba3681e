"""The measurements: how fast the fast path is on this GPU, each figure measured side by side
(two runs back to back, or interleaved rounds inside one script), with the GPU's utilisation
and SM activity over the steady state and the verdict of each run. With --dry (any device)
they run at toy sizes: the commands and their figures are checked, nothing is measured."""

from __future__ import annotations

import time

from saturate import names
from saturate import record as run_record
from saturate.selftest.base import Context, check, expect

CIFAR = [
    "data=synthetic",
    "data.num_train=50000",
    "data.num_val=1000",
    "trainer.limit_val_batches=2",
    "trainer.progress=false",
    "trainer.devices=1",
    "loader.num_workers=auto",
]


def steady(ctx: Context, name: str, *overrides: str, steps: int) -> dict:
    """A run of `steps` steps on CIFAR-size synthetic data (toy-sized when dry): its speed,
    GPU figures over the steady state and verdict."""
    size = ["data.num_train=1024", "data.num_val=256", "loader.batch_size=32"] if ctx.dry else []
    m = ctx.train(
        name,
        *CIFAR,
        f"device={ctx.device}",
        "trainer.max_epochs=100",
        f"trainer.max_steps={6 if ctx.dry else steps}",
        f"trainer.log_interval={2 if ctx.dry else 50}",
        *overrides,
        *size,
    ).metrics
    expect(m.get(names.SAMPLES_PER_S, 0) > 0, f"{name}: no samples/s in {run_record.FILE}")
    keys = (
        names.SAMPLES_PER_S,
        names.STEP_MS,
        names.DATA_WAIT_FRAC,
        names.GPU_UTIL_MEAN,
        names.SM_ACTIVE_MEAN,
        names.TENSOR_ACTIVE_MEAN,
        names.MFU,
    )
    return {**{k.split("/")[1]: round(m[k], 4) for k in keys if k in m}, "verdict": m.get("verdict", "?")}


def _gpu(f: dict) -> str:
    util = f"GPU {f['util_mean']:.0f}%" if "util_mean" in f else "GPU util not sampled"
    return util + (f", SM {f['sm_active_mean']:.0f}%" if "sm_active_mean" in f else "")


def _compared(ctx: Context, steps: int, first: tuple, second: tuple, note: str = "") -> tuple[str, dict]:
    """Two configurations (label, run name, overrides) measured one after the other, in their
    steady state: the second's gain over the first, in one line and as figures."""
    (a_label, a_name, a_overrides), (b_label, b_name, b_overrides) = first, second
    a = steady(ctx, a_name, *a_overrides, steps=steps)
    b = steady(ctx, b_name, *b_overrides, steps=steps)
    gain = b["samples_per_s"] / a["samples_per_s"]
    line = (
        f"{b_label} {gain:.2f}x {a_label} ({b['samples_per_s']:,.0f} vs {a['samples_per_s']:,.0f} samples/s, steady "
        f"state{note}); {_gpu(b)}; verdicts {a['verdict']} / {b['verdict']}"
    )
    return line, {a_label: a, b_label: b, "gain": round(gain, 3)}


@check(
    "amp-gain",
    "ResNet-18 on CIFAR-size data, resident: fp32 vs mixed precision (precision=amp), steps/s",
    kind="measure",
    estimate_s=90,
    timeout_s=400,
)
def amp_gain(ctx: Context):
    common = ["model=resnet18", "loader=resident", "loader.batch_size=256"]
    # each over 10 s: ten NVML samples at least
    return _compared(
        ctx, 1000, ("fp32", "amp-fp32", [*common, "precision=fp32"]), ("amp", "amp-amp", [*common, "precision=amp"])
    )


COMPILE = "experiment=fast (airbench, batch 512) with and without torch.compile, steps/s"


@check("compile-gain", COMPILE, kind="measure", estimate_s=90, timeout_s=500)
def compile_gain(ctx: Context):
    eager = ("eager", "fast-eager", ["experiment=fast", "trainer.compile=false"])
    return _compared(ctx, 800, eager, ("compiled", "fast-compiled", ["experiment=fast"]), note=", compile time apart")


@check(
    "engine-overhead",
    "saturate's loop against a hand-written loop over the same model and data: the default run and "
    "experiment=fast (scripts/bench_engine.py, interleaved rounds)",
    kind="measure",
    estimate_s=180,
    timeout_s=560,
)
def engine_overhead(ctx: Context):
    toy = ["--steps", "4", "--warmup", "1", "--rounds", "1", "--samples", "512"]
    default = ctx.script("bench_engine.py", *(toy if ctx.dry else ["--steps", "60", "--warmup", "10", "--rounds", "5"]))
    figures = {"default": default["loops"]}
    detail = f"default run {default['loops']['saturate']['paired']:.3f}x the hand loop's step time"
    if ctx.cuda:  # the fast path compiles: on a CPU that is minutes, and not what it is for
        fast = ctx.script(
            "bench_engine.py",
            "--model",
            "airbench",
            "--fast",
            "--batch",
            "512",
            *(toy if ctx.dry else ["--steps", "60", "--warmup", "15", "--rounds", "3"]),
        )
        figures.update(fast=fast["loops"], compile=fast.get("compile"))
        detail += f"; experiment=fast {fast['loops']['saturate']['paired']:.3f}x"
    return detail + " (1.000x: no overhead)", figures


@check(
    "augmentation-224",
    "augmentation at 224x224, batch 256: per-sample in workers vs batched on the GPU, and its share of a "
    "real ResNet-18 step (scripts/bench_augment.py)",
    kind="measure",
    estimate_s=80,
    timeout_s=400,
)
def augmentation_224(ctx: Context):
    toy = ["--size", "32", "--batch", "32", "--workers", "0", "--batches", "2", "--rounds", "1", "--model", "small_cnn"]
    real = [
        "--size",
        "224",
        "--batch",
        "256",
        "--workers",
        "4",
        "8",
        "--batches",
        "32",
        "--rounds",
        "2",
        "--model",
        "resnet18",
    ]
    args = toy if ctx.dry else real
    f = ctx.script("bench_augment.py", *args)
    batched = next(v for k, v in f["rows"].items() if k.startswith("batched"))
    step = f.get("step", {})
    return (
        f"batched {batched['vs_best_per_sample']:.1f}x the best per-sample placement; augmentation "
        f"{100 * step.get('augmentation_share', 0):.1f}% of a {step.get('model')} step ({step.get('step_ms', 0):.0f} "
        "ms)"
    ), f


@check(
    "copy-bandwidth",
    "host-to-device copies of 256 MB: pinned vs pageable memory, GB/s",
    kind="measure",
    estimate_s=15,
    needs_cuda="a copy to a GPU: there is none here",
)
def copy_bandwidth(ctx: Context):
    import torch

    size = 2**20 if ctx.dry else 2**28
    pageable = torch.empty(size, dtype=torch.uint8)
    pinned = pageable.pin_memory()
    target = torch.empty(size, dtype=torch.uint8, device="cuda")
    rates = {}
    for name, source in (("pageable", pageable), ("pinned", pinned)):
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        rates[name] = round(10 * size / (time.perf_counter() - start) / 1e9, 2)
    return f"pinned {rates['pinned']:.1f} GB/s, pageable {rates['pageable']:.1f} GB/s", rates


@check(
    "tune-vs-hand",
    "tune=true on ResNet-18 at CIFAR size, its preset against the hand-picked fast settings (experiment=fast's), "
    "steps/s",
    kind="measure",
    estimate_s=200,
    timeout_s=600,
)
def tune_vs_hand(ctx: Context):
    preset = ctx.work / "conf" / "experiment" / "tuned_measure.yaml"
    model = ["model=resnet18", "loader.batch_size=256"]
    tiny = ["data.num_train=2048", "loader.batch_size=32"] if ctx.dry else []
    ctx.train(
        "tune-measure",
        *CIFAR,
        f"device={ctx.device}",
        *model,
        "tune=true",
        f"tune.budget_s={30 if ctx.dry else 120}",
        f"tune.trial_s={1 if ctx.dry else 4}",
        "tune.cache=",
        f"tune.preset={preset}",
        *tiny,
    )
    expect(preset.exists(), f"tune wrote no preset at {preset}")
    search = f"hydra.searchpath=[file://{ctx.work / 'conf'}]"
    tuned = steady(ctx, "tuned", search, *model, "experiment=tuned_measure", steps=500)
    hand = steady(ctx, "hand-picked", "experiment=fast", *model, steps=500)
    ratio = tuned["samples_per_s"] / hand["samples_per_s"]
    return (
        f"tuned {ratio:.2f}x the hand-picked settings ({tuned['samples_per_s']:,.0f} vs {hand['samples_per_s']:,.0f} "
        f"samples/s); verdicts {tuned['verdict']} / {hand['verdict']}"
    ), {"tuned": tuned, "hand": hand, "ratio": round(ratio, 3)}
