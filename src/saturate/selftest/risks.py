"""The CUDA risks that only a GPU can settle, each a check with a pass/fail line: what the
CUDA paths were read to do, measured where they run. Each decision is a function of the
figures a check records, so that the CPU tests hold it to a passing and a failing input
(tests/selftest/test_risks.py); on the CPU the checks are skipped with the reason.

- guard-launches: the non-finite guard's kernel launches per step on a BatchNorm model
  (ResNet-18), from profiler traces of a run with and without it;
- augmentation-syncs: host synchronisations per batch of the batched augmentation (Kornia
  versions that index with host masks and copy parameters with blocking copies);
- cudnn-shapes: cudnn.benchmark on for fixed shapes and off for variable lengths;
- ddp-agreement: the GPU's idle time on the host's own work under DDP, where the step agrees
  on out-of-memory with an all-reduce and a host read per micro-batch;
- nvml-uuids: NVML accepts the UUIDs the monitor matches devices by (a MIG instance's is
  not "GPU-...").
"""

from __future__ import annotations

import json

from saturate import names
from saturate import record as run_record
from saturate.selftest.base import ROOT, Context, Skip, check, expect

NO_GPU = "a GPU's behaviour: there is none here (the logic has CPU tests: tests/selftest/test_risks.py)"
GUARD_MAX = 32  # launches the guard may add per step: its decision, and a few per buffer dtype (it added ~180)
AGREEMENT_IDLE_MAX = 0.05  # share of step time the GPU may idle on the host's own work under DDP


def kernels_per_step(trace: dict, steps: int) -> float:
    """CUDA kernels in a torch.profiler Chrome trace, per profiled step."""
    return sum(1 for e in trace.get("traceEvents", []) if e.get("cat") == "kernel") / max(1, steps)


def guard_launches(guarded: float, unguarded: float) -> tuple[bool, str]:
    added = guarded - unguarded
    line = (
        f"the non-finite guard adds {added:.0f} kernel launches per ResNet-18 step ({guarded:.0f} with it, "
        f"{unguarded:.0f} without; at most {GUARD_MAX})"
    )
    return added <= GUARD_MAX, line


def augmentation_syncs(syncs: dict[str, int], batches: int, kornia: str) -> tuple[bool, str]:
    per_batch = {name: count / max(1, batches) for name, count in syncs.items()}
    said = ", ".join(f"{name} {n:g}" for name, n in per_batch.items())
    if any(per_batch.values()):
        return False, f"kornia {kornia} synchronises the host per augmented batch ({said}): try a newer kornia"
    return True, f"kornia {kornia}: no host synchronisation per augmented batch ({said})"


def cudnn_follows_shapes(fixed: bool, varying: bool) -> tuple[bool, str]:
    line = f"cudnn.benchmark {fixed} for fixed shapes, {varying} for variable lengths (device.cudnn_benchmark=auto)"
    return fixed and not varying, line


def agreement_idle(idle_host: float, world: int) -> tuple[bool, str]:
    line = (
        f"{world} ranks: the GPU idled {idle_host:.1%} of step time on the host's own work between steps (at most "
        f"{AGREEMENT_IDLE_MAX:.0%}; the out-of-memory agreement reads the device once per micro-batch)"
    )
    return idle_host <= AGREEMENT_IDLE_MAX, line


def nvml_uuids(uuids: list[str], refused: list[str]) -> tuple[bool, str]:
    if not refused:
        return True, f"NVML accepts the {len(uuids)} device UUID(s) the monitor matches by"
    hint = " (a MIG instance: NVML names it MIG-...)" if any(u.startswith("GPU-") for u in refused) else ""
    return False, f"NVML refused {', '.join(refused)}{hint}: the monitor falls back to device positions"


@check(
    "guard-launches",
    "the non-finite guard on ResNet-18 (BatchNorm): kernel launches it adds per step, from profiler traces",
    needs_cuda=NO_GPU,
    timeout_s=300,
)
def guard_launches_check(ctx: Context):
    counts = {}
    for skip in (True, False):
        run = ctx.train(
            f"guard-{str(skip).lower()}",
            *ctx.tiny(12, 128),
            "model=resnet18",
            "loader=resident",
            f"trainer.skip_nonfinite={str(skip).lower()}",
            "trainer.profile=true",
            "trainer.profile_wait=4",
            "trainer.profile_steps=3",
        )
        traces = sorted((run.run_dir / "profile").glob("trace_*.json"))
        expect(bool(traces), "no profiler trace in profile/")
        counts[skip] = kernels_per_step(json.loads(traces[-1].read_text()), 3)
    ok, line = guard_launches(counts[True], counts[False])
    expect(ok, line)
    return line, {"guarded": counts[True], "unguarded": counts[False]}


@check(
    "augmentation-syncs",
    "batched augmentation on the GPU (the presets and a user's Kornia transforms): host synchronisations per batch",
    needs_cuda=NO_GPU,
)
def augmentation_syncs_check(ctx: Context):
    f = ctx.script("probe_syncs.py", "--batches", "20")
    ok, line = augmentation_syncs(f["syncs"], f["batches"], f["kornia"])
    expect(ok, line)
    return line, f


@check(
    "cudnn-shapes",
    "cudnn.benchmark=auto: on for fixed shapes, off for variable lengths (retuned for every new length)",
    needs_cuda=NO_GPU,
)
def cudnn_shapes_check(ctx: Context):
    fixed = ctx.train("cudnn-fixed", *ctx.tiny()).metrics["fingerprint"]["cudnn_benchmark"]
    sign = [f"hydra.searchpath=[file://{ROOT / 'examples' / 'sign' / 'conf'}]", "experiment=sign"]
    steps = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2"]
    varying = ctx.train("cudnn-varying", *sign, *steps, "trainer.progress=false", f"device={ctx.device}")
    ok, line = cudnn_follows_shapes(fixed, varying.metrics["fingerprint"]["cudnn_benchmark"])
    expect(ok, line)
    return line


@check(
    "ddp-agreement",
    "DDP over NCCL: the GPU's idle time between steps, where each micro-batch's out-of-memory agreement reads the "
    "device on the host",
    needs_cuda=NO_GPU,
    timeout_s=300,
)
def ddp_agreement_check(ctx: Context):
    if ctx.gpus < 2:
        raise Skip(f"{ctx.gpus} GPU: DDP over NCCL needs two")
    overrides = [*ctx.tiny(200, 128), "model=resnet18", "loader=resident", "trainer.devices=2"]
    m = ctx.train("ddp-agreement", *overrides, "trainer.log_interval=50").metrics
    expect(names.GPU_IDLE_HOST_FRAC in m, f"no GPU idle figures in {run_record.FILE}")
    ok, line = agreement_idle(m[names.GPU_IDLE_HOST_FRAC], m["fingerprint"]["world_size"])
    expect(ok, line)
    return line


@check(
    "nvml-uuids",
    "NVML accepts the device UUIDs the resource monitor matches CUDA's devices by (MIG instances included)",
    needs_cuda="NVML is NVIDIA's driver library: there is no NVIDIA GPU here",
)
def nvml_uuids_check(ctx: Context):
    from saturate.diagnostics.monitor import cuda_uuids, open_nvml

    pynvml, why = open_nvml()
    expect(pynvml is not None, f"NVML did not start: {why}")
    uuids = cuda_uuids()
    if not uuids:
        raise Skip("torch gives no device UUIDs (before torch 2.4): the monitor matches devices by position")
    refused = []
    for uuid in uuids:
        try:
            pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:  # noqa: BLE001 (NVML's refusal is the finding)
            refused.append(uuid)
    ok, line = nvml_uuids(uuids, refused)
    expect(ok, line)
    return line
