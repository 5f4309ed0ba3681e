"""The bottleneck report: where the step time and the run's time went, a verdict, and what
to try next.

A verdict is decided by measured figures, in this order (the first that holds):

1. not judged: fewer than MIN_STEPS steady-state steps;
2. evaluation-, checkpoint- or logging-heavy: that share of the training loop's time is at
   least EVAL_HEAVY, CHECKPOINT_HEAVY or LOGGING_HEAVY (the steps are not the problem);
3. CPU-saturated: the run's own processes (main and workers, not the host's other
   processes) keep at least CPU_SATURATED % of the CPUs it may use busy, its workers at
   least WORKERS_BUSY % of one core of it, and the device is not busy anyway (on a GPU:
   data wait at least INPUT_BOUND);
4. input-bound: waiting for the next batch took at least INPUT_BOUND of step time;
5. copy-bound (CUDA): copying the batch and preparing it on the device took at least
   COPY_BOUND of step time;
6. oversubscribed (CPU): torch's intra-op threads outnumber the cores other processes leave
   free (the cores it may use less their measured load, rounded), and the main process got
   under OVERSUBSCRIBED of its threads' CPU time (CPU seconds per second of wall time under
   OVERSUBSCRIBED x threads): its threads wait for cores, and each operator waits for its
   slowest thread (a GPT beside a process holding one of 2 cores stepped 14x slower with 2
   threads than with 1); judged after the input side, whose waiting also lowers the CPU a
   run gets;
7. launch-bound: on CUDA the device waited on kernel launches in at least LAUNCH_BOUND of the
   steps (it had finished the previous step when the host began launching the next, and then
   kept pace with the launches made before any host read: saturate.diagnostics.timing); on the CPU
   the part of the measured step compute that does not grow with the batch (forward and
   backward timed on 1 and on 8 samples after training) is at least LAUNCH_BOUND, judged only
   while other processes take less than OTHER_BUSY of the host (their load stretches the
   step's long timings and not the probe's short ones: a compute-bound CNN beside two
   CPU-burning processes measured 51 % "fixed");
8. compute-bound: waiting for data took at most COMPUTE_BOUND of step time; else balanced.

Other processes' load is named as such and never turned into advice about the run's
workers. Suggestions are overrides that change something this run did not already do,
most likely to help first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from saturate import names
from saturate.diagnostics.advice import (
    compute_fixes,
    copy_fixes,
    input_fixes,
    launch_fixes,
    saturated_fixes,
    threads_fix,
)

INPUT_BOUND = 0.20
COMPUTE_BOUND = 0.05
MIN_STEPS = 10  # fewer steady-state steps than this are no basis for a verdict (experiment=debug takes 3)
CPU_SATURATED = 90.0  # % of the CPUs the run may use, busy with the run's own processes: workers and training compete
OTHER_BUSY = 25.0  # % of the host's cores used by other processes: named in the report
WORKERS_BUSY = 50.0  # % of one core: workers that do this much are part of a CPU-saturated run
EVAL_HEAVY, CHECKPOINT_HEAVY, LOGGING_HEAVY = 0.30, 0.20, 0.20  # shares of the training loop's time
COPY_BOUND = 0.20  # share of step time copying and preparing the batch on the device (CUDA)
LAUNCH_BOUND = 0.50  # share of steps (CUDA) or of compute (CPU) bound by launching operators
OVERSUBSCRIBED = 0.75  # CPU seconds per wall second, per intra-op thread, under which waiting threads are judged


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
    # the run's own processes' CPU use, % of the CPUs it may use (steady state), when sampled
    cpu_util: float | None = None
    host_cpu: float | None = None  # the host's CPU use, % of all its cores
    other_cpu: float | None = None  # other processes' share of the host, % of all its cores
    cores: int = 0  # the host's cores
    threads: int = 0  # torch's intra-op threads (0: not known)
    run_cores: float | None = None  # the main process's CPU seconds per second of wall time (steady state)
    workers_cpu: float | None = None  # the loader's workers' CPU use, % of one core
    # evaluation, checkpoint, logging: shares of the training loop's time
    loop_shares: dict = field(default_factory=dict)
    # CUDA: share of steps waiting on launches; CPU: share of compute not growing with the batch
    launch_frac: float | None = None
    launches: int | None = None  # operator launches per step
    # the model has convolutions the layout changes and computes two real samples in channels-last
    # layout / has operators autocast lowers and computes them under autocast (its probe after
    # training, saturate.components.model.takes_advice): what is not proposed otherwise
    channels_last_ok: bool = True
    amp_ok: bool = True
    cpu_bf16: bool = False  # a CPU with native bf16 kernels (AVX512-BF16, AMX): bf16 autocast may pay there


@dataclass
class Verdict:
    kind: str  # the verdict's name (the module's docstring lists them)
    reason: str  # the measured figure that decided it
    suggestions: list[tuple[str, str]] = field(default_factory=list)  # (overrides, why)


def _host_busy(f: RunFacts) -> bool:
    """On the CPU, other processes take at least OTHER_BUSY % of the host: the step's timings
    are stretched by their load, and no longer compare with the cost probes' after training."""
    return f.device != "cuda" and f.other_cpu is not None and f.other_cpu >= OTHER_BUSY


def free_cores(f: RunFacts) -> int:
    """The cores other processes leave this run: those it may use less their measured load,
    rounded, at least 1."""
    other = round((f.other_cpu or 0.0) * f.cores / 100)
    return max(1, min(f.cpus, f.cores - other) if f.cores else f.cpus)


def _oversubscribed_verdict(f: RunFacts, wait: float) -> Verdict | None:
    """On the CPU, torch's threads outnumber the free cores and got markedly less CPU time than
    as many threads running all the time would: oversubscribed, the thread count advised first."""
    if f.device == "cuda" or f.threads <= 1 or f.other_cpu is None or f.run_cores is None:
        return None
    free = free_cores(f)
    if f.threads <= free or f.run_cores >= OVERSUBSCRIBED * f.threads:
        return None
    return Verdict(
        "oversubscribed",
        f"torch's {f.threads} intra-op threads share {free} of {f.cores} cores free (other processes keep "
        f"{f.other_cpu * f.cores / 100:.1f} busy): the run got {f.run_cores:.2f} cores of CPU time per second, "
        f"{f.run_cores / f.threads:.0%} of its threads' (< {OVERSUBSCRIBED:.0%}), so its threads wait for cores and "
        f"each operator for its slowest thread (waiting for data took {wait:.1%} of step time)",
        [threads_fix(f, free), *compute_fixes(f)],
    )


def _saturated(f: RunFacts) -> bool:
    """The run's own processes keep its CPUs busy (the seeds' "CPU load < 90 %" check), and
    its workers take a real part of that (at least WORKERS_BUSY % of one core: idle workers
    beside a training that uses every core are not what slows it)."""
    busy_workers = f.workers_cpu is None or f.workers_cpu >= WORKERS_BUSY
    return (
        f.cpu_util is not None and f.cpu_util >= CPU_SATURATED and f.num_workers > 0 and not f.resident and busy_workers
    )


def _loop_verdict(f: RunFacts) -> Verdict | None:
    """Evaluation, checkpoints or logging taking the loop's time, the largest share first."""
    rules = {"evaluation": EVAL_HEAVY, "checkpoint": CHECKPOINT_HEAVY, "logging": LOGGING_HEAVY}
    heavy = [(share, name) for name, share in f.loop_shares.items() if name in rules and share >= rules[name]]
    if not heavy:
        return None
    share, name = max(heavy)
    fixes = {
        "evaluation": [
            ("trainer.eval_interval=5", "evaluate every 5th epoch (the last is always evaluated)"),
            ("trainer.limit_val_batches=50", "evaluate on part of the validation set between the full ones"),
        ],
        "checkpoint": [
            ("trainer.checkpoint_interval=5", "save every 5th epoch (the last is always saved)"),
            ("checkpoint.every_n_steps=0", "no checkpoints inside epochs"),
        ],
        "logging": [
            ("trainer.log_interval=50", "each log step waits for the device and writes every logger"),
            ("logger=[tensorboard]", "fewer loggers (a slow one of yours is called at every log step)"),
        ],
    }[name]
    what = {
        "evaluation": "evaluating",
        "checkpoint": "saving checkpoints",
        "logging": "logging (waiting for the device, writing loggers)",
    }
    return Verdict(
        f"{name}-heavy", f"{what[name]} took {share:.0%} of the training loop's time (>= {rules[name]:.0%})", fixes
    )


def diagnose(perf: dict[str, float], facts: RunFacts, steps: int | None = None) -> Verdict:
    """The verdict from the measured figures (see the module's docstring), and what to try;
    no verdict from fewer than MIN_STEPS steady-state steps (start-up costs would decide it)."""
    if steps is not None and steps < MIN_STEPS:
        return Verdict(
            "not judged",
            f"{steps} steady-state steps are too few to judge (at least {MIN_STEPS}): run longer for a verdict",
        )
    loop = _loop_verdict(facts)
    if loop is not None:
        return loop
    wait = perf[names.DATA_WAIT_FRAC]
    if _saturated(facts) and (facts.device != "cuda" or wait >= INPUT_BOUND):
        return Verdict(
            "CPU-saturated",
            f"this run's processes kept {facts.cpu_util:.0f}% of its {facts.cpus} CPU(s) busy with "
            f"{facts.num_workers} worker process(es): the workers and the training compete for the cores, so the "
            "step's "
            f"compute time includes waiting for one (waiting for data took {wait:.1%} of step time)",
            saturated_fixes(facts),
        )
    figure = f"waiting for data took {wait:.1%} of step time"
    if wait >= INPUT_BOUND:
        return Verdict("input-bound", f"{figure} (>= {INPUT_BOUND:.0%})", input_fixes(facts))
    copy = perf.get(names.COPY_MS, 0.0) / max(perf[names.STEP_MS], 1e-9)
    if facts.device == "cuda" and copy >= COPY_BOUND:
        return Verdict(
            "copy-bound",
            f"copying the batch to the device and preparing it took {copy:.0%} of step time (>= {COPY_BOUND:.0%})",
            copy_fixes(facts),
        )
    oversubscribed = _oversubscribed_verdict(facts, wait)
    if oversubscribed is not None:
        return oversubscribed
    if facts.launch_frac is not None and facts.launch_frac >= LAUNCH_BOUND and not _host_busy(facts):
        said = (
            f"the GPU waited on kernel launches in {facts.launch_frac:.0%} of the steps"
            if facts.device == "cuda"
            else f"{facts.launch_frac:.0%} of the step's compute does not grow with the batch ({facts.launches} "
            "operator launches): the step is dispatch and Python, not arithmetic"
        )
        return Verdict("launch-bound", f"{said} (>= {LAUNCH_BOUND:.0%}; {figure})", launch_fixes(facts))
    if wait <= COMPUTE_BOUND:
        return Verdict("compute-bound", f"{figure} (<= {COMPUTE_BOUND:.0%})", compute_fixes(facts))
    both = input_fixes(facts)[:1] + compute_fixes(facts)[:1]
    return Verdict("balanced", f"{figure} (between {COMPUTE_BOUND:.0%} and {INPUT_BOUND:.0%})", both)


def render(
    perf: dict[str, float],
    verdict: Verdict,
    *,
    steps: int,
    gpu: dict[str, float] | None = None,
    facts: RunFacts | None = None,
    stopped: str | None = None,
    notes: Sequence[str | None] = (),
) -> str:
    """The report as Markdown (console, report.md and TensorBoard text). `perf`: the run's
    final metrics (perf/*, cost/*, time/*, test/*)."""
    step = perf[names.STEP_MS]
    parts = [
        ("data wait", perf[names.DATA_WAIT_MS]),
        ("copy and device-side preparation", perf[names.COPY_MS]),
        ("compute", perf[names.COMPUTE_MS]),
    ]
    split = " + ".join(f"{name} {ms:.2f} ms ({ms / step:.0%})" for name, ms in parts)
    lines = [
        "## Bottleneck report",
        "",
        f"- throughput: **{perf[names.SAMPLES_PER_S]:,.0f} samples/s** (steady state over {steps} steps)",
        f"- step time: {step:.2f} ms = {split}",
    ]
    lines += _gpu_lines(perf, gpu)
    lines += _cost_lines(perf, host_busy=facts is not None and _host_busy(facts))
    if facts is not None and facts.cpu_util is not None:
        lines.append(_cpu_line(facts))
    for line in (_startup_line(perf), _loop_line(perf), _numerics_line(facts)):
        if line:
            lines.append(line)
    lines += [f"- {note}" for note in notes if note]
    if stopped:
        lines.append(f"- stopped early: {stopped}")
    tested = {k: v for k, v in perf.items() if k.startswith("test/")}
    if tested:
        lines.append("- test set (best.pt): " + ", ".join(f"{k} {v:.4f}" for k, v in tested.items()))
    lines += ["", f"**Verdict: {verdict.kind}**: {verdict.reason}.", ""]
    if verdict.suggestions:
        # a blank line: Markdown renderers (TensorBoard's) need it for a list
        lines += [
            "Try next (add to your command line):",
            "",
        ]
        lines += [f"- `{override}`: {why}" for override, why in verdict.suggestions]
        lines += [
            "",
            "Measure them side by side on this run: `saturate train tune=true` with this run's overrides (the "
            "loader's "
            "and the model's own limits, and each change, in short trials).",
        ]
    else:
        lines.append("Nothing obvious left to try from here.")
    return "\n".join(lines) + "\n"


def _gpu_lines(perf: dict, gpu: dict | None) -> list[str]:
    if not gpu:
        return ["- GPU utilisation: not sampled (no NVIDIA GPU or no NVML)"]
    mean, std, low = gpu[names.GPU_UTIL_MEAN], gpu[names.GPU_UTIL_STD], gpu[names.GPU_UTIL_MIN]
    lines = [
        f"- GPU utilisation (steady state, NVML; 100% for a single small kernel): mean {mean:.0f}%, std {std:.0f}, "
        f"min {low:.0f}%, {gpu[names.GPU_UTIL_UNDER_50]:.0%} of samples under 50%"
    ]
    if names.SM_ACTIVE_MEAN in gpu:
        lines.append(
            f"- SM activity {gpu[names.SM_ACTIVE_MEAN]:.0f}%, tensor-core activity "
            f"{gpu.get(names.TENSOR_ACTIVE_MEAN, 0):.0f}% (NVML GPM; DCGM's guide: 80% or more is needed, under 50% "
            "is ineffective)"
        )
    if names.GPU_IDLE_FRAC in perf:
        lines.append(
            f"- GPU idle between steps: {perf[names.GPU_IDLE_FRAC]:.0%} of step time (waiting for data "
            f"{perf[names.GPU_IDLE_DATA_FRAC]:.0%}, the host's own work {perf[names.GPU_IDLE_HOST_FRAC]:.0%}); the "
            f"GPU waited on kernel launches in {perf[names.LAUNCH_BOUND_FRAC]:.0%} of steps (host enqueue "
            f"{perf[names.ENQUEUE_MS]:.2f} ms per step)"
        )
    return lines


def _cost_lines(perf: dict, host_busy: bool = False) -> list[str]:
    if names.FLOPS_PER_STEP not in perf:
        return []
    flops, launches = perf[names.FLOPS_PER_STEP], perf[names.LAUNCHES_PER_STEP]
    achieved = perf.get(names.ACHIEVED_TFLOPS, 0.0) * 1e3
    line = f"- cost: {flops / 1e9:,.2f} GFLOP per step (forward and backward), achieved {achieved:,.1f} GFLOP/s"
    mfu, peak = perf.get(names.MFU), perf.get(names.PEAK_TFLOPS)
    if mfu is not None and mfu > 1.0:
        line += (
            f"; MFU not shown: {mfu:.0%} of the {peak:g} TFLOP/s peak is impossible (the count or the peak is wrong)"
        )
    elif mfu is not None:
        line += f"; MFU {mfu:.1%} of the {peak:g} TFLOP/s peak"
    elif perf.get(names.COST_DEVICE) == "cuda":
        line += "; MFU: no peak known for this GPU (saturate.diagnostics.costs.PEAK_TFLOPS)"
    line += (
        f"; {launches:,.0f} operator launches per step ({perf.get(names.FLOPS_PER_LAUNCH, 0) / 1e6:,.2f} MFLOP each)"
    )
    if names.FIXED_FRAC in perf:
        line += (
            f"; {perf[names.FIXED_FRAC]:.0%} of the step's compute does not grow with the batch (dispatch, Python, "
            f"the optimizer's update; each sample adds {perf[names.PER_SAMPLE_MS]:.3f} ms)"
        )
        if host_busy:
            line += " (not judged: other processes' load stretched the step's timings, not the probe's)"
    return [line]


def _cpu_line(f: RunFacts) -> str:
    assert f.cpu_util is not None  # called where the run's CPU share was read
    line = f"- CPU: this run {f.cpu_util:.0f}% of its {f.cpus} CPU(s) (main process and {f.num_workers} worker(s))"
    if f.device != "cuda" and f.threads and f.run_cores is not None:
        line += f"; the main process's {f.threads} intra-op threads got {f.run_cores:.2f} cores of CPU time"
    if f.host_cpu is not None:  # never shown under the run's own share (the two are read from different counters)
        line += f"; the host {max(f.host_cpu, f.cpu_util * f.cpus / max(f.cores, 1)):.0f}% of its {f.cores} cores"
    if f.other_cpu is not None and f.other_cpu >= OTHER_BUSY:
        line += (
            f"; the host is busy with other processes: {f.other_cpu * f.cores / 100:.1f} of {f.cores} cores (not this "
            "run's doing: no advice about its workers follows from it; its step times are slower for it)"
        )
    return line


def _numerics_line(f: RunFacts | None) -> str | None:
    """The settings on that change what the run computes, not only how fast: its metrics are
    not the fp32 default's, bit for bit, with the same seed (measurement and loader settings
    never change them: docs/configuration.md)."""
    if f is None:
        return None
    changed = [
        *([f"{f.precision} autocast"] if f.precision != "fp32" else []),
        *(["channels_last (other convolution kernels)"] if f.channels_last else []),
        *(["compile (fused kernels)"] if f.compile else []),
    ]
    if not changed:
        return None
    return f"- numerics: {', '.join(changed)}: the same seed gives other float results than fp32 eager"


def _startup_line(perf: dict) -> str | None:
    """Where the time to the end of the first optimizer step went, the spans of 0.05 s and more
    in the order they ran (saturate.diagnostics.timing.Startup), the imports' (or the one process
    span's) with what each heavy dependency took of it."""
    total = perf.get(names.FIRST_STEP_S)
    if total is None:
        return None
    spans = [
        (k[len("startup/") : -len("_s")].replace("_", " "), v) for k, v in perf.items() if k.startswith("startup/")
    ]
    imports = [
        (k[len(names.IMPORTS_PREFIX) : -len("_s")], v) for k, v in perf.items() if k.startswith(names.IMPORTS_PREFIX)
    ]
    within = f" ({', '.join(f'{module} {v:.2f} s' for module, v in imports)})" if imports else ""
    said = ", ".join(
        f"{name} {v:.2f} s" + (within if name in (names.IMPORTS_SPAN, names.PROCESS_SPAN) else "")
        for name, v in spans
        if v >= 0.05
    )
    return f"- start-up: {total:.1f} s to the end of the first step" + (f": {said}" if said else "")


def _loop_line(perf: dict) -> str | None:
    loop = perf.get(names.LOOP_S)
    if not loop:
        return None
    parts = [(name, perf.get(f"time/{name}_s", 0.0)) for name in ("evaluation", "checkpoint", "logging")]
    steps = max(0.0, loop - sum(v for _, v in parts))
    said = ", ".join(f"{name} {v / loop:.0%}" for name, v in [("training steps", steps), *parts])
    return f"- training loop {loop:.1f} s: {said}"
