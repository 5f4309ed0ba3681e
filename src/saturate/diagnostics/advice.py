"""What the report advises for each verdict (saturate.diagnostics.report): overrides that
change something the run did not already do, most likely to help first, each with why."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from saturate.diagnostics.report import RunFacts


def threads_fix(f: RunFacts, free: int) -> tuple[str, str]:
    """As many intra-op threads as there are free cores: each then runs without waiting for one
    (device.threads=auto follows the cgroup's quota and the affinity mask, not other processes'
    load, which comes and goes)."""
    return (
        f"device.threads={free}",
        f"{f.threads} threads on {free} free core(s): threads that wait for a core hold up every operator",
    )


def input_fixes(f: RunFacts) -> list[tuple[str, str]]:
    fixes = []
    if f.placement == "cpu":
        fixes.append(
            (
                "augmentation=gpu",
                "per-sample augmentation in the workers is the usual bottleneck; batched on the device it is one "
                "kernel per op",
            )
        )
    if not f.resident and f.in_memory and f.placement != "cpu":
        fixes.append(
            (
                "loader=resident",
                "the data set fits in memory: keep it on the device and slice batches there, no workers, no copies",
            )
        )
    if not f.resident and f.num_workers < max(1, f.cpus - 1) and (f.placement == "cpu" or not f.in_memory):
        fixes.append((f"loader.num_workers={max(1, f.cpus - 1)}", f"{f.num_workers} workers for {f.cpus} CPUs"))
    if f.num_workers > 0 and not f.persistent_workers:
        fixes.append(("loader.persistent_workers=true", "workers are restarted every epoch"))
    if f.device == "cuda" and not f.pin_memory and not f.resident:
        fixes.append(("loader.pin_memory=true", "copies from pageable memory are synchronous"))
    return fixes


def saturated_fixes(f: RunFacts) -> list[tuple[str, str]]:
    fixes = []
    if f.placement == "cpu":
        fixes.append(
            (
                "augmentation=gpu",
                f"per-sample augmentation in {f.num_workers} processes is what keeps the cores busy; batched "
                "on the device it is one kernel per op",
            )
        )
    if f.in_memory and f.placement != "cpu":
        fixes.append(("loader=resident", "the data is in memory: no worker processes at all"))
    fewer = max(0, min(f.num_workers - 1, f.cpus - 2))
    fixes.append(
        (
            f"loader.num_workers={fewer}",
            f"fewer workers leave cores to the training ({f.num_workers} on {f.cpus} CPUs now)",
        )
    )
    return fixes


def compute_fixes(f: RunFacts) -> list[tuple[str, str]]:
    fixes = []
    if f.emulated_precision:
        fixes.append(
            (
                "precision=fp32",
                f"this CPU has no native {f.precision} kernels: {f.precision} is emulated, slower than fp32",
            )
        )
    if f.device == "cuda" and f.precision == "fp32" and f.amp_ok:
        fixes.append(("precision=amp", "bf16/fp16 tensor cores do several times the fp32 work per second"))
    if f.device != "cuda":
        # compile (tens of seconds of compilation) and larger batches are GPU remedies: on a CPU
        # the arithmetic itself is the limit. NHWC is what oneDNN's convolutions prefer
        # (docs/benchmarks.md, "Single settings": channels_last)
        if f.image and not f.channels_last and f.channels_last_ok:
            fixes.append(
                (
                    "trainer.channels_last=true",
                    "oneDNN's CPU convolutions run faster in NHWC (docs/benchmarks.md: channels_last)",
                )
            )
        fixes.append(
            (
                "device=cuda",
                "the step is the model's arithmetic on this CPU; compile and larger batches pay off on a GPU",
            )
        )
        return fixes
    if not f.compile:
        fixes.append(("trainer.compile=true", "fused kernels: fewer launches and memory round trips"))
    if not f.channels_last and f.image and f.channels_last_ok:
        fixes.append(("trainer.channels_last=true", "convolutions run faster in NHWC on tensor cores"))
    if f.memory_headroom:
        fixes.append(
            (
                f"loader.batch_size={2 * f.batch_size}",
                "peak memory is under half of the GPU's: larger steps amortise per-step overhead",
            )
        )
    return fixes


def launch_fixes(f: RunFacts) -> list[tuple[str, str]]:
    if f.device != "cuda":
        return [
            (
                f"loader.batch_size={2 * f.batch_size}",
                "each operator does more work per dispatch; the dispatch cost stays",
            ),
            ("trainer.compile=true", "fused operators: fewer dispatches per step (compiling takes a while on a CPU)"),
        ]
    fixes = []
    if not f.compile:
        fixes.append(
            ("trainer.compile=true", "fused kernels: fewer launches per step (mode='reduce-overhead' adds CUDA graphs)")
        )
    fixes.append((f"loader.batch_size={2 * f.batch_size}", "more work per launch; the launch cost per step stays"))
    if not f.resident and f.in_memory:
        fixes.append(("loader=resident", "no per-step copies or host work between launches"))
    return fixes


def copy_fixes(f: RunFacts) -> list[tuple[str, str]]:
    fixes = []
    if not f.pin_memory and not f.resident:
        fixes.append(("loader.pin_memory=true", "copies from pageable memory are synchronous and slow"))
    if not f.resident and f.in_memory:
        fixes.append(("loader=resident", "the data set on the device: no copy per step"))
    return fixes
