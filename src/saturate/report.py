"""The bottleneck report: where the step time went, a verdict, and what to try next.

The verdict is decided by one measured figure, the share of step time spent waiting for the
next batch (`perf/data_wait_frac`): at least INPUT_BOUND is input-bound, at most
COMPUTE_BOUND is compute-bound, in between balanced. When GPU utilisation was sampled it is
reported beside it. Suggestions are overrides that change something this run did not
already do, most likely to help first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INPUT_BOUND = 0.20
COMPUTE_BOUND = 0.05
MIN_STEPS = 10  # fewer steady-state steps than this are no basis for a verdict (experiment=debug takes 3)
CPU_SATURATED = 90.0  # % of the host's CPUs busy: worker processes and the training compete for cores


@dataclass
class RunFacts:
    """What the run did, as far as the suggestions need to know."""

    device: str  # "cuda" or "cpu"
    batch_size: int
    num_workers: int
    cpus: int  # CPUs this process may use
    resident: bool
    in_memory: bool  # the data set is an in-memory tensor (not decoded per sample)
    placement: str  # augmentation: none, cpu or gpu
    persistent_workers: bool
    pin_memory: bool
    precision: str  # resolved: fp32, bf16, fp16
    compile: bool
    channels_last: bool
    memory_headroom: bool  # peak memory under half of the device's
    emulated_precision: bool  # bf16/fp16 on a CPU without native kernels for them
    image: bool = True  # uint8 image inputs: the image-only options (augmentation placement, channels_last) apply
    cpu_util: float | None = None  # mean host CPU use over the run, % (psutil), when sampled


@dataclass
class Verdict:
    kind: str  # input-bound, compute-bound or balanced
    reason: str  # the measured figure that decided it
    suggestions: list[tuple[str, str]] = field(default_factory=list)  # (overrides, why)


def _input_fixes(f: RunFacts) -> list[tuple[str, str]]:
    fixes = []
    if f.placement == "cpu":
        fixes.append(
            (
                "augmentation=gpu",
                "per-sample augmentation in the workers is the usual bottleneck; batched on the device it is one kernel per op",
            )
        )
    if not f.resident and f.in_memory and f.placement != "cpu":
        fixes.append(
            ("loader=resident", "the data set fits in memory: keep it on the device and slice batches there, no workers, no copies")
        )
    if not f.resident and f.num_workers < max(1, f.cpus - 1) and (f.placement == "cpu" or not f.in_memory):
        fixes.append((f"loader.num_workers={max(1, f.cpus - 1)}", f"{f.num_workers} workers for {f.cpus} CPUs"))
    if f.num_workers > 0 and not f.persistent_workers:
        fixes.append(("loader.persistent_workers=true", "workers are restarted every epoch"))
    if f.device == "cuda" and not f.pin_memory and not f.resident:
        fixes.append(("loader.pin_memory=true", "copies from pageable memory are synchronous"))
    return fixes


def _saturated(f: RunFacts) -> bool:
    """Worker processes keep the host's cores busy (the seeds' "CPU load < 90 %" check)."""
    return f.cpu_util is not None and f.cpu_util >= CPU_SATURATED and f.num_workers > 0 and not f.resident


def _saturated_fixes(f: RunFacts) -> list[tuple[str, str]]:
    fixes = []
    if f.placement == "cpu":
        fixes.append(("augmentation=gpu", f"per-sample augmentation in {f.num_workers} processes is what keeps the cores busy; batched "
                                          "on the device it is one kernel per op"))  # fmt: skip
    if f.in_memory and f.placement != "cpu":
        fixes.append(("loader=resident", "the data is in memory: no worker processes at all"))
    fewer = max(0, min(f.num_workers - 1, f.cpus - 2))
    fixes.append((f"loader.num_workers={fewer}", f"fewer workers leave cores to the training ({f.num_workers} on {f.cpus} CPUs now)"))
    return fixes


def _compute_fixes(f: RunFacts) -> list[tuple[str, str]]:
    fixes = []
    if f.emulated_precision:
        fixes.append(("precision=fp32", f"this CPU has no native {f.precision} kernels: {f.precision} is emulated, slower than fp32"))
    if f.device == "cuda" and f.precision == "fp32":
        fixes.append(("precision=amp", "bf16/fp16 tensor cores do several times the fp32 work per second"))
    if f.device != "cuda":
        # compile (tens of seconds of compilation) and larger batches are GPU remedies: on this
        # 2-core CPU they measured no gain; the arithmetic itself is the limit here. NHWC is
        # what oneDNN's convolutions prefer: measured 1.10x (resnet18) and 1.16x (small_cnn) there
        if f.image and not f.channels_last:
            fixes.append(("trainer.channels_last=true", "oneDNN's CPU convolutions run faster in NHWC (1.1-1.2x measured on a 2-core CPU)"))
        fixes.append(("device=cuda", "the step is the model's arithmetic on this CPU; compile and larger batches pay off on a GPU"))
        return fixes
    if not f.compile:
        fixes.append(("trainer.compile=true", "fused kernels: fewer launches and memory round trips"))
    if not f.channels_last and f.image:
        fixes.append(("trainer.channels_last=true", "convolutions run faster in NHWC on tensor cores"))
    if f.memory_headroom:
        fixes.append(
            (f"loader.batch_size={2 * f.batch_size}", "peak memory is under half of the GPU's: larger steps amortise per-step overhead")
        )
    return fixes


def diagnose(perf: dict[str, float], facts: RunFacts, steps: int | None = None) -> Verdict:
    """The verdict from the measured data-wait share, and what to try; no verdict from fewer
    than MIN_STEPS steady-state steps (start-up costs would decide it)."""
    if steps is not None and steps < MIN_STEPS:
        return Verdict("not judged", f"{steps} steady-state steps are too few to judge (at least {MIN_STEPS}): run longer for a verdict")
    wait = perf["perf/data_wait_frac"]
    if _saturated(facts) and (facts.device != "cuda" or wait >= INPUT_BOUND):
        return Verdict("CPU-saturated", f"the CPU was {facts.cpu_util:.0f}% busy with {facts.num_workers} worker process(es) on "
                       f"{facts.cpus} CPU(s): the workers and the training compete for the cores, so the step's compute time includes "
                       f"waiting for one (waiting for data took {wait:.1%} of step time)", _saturated_fixes(facts))  # fmt: skip
    figure = f"waiting for data took {wait:.1%} of step time"
    if wait >= INPUT_BOUND:
        return Verdict("input-bound", f"{figure} (>= {INPUT_BOUND:.0%})", _input_fixes(facts))
    if wait <= COMPUTE_BOUND:
        return Verdict("compute-bound", f"{figure} (<= {COMPUTE_BOUND:.0%})", _compute_fixes(facts))
    both = _input_fixes(facts)[:1] + _compute_fixes(facts)[:1]
    return Verdict("balanced", f"{figure} (between {COMPUTE_BOUND:.0%} and {INPUT_BOUND:.0%})", both)


def render(perf: dict[str, float], verdict: Verdict, *, steps: int, gpu: dict[str, float] | None = None,
           cpu_util: float | None = None, stopped: str | None = None, notes: list[str] = ()) -> str:  # fmt: skip
    """The report as Markdown (console, report.md and TensorBoard text)."""
    step = perf["perf/step_ms"]
    parts = [
        ("data wait", perf["perf/data_wait_ms"]),
        ("copy and device-side preparation", perf["perf/copy_ms"]),
        ("compute", perf["perf/compute_ms"]),
    ]
    split = " + ".join(f"{name} {ms:.2f} ms ({ms / step:.0%})" for name, ms in parts)
    lines = [
        "## Bottleneck report",
        "",
        f"- throughput: **{perf['perf/samples_per_s']:,.0f} samples/s** (steady state over {steps} steps)",
        f"- step time: {step:.2f} ms = {split}",
    ]
    if gpu:
        lines.append(
            f"- GPU utilisation: mean {gpu['gpu/util_mean']:.0f}%, std {gpu['gpu/util_std']:.0f}, min {gpu['gpu/util_min']:.0f}%, "
            f"{gpu['gpu/util_under_50_frac']:.0%} of samples under 50%"
        )
    else:
        lines.append("- GPU utilisation: not sampled (no NVIDIA GPU or no NVML)")
    if cpu_util is not None:
        lines.append(f"- CPU: {cpu_util:.0f}% busy on average (all the host's cores)")
    lines += [f"- {note}" for note in notes if note]
    if stopped:
        lines.append(f"- stopped early: {stopped}")
    tested = {k: v for k, v in perf.items() if k.startswith("test/")}
    if tested:
        lines.append("- test set (best.pt): " + ", ".join(f"{k} {v:.4f}" for k, v in tested.items()))
    lines += ["", f"**Verdict: {verdict.kind}**: {verdict.reason}.", ""]
    if verdict.suggestions:
        lines += ["Try next (add to your command line):", ""]  # a blank line: Markdown renderers (TensorBoard's) need it for a list
        lines += [f"- `{override}`: {why}" for override, why in verdict.suggestions]
    else:
        lines.append("Nothing obvious left to try from here.")
    return "\n".join(lines) + "\n"
