"""The crash checks: does each path the configuration can take run here. Each is a real
`python train.py ...` run (or a probe of the device) judged by what it wrote; on the CPU a
check runs what has a meaning there and is skipped with the reason otherwise."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time

from saturate import names
from saturate.selftest.base import ROOT, Context, Skip, check, expect


def _finite(m: dict, *keys: str) -> None:
    for key in keys:
        expect(key in m and math.isfinite(m[key]), f"{key} is {m.get(key, 'missing')}")


@check(
    "device", "device selection: the run takes the GPU asked for (device.index), a GPU that is not there is one message"
)
def device(ctx: Context) -> str:
    if ctx.cuda:
        index = ctx.gpus - 1
        m = ctx.train("device", *ctx.tiny(), f"device.index={index}").metrics
        at = m["fingerprint"]["device_index"]
        expect(at == index, f"trained on cuda:{at}, not cuda:{index}")
        bad = ctx.train("device-missing", *ctx.tiny(), f"device.index={ctx.gpus}", expect=1)
        expect(
            "CUDA device(s) are visible" in bad.output and "Traceback" not in bad.output,
            f"device.index={ctx.gpus}: {bad.error_line()}",
        )
        return f"cuda:{index} ({m['fingerprint']['device']}); device.index={ctx.gpus} refused in one line"
    m = ctx.train("device", *ctx.tiny()).metrics
    bad = ctx.train("device-missing", *ctx.tiny(), "device=cuda", expect=1)
    expect("Traceback" not in bad.output, "device=cuda without a GPU ended in a traceback")
    return f"{m['fingerprint']['device']}; device=cuda refused in one line: {bad.error_line()}"


@check("precision-fp32", "full precision (TF32 where the GPU has it)")
def fp32(ctx: Context) -> str:
    m = ctx.train("fp32", *ctx.tiny(), "precision=fp32").metrics
    _finite(m, names.TRAIN_LOSS, names.VAL_LOSS)
    return f"precision {m['precision']}, tf32 {m['fingerprint'].get('tf32')}"


@check("precision-bf16", "bf16 autocast (GPUs with native bf16; on the CPU its autocast)")
def bf16(ctx: Context) -> str:
    run = ctx.train("bf16", *ctx.tiny(), "precision=bf16", expect=None)
    if run.returncode != 0 and "has no native bf16" in run.output:
        raise Skip(f"this GPU has no native bf16 ({run.error_line()[:100]}): precision=auto uses fp16 here")
    expect(run.returncode == 0, run.error_line())
    _finite(run.metrics, names.TRAIN_LOSS, names.VAL_LOSS)
    return f"precision {run.metrics['precision']}"


@check(
    "precision-fp16-overflow",
    "fp16 with the fused optimizer whose first steps overflow (GradScaler skips them on the device)",
)
def fp16(ctx: Context) -> str:
    # GPU: fp16 activations overflow at a scale of 2^24 for a few steps; CPU autocast keeps them
    # in fp32, so there only a scale that makes the scaled loss itself inf (3e38) overflows
    scale, steps, batch = (2.0**24, 24, 32) if ctx.cuda else (3e38, 4, 8)
    m = ctx.train(
        "fp16", *ctx.tiny(steps, batch), "precision=fp16", f"precision.init_scale={scale}", "trainer.log_interval=1"
    ).metrics
    _finite(m, names.TRAIN_LOSS, names.VAL_LOSS)
    expect(m[names.LOSS_SCALE] < scale, f"the loss scale stayed at {scale:g}: no step overflowed, nothing was checked")
    expect(
        m[names.TRAIN_LOSS] < 20,
        f"train/loss {m[names.TRAIN_LOSS]:.3g} after skipped first steps: the optimizer state is not clean",
    )
    return f"loss scale {scale:g} -> {m[names.LOSS_SCALE]:g}; train/loss {m[names.TRAIN_LOSS]:.3f}"


@check("compile", "torch.compile of the model (Inductor)", timeout_s=420)
def compile_(ctx: Context) -> str:
    run = ctx.train("compile", *ctx.tiny(), "trainer.compile=true")
    expect(run.metrics["fingerprint"]["compile"] is True, "the fingerprint says the model was not compiled")
    expect("recompile_limit" not in run.output, "hit Dynamo's recompile limit: the model ran eager")
    return f"compiled; {run.metrics[names.SAMPLES_PER_S]:,.0f} samples/s (a tiny run's steady state, compilation apart)"


@check("channels_last", "channels_last memory format for the model and batches")
def channels_last(ctx: Context) -> str:
    m = ctx.train("channels_last", *ctx.tiny(), "trainer.channels_last=true").metrics
    expect(m["fingerprint"]["channels_last"] is True, "channels_last not in the fingerprint")
    _finite(m, names.TRAIN_LOSS)
    return "trained in channels_last"


@check("resident", "loader=resident: the data set on the device, batches sliced there")
def resident(ctx: Context) -> str:
    run = ctx.train("resident", *ctx.tiny(), "loader=resident")
    expect(run.metrics["facts"]["resident"] is True, "the run's facts say the data was not resident")
    expect(
        "staging batches through pinned memory" not in run.output,
        "the data was staged through host memory, not resident",
    )
    return f"resident on {ctx.device}"


@check(
    "resident-host-staged",
    "loader=resident with data too large for the GPU: kept in host memory, staged through pinned memory",
    needs_cuda="on the CPU the data is in host memory already: there is nothing to stage",
)
def resident_staged(ctx: Context) -> str:
    run = ctx.train("resident-staged", *ctx.tiny(), "loader=resident", "loader.resident_memory_fraction=0.000001")
    expect(
        "staging batches through pinned memory" in run.output, "no staging through pinned memory with a budget of 1e-6"
    )
    _finite(run.metrics, names.TRAIN_LOSS)
    return "staged through pinned memory"


@check("augmentation-gpu", "augmentation=gpu: batched Kornia augmentation on the training device")
def augmentation_gpu(ctx: Context) -> str:
    m = ctx.train("augmentation-gpu", *ctx.tiny(), "augmentation=gpu").metrics
    expect(m["facts"]["placement"] == "gpu", f"placement {m['facts']['placement']}, not gpu")
    return f"placement {m['facts']['placement']}"


@check("augmentation-cpu-workers", "augmentation=cpu in two DataLoader worker processes")
def augmentation_cpu(ctx: Context) -> str:
    m = ctx.train("augmentation-cpu", *ctx.tiny(), "augmentation=cpu", "loader.num_workers=2").metrics
    expect(m["num_workers"] == 2, f"num_workers {m['num_workers']}")
    return f"placement {m['facts']['placement']}, 2 workers"


@check(
    "out-of-memory",
    "a real CUDA out-of-memory mid-training (memory capped by device.memory_fraction), recovered in micro-batches",
    needs_cuda="a CPU's memory is not capped: a real out-of-memory needs a GPU (tests/components/test_batch_size.py "
    "covers the recovery logic with a simulated one)",
    timeout_s=300,
)
def out_of_memory(ctx: Context) -> str:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    # 3 GiB: ResNet-18 at 128 px and batch 512 needs about 4 times that
    fraction = round(min(0.5, 3 * 2**30 / total), 4)
    # validation batches of 64 (the whole split): evaluation has no micro-batches to fall back on
    m = ctx.train(
        "oom",
        "data=synthetic",
        "data.num_train=2048",
        "data.num_val=64",
        "data.height=128",
        "data.width=128",
        "model=resnet18",
        "loader.batch_size=512",
        "precision=fp32",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=3",
        "trainer.log_interval=1",
        "trainer.progress=false",
        "loader.num_workers=0",
        "device=cuda",
        "trainer.devices=1",
        f"device.memory_fraction={fraction}",
    ).metrics
    expect(
        m.get(names.MICRO_BATCHES, 1) > 1,
        f"no out-of-memory at device.memory_fraction={fraction}: nothing was recovered",
    )
    _finite(m, names.TRAIN_LOSS)
    return f"device.memory_fraction={fraction}: batch 512 trained in {m[names.MICRO_BATCHES]} micro-batches"


@check("batch-size-search", "loader.batch_size=auto: the fastest batch size that fits, by trial")
def batch_size_search(ctx: Context) -> str:
    m = ctx.train(
        "batch-search",
        *ctx.tiny(),
        "loader.batch_size=auto",
        "batch_search.max=256",
        "batch_search.steps=1",
        "batch_search.cache=",
    ).metrics
    trials = m.get("batch_search", {}).get("trials", [])
    expect(len(trials) >= 2 and m["batch_size"] >= 16, f"chose {m.get('batch_size')} after {len(trials)} trials")
    return f"chose {m['batch_size']} after {len(trials)} trials"


@check("sigterm-resume", "SIGTERM mid-run saves and exits 143; trainer.resume=auto finishes the run", timeout_s=300)
def sigterm_resume(ctx: Context) -> str:
    steps = 400 if ctx.cuda else 64  # a GPU runs 64 tiny steps before the signal lands
    args = [*ctx.tiny(steps), f"data.num_train={32 * steps}", "trainer.max_epochs=2", "checkpoint.every_n_steps=4"]
    run_dir = ctx.work / "runs" / "sigterm"
    command = [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(command, cwd=ctx.work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 150
    while not (run_dir / "checkpoints" / "last.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    print(out[-4000:])
    expect(
        proc.returncode == 143,
        f"exit status {proc.returncode} after SIGTERM (expected 143; the run may have ended first)",
    )
    resumed = ctx.train("sigterm", *args, "trainer.resume=auto")
    m = resumed.metrics
    expect(
        m["status"] == "completed" and m[names.STEP] == 2 * steps,
        f"resumed run: {m['status']} at step {m[names.STEP]}",
    )
    return f"stopped with 143, resumed to step {m[names.STEP]}"


@check("profiler", "trainer.profile=true: a torch.profiler trace of steady-state steps")
def profiler(ctx: Context) -> str:
    run = ctx.train(
        "profiler", *ctx.tiny(), "trainer.profile=true", "trainer.profile_wait=2", "trainer.profile_steps=2"
    )
    traces = list((run.run_dir / "profile").glob("trace_*.json"))
    expect(bool(traces), "no trace in profile/")
    return f"{traces[0].name}, {traces[0].stat().st_size / 2**20:.1f} MB"


NO_NVIDIA_GPU = "NVML is NVIDIA's driver library: there is no NVIDIA GPU here"


@check(
    "nvml",
    "NVML: the fields the monitor reads, and GPM's SM and tensor activity where offered",
    needs_cuda=NO_NVIDIA_GPU,
)
def nvml(ctx: Context) -> str:
    from saturate.diagnostics.monitor import Gpm, open_nvml, read_gpu, visible_nvml_handles

    pynvml, why = open_nvml()
    expect(pynvml is not None, f"NVML did not start: {why}")
    handles = visible_nvml_handles(pynvml)
    expect(bool(handles), "NVML sees no visible device")
    values = read_gpu(pynvml, handles[0][1])
    expect("util" in values and "mem_used_mb" in values, f"NVML gave {sorted(values)}: no utilisation or memory")
    gpm = Gpm(pynvml, handles[0][1])
    refused = sorted({"util", "mem_used_mb", "power_w", "temp_c", "sm_clock_mhz"} - set(values))
    return (
        f"fields {', '.join(sorted(values))}"
        + (f"; refused {', '.join(refused)}" if refused else "")
        + f"; GPM {'offered' if gpm.supported else 'not offered (before Hopper, or refused)'}"
    )


@check("deterministic", "trainer.deterministic=true (on the CPU: two runs give the same losses, bit for bit)")
def deterministic(ctx: Context) -> str:
    first = ctx.train("deterministic", *ctx.tiny(), "trainer.deterministic=true")
    if ctx.cuda:
        _finite(first.metrics, names.TRAIN_LOSS)
        return "ran with deterministic algorithms" + (
            " (warned about an op without one)" if "deterministic" in first.output else ""
        )
    second = ctx.train("deterministic-again", *ctx.tiny(), "trainer.deterministic=true")
    expect(
        first.metrics[names.TRAIN_LOSS] == second.metrics[names.TRAIN_LOSS],
        f"losses differ: {first.metrics[names.TRAIN_LOSS]!r} and {second.metrics[names.TRAIN_LOSS]!r}",
    )
    return f"two runs: train/loss {first.metrics[names.TRAIN_LOSS]!r} both"


@check(
    "ddp",
    "DDP in two processes: NCCL over two GPUs; gloo on the CPU (and where one GPU cannot hold two NCCL ranks)",
    timeout_s=300,
)
def ddp(ctx: Context) -> str:
    if ctx.cuda and ctx.gpus >= 2:
        m = ctx.train("ddp", *ctx.tiny(), "trainer.devices=2").metrics
        expect(m["fingerprint"]["world_size"] == 2, f"world size {m['fingerprint']['world_size']}")
        return "2 ranks over NCCL"
    m = ctx.train("ddp", *ctx.tiny(), "device=cpu", "trainer.devices=2").metrics
    expect(m["fingerprint"]["world_size"] == 2, f"world size {m['fingerprint']['world_size']}")
    if ctx.cuda:  # NCCL refuses two ranks on one GPU: one rank through torchrun checks NCCL itself
        probe = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "-m", "saturate.selftest.nccl"],
            cwd=ctx.work,
            capture_output=True,
            text=True,
            timeout=120,
        )
        print(probe.stdout, probe.stderr)
        expect(
            probe.returncode == 0 and "nccl ok" in probe.stdout,
            f"NCCL on one GPU: {probe.stderr.strip().splitlines()[-1:]}",
        )
        return "2 ranks over gloo (one GPU: NCCL refuses two ranks on it); NCCL all_reduce on the GPU in one rank"
    return "2 ranks over gloo"


@check("tune", "tune=true: measured trials of the report's advice, the fastest written as a preset", timeout_s=420)
def tune(ctx: Context) -> str:
    preset = ctx.work / "conf" / "experiment" / "tuned_selftest.yaml"
    run = ctx.train(
        "tune",
        *ctx.tiny(64),
        "data.num_train=4096",
        "tune=true",
        "tune.budget_s=45",
        "tune.trial_s=2",
        "tune.cache=",
        f"tune.preset={preset}",
    )
    table = run.run_dir / "tune.md"
    expect(table.exists(), "no tune.md")
    expect(preset.exists(), f"no preset at {preset}")
    return f"{sum(1 for line in table.read_text().splitlines() if line.startswith('| '))} table rows; preset written"
