"""What one training step costs the device: its FLOPs and its operator launches, counted once
on a real batch before training, and what that makes of the measured step time.

- FLOPs: torch's own counter (`torch.utils.flop_counter.FlopCounterMode`, what Lightning's
  `measure_flops` uses) over one forward and backward of a real batch of the run's size
  (matmuls and convolutions; elementwise work is not counted, as in every MFU figure).
- Launches: the aten operators the same forward and backward dispatch (in eager mode each
  is a kernel launch on a GPU, or a dispatched kernel on the CPU); the optimizer's update is
  not included (one fused kernel with the presets' optimizers).
- MFU: achieved FLOP/s over the peak of the detected GPU for the run's dtype (dense tensor
  throughput, from the vendors' data sheets). An unknown GPU gets no MFU ("no peak known"),
  never another card's peak; a figure over 100 % means the count or the peak is wrong, and is
  reported as that, not as a result.
- On the CPU: achieved FLOP/s, and how a step's time grows with the batch (forward and
  backward timed on one sample and on COST_SAMPLES, after training): the arithmetic is what
  grows; the rest of the measured step compute (operator dispatch, Python, module calls, the
  optimizer's update) is the fixed cost per step, and its share is the CPU's
  launch-boundness.

The probes are bounded by the run: they count samples, not data-set items (a data set whose
items are whole batches gives one item, cut to COST_SAMPLES samples), and they take at most
PROBE_SHARE of the training loop's time (`Budget`; PROBE_FLOOR_S in a loop of a few seconds):
a probe whose estimated time no longer fits is skipped and named in `cost/probes_skipped`.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from saturate import names

log = logging.getLogger(__name__)

# Dense peak TFLOP/s (no sparsity) by dtype, from NVIDIA's data sheets, keyed by the whole name
# torch.cuda.get_device_name() and NVML report. Whole names, not fragments: "NVIDIA L40" is not
# an L4 (half its peak), "NVIDIA H200 NVL" not an H200 SXM; a name missing here (a MIG slice, a
# variant such as "RTX 4090 D") gets no MFU rather than a neighbour's.
_H100_SXM = {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}
_NVL = {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}  # H100 NVL, H200 NVL
_A100 = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}
_V100_SXM2 = {"fp16": 125.0, "fp32": 15.7}
_V100_PCIE = {"fp16": 112.0, "fp32": 14.0}
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "NVIDIA H100 NVL": _NVL,
    "NVIDIA H200": _H100_SXM,
    "NVIDIA H200 NVL": _NVL,
    "NVIDIA GH200 480GB": _H100_SXM,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "NVIDIA A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "NVIDIA L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "NVIDIA L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "NVIDIA L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "NVIDIA GeForce RTX 4090": {"bf16": 165.0, "fp16": 165.0, "tf32": 82.6, "fp32": 82.6},
    "Tesla V100-SXM2-16GB": _V100_SXM2,
    "Tesla V100-SXM2-32GB": _V100_SXM2,
    "Tesla V100-PCIE-16GB": _V100_PCIE,
    "Tesla V100-PCIE-32GB": _V100_PCIE,
    "Tesla V100S-PCIE-32GB": {"fp16": 130.0, "fp32": 16.4},
    "Tesla T4": {"fp16": 65.0, "fp32": 8.1},
}


@dataclass
class StepCost:
    flops: float  # per training step (forward and backward), on this rank's batch
    launches: int  # aten operators dispatched by the forward and backward
    batch: int  # the batch it was counted on

    def figures(
        self, step_s: float, device_name: str | None, dtype: str, scaled: tuple | None, compute_s: float
    ) -> dict:
        """The cost against the measured step: achieved FLOP/s, MFU with its peak (CUDA),
        launches per step, work per launch, and on the CPU the share of the step's compute
        that does not grow with the batch (`scaled`: saturate.diagnostics.costs.scaling's timings)."""
        out = {names.FLOPS_PER_STEP: self.flops, names.LAUNCHES_PER_STEP: float(self.launches)}
        if self.launches:
            out[names.FLOPS_PER_LAUNCH] = self.flops / self.launches
        if step_s > 0:
            out[names.ACHIEVED_TFLOPS] = self.flops / step_s / 1e12
        peak = peak_tflops(device_name, dtype) if device_name else None
        if peak is not None and step_s > 0:
            out[names.PEAK_TFLOPS] = peak
            out[names.MFU] = self.flops / step_s / 1e12 / peak
        if scaled is not None and compute_s > 0:
            one, many, n = scaled
            per_sample = max(0.0, (many - one) / (n - 1))  # what one more sample adds: arithmetic
            out[names.PER_SAMPLE_MS] = 1000 * per_sample
            out[names.FIXED_FRAC] = min(1.0, max(0.0, 1 - per_sample * self.batch / compute_s))
        return out


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """The dense peak of this GPU for `dtype` (bf16, fp16, fp32; fp32 with TF32 matmuls is
    "tf32"), or None when its whole name is not in the table."""
    return PEAK_TFLOPS.get(device_name.strip(), {}).get(dtype)


def batch_size(batch) -> int:
    """The number of samples in a batch of any structure: its first tensor's first dimension."""
    from torch.utils._pytree import tree_leaves

    return next((len(t) for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.ndim), 1)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


COST_SAMPLES = 8  # real samples the step's cost is counted on
PROBE_SHARE = 0.05  # the after-training probes take at most this share of the training loop's time,
# or this long in a loop under 5 s (a run whose start-up, seconds, dwarfs it), so that a short run still times its
# batch scaling (what the report's launch-bound verdict on the CPU reads)
PROBE_FLOOR_S = 0.25


class Budget:
    """The seconds the after-training probes may take, on `clock`; what did not fit is named
    in `skipped` (each probe estimates its time before it starts and is skipped when the
    estimate passes what is left)."""

    def __init__(self, seconds: float, clock=time.perf_counter):
        self.seconds, self.clock, self.start = seconds, clock, clock()
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.seconds - (self.clock() - self.start)

    def fits(self, estimate: float, what: str) -> bool:
        if estimate <= self.left():
            return True
        if what not in self.skipped:
            self.skipped.append(what)
            log.info(
                "costs: %s skipped: it would take the probes past %.0f%% of the training loop (%.2f s)",
                what,
                100 * PROBE_SHARE,
                self.seconds,
            )
        return False


def step_cost(model: torch.nn.Module, sample, task, precision, *, batch: int | None = None) -> StepCost | None:
    """FLOPs and operator launches of one forward and backward on `sample` (real samples on
    the device), the FLOPs scaled to a step of `batch` samples (matmul and convolution FLOPs
    grow linearly with the batch; launches do not). The model's weights, statistics
    (BatchNorm) and gradients are left as they were; a model the counter cannot follow gives
    None (the report then says so)."""
    from torch.utils.flop_counter import FlopCounterMode

    saved = copy.deepcopy(model.state_dict())
    try:
        counter, ops = FlopCounterMode(display=False), _CountOps()
        with counter, ops, precision.autocast():
            loss, _ = task.forward(model, sample)
            loss.backward()
        counted = batch_size(sample)
        scale = (batch or counted) / max(counted, 1)
        return StepCost(float(counter.get_total_flops()) * scale, ops.count, batch or counted)
    except Exception as e:  # noqa: BLE001 (a model the counter cannot follow: no cost figures, the run goes on)
        log.info("costs: FLOPs not counted (%s: %s)", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    finally:
        model.zero_grad(set_to_none=True)
        model.load_state_dict(saved)


def scaling(
    model: torch.nn.Module, sample, task, precision, device: torch.device, budget: Budget | None = None, guess=0.0
) -> tuple[float, float, int] | None:
    """On the CPU: (seconds for one sample, seconds for all of `sample`'s n samples, n): the
    forward and backward timed on both, alternately (median of up to 3 after a warm-up). What
    grows with the batch is arithmetic; what does not (operator dispatch, Python, module calls,
    and in the step the optimizer's update) is the step's fixed cost. With a `budget`, a pass
    starts only if the longest pass of its size so far (`guess` before the first) fits in what
    is left; fewer than a warm-up and one timing of each size gives None, as on CUDA (there
    the device's own timings say it) and for a model that cannot be timed so."""
    n = batch_size(sample)
    if device.type != "cpu" or n < 2:
        return None
    from torch.utils._pytree import tree_map

    one = tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.ndim else t, sample)
    saved = copy.deepcopy(model.state_dict())
    clock = budget.clock if budget is not None else time.perf_counter

    def once(batch) -> float:
        start = clock()
        with precision.autocast():
            loss, _ = task.forward(model, batch)
        loss.backward()
        return clock() - start

    ones: list[float] = []
    manys: list[float] = []
    try:
        for batch, times in [(one, ones), (sample, manys)] * 4:
            timed = min(len(ones), len(manys)) >= 2  # a warm-up and a timing of each: a result
            what = "batch scaling's further repeats" if timed else "batch scaling"
            if budget is not None and not budget.fits(max(times, default=guess), what):
                break
            times.append(once(batch))
        if min(len(ones), len(manys)) < 2:
            return None
        return median(ones[1:]), median(manys[1:]), n
    except Exception as e:  # noqa: BLE001 (a model that cannot take one sample, e.g. BatchNorm in training mode)
        log.info("costs: batch scaling not timed (%s: %s)", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    finally:
        model.zero_grad(set_to_none=True)
        model.load_state_dict(saved)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]
