"""Resource figures: peak device memory, and a background sampler of GPU (NVML) and CPU
(psutil) use during the run.

The sampler thread only reads counters into a list; the engine takes the window's averages
at log steps (no device synchronisation) and the run report summarises all samples.
Without NVML or without an NVIDIA GPU it says so once and samples the CPU only.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
from dataclasses import dataclass

import psutil
import torch

from saturate import names

log = logging.getLogger(__name__)

STABLE_MEAN, STABLE_STD, STARVED_MEAN = 85.0, 10.0, 50.0  # % utilisation; see `analyse`


def peak_memory(device: torch.device):
    """A callable giving the peak memory (MB) since this run started: allocated device memory
    on CUDA (its counter reset now), the process's resident set on the CPU (the highest seen
    at each call; the process-wide maximum would carry over between jobs of a multirun)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return lambda: torch.cuda.max_memory_allocated(device) / 2**20
    process, peak = psutil.Process(), [0.0]

    def rss_peak() -> float:
        peak[0] = max(peak[0], process.memory_info().rss / 2**20)
        return peak[0]

    rss_peak()
    return rss_peak


def device_memory_mb(device: torch.device) -> float:
    """Total memory of the training device: the GPU's, or the host's for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    return psutil.virtual_memory().total / 2**20


@dataclass
class Analysis:
    mean: float
    std: float
    minimum: float
    under_50: float  # share of samples under 50 %
    status: str  # stable, fluctuating or starved

    @staticmethod
    def thresholds() -> str:
        return (
            f"stable: mean >= {STABLE_MEAN:.0f}% and std <= {STABLE_STD:.0f}; starved: mean < {STARVED_MEAN:.0f}%; "
            "fluctuating: anything else"
        )


def analyse(util: list[float]) -> Analysis:
    """Summarise a series of GPU utilisation samples (%)."""
    mean = statistics.fmean(util)
    std = statistics.pstdev(util)
    if mean < STARVED_MEAN:
        status = "starved"
    elif mean >= STABLE_MEAN and std <= STABLE_STD:
        status = "stable"
    else:
        status = "fluctuating"
    return Analysis(mean, std, min(util), sum(u < 50 for u in util) / len(util), status)


def cuda_uuids() -> list[str]:
    """The UUIDs of the devices CUDA sees, in CUDA's order, as NVML writes them
    ("GPU-<uuid>"); [] when torch cannot say."""
    try:
        found = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 (no CUDA, or a torch without the property)
        return []
    return [u if u.startswith(("GPU-", "MIG-")) else f"GPU-{u}" for u in found]


def visible_nvml_handles(pynvml, uuids: list[str] | None = None) -> list[tuple[int, object]]:
    """(CUDA index, NVML handle) for each device CUDA can see. Matched by UUID when `uuids`
    (CUDA's, in its order: see cuda_uuids) are given: CUDA numbers devices fastest first,
    NVML by PCI bus, so on a machine with mixed GPUs the same number is not the same GPU.
    Otherwise (or if NVML does not know a UUID: some MIG set-ups) by CUDA_VISIBLE_DEVICES
    (indices or UUIDs) and position."""
    if uuids:
        try:
            return [(i, pynvml.nvmlDeviceGetHandleByUUID(u)) for i, u in enumerate(uuids)]
        except Exception:  # noqa: BLE001 (NVML refused a UUID: fall back to positions)
            pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
    handles = []
    for cuda_index, item in enumerate(v.strip() for v in visible.split(",") if v.strip()):
        if item.startswith("-"):  # CUDA stops at the first invalid entry
            break
        get = (
            pynvml.nvmlDeviceGetHandleByUUID
            if item.startswith(("GPU-", "MIG-"))
            else lambda i: pynvml.nvmlDeviceGetHandleByIndex(int(i))
        )
        handles.append((cuda_index, get(item)))
    return handles


def _utilisation(pynvml, handle) -> float:
    """The GPU's utilisation; for a MIG instance (which has no such query) its parent GPU's."""
    try:
        return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 (NVML's own errors)
        parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)  # raises for a plain GPU: no figure then
        return float(pynvml.nvmlDeviceGetUtilizationRates(parent).gpu)


def read_gpu(pynvml, handle) -> dict[str, float]:
    """The figures this device can give; a field NVML refuses (MIG, some vGPUs: power, clocks)
    is left out, never fatal."""
    fields = {
        "util": lambda: _utilisation(pynvml, handle),
        "mem_used_mb": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20,
        "power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000,
        "temp_c": lambda: float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
        "sm_clock_mhz": lambda: float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
    }
    values = {}
    for name, read in fields.items():
        try:
            values[name] = read()
        except Exception:  # noqa: BLE001 (a field this GPU or driver does not report)
            continue
    return values


def open_nvml():
    """The initialised pynvml module, or (None, why not)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, ""
    except Exception as e:  # noqa: BLE001 (no package, no driver, no GPU)
        return None, f"{type(e).__name__}: {e}"


class Gpm:
    """SM activity and tensor-core activity of one GPU between two NVML GPM samples (Hopper and
    later: what DCGM reports as SM activity and tensor activity; nvidia-smi's utilisation is
    100 % for one tiny kernel). `read()` gives {} on a GPU without GPM, and after any error."""

    def __init__(self, pynvml, handle):
        self.pynvml, self.handle, self.previous = pynvml, handle, None
        try:
            self.supported = bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        except Exception:  # noqa: BLE001 (an older driver or GPU, a MIG instance)
            self.supported = False

    def read(self) -> dict[str, float]:
        if not self.supported:
            return {}
        nv = self.pynvml
        try:
            current = nv.nvmlGpmSampleGet(self.handle, nv.nvmlGpmSampleAlloc())
            previous, self.previous = self.previous, current
            if previous is None:
                return {}
            request = nv.c_nvmlGpmMetricsGet_t()
            request.version, request.numMetrics, request.sample1, request.sample2 = (
                nv.NVML_GPM_METRICS_GET_VERSION,
                2,
                previous,
                current,
            )
            request.metrics[0].metricId = nv.NVML_GPM_METRIC_SM_UTIL
            request.metrics[1].metricId = nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL
            got = nv.nvmlGpmMetricsGet(request)
            nv.nvmlGpmSampleFree(previous)
            return {"sm_active": float(got.metrics[0].value), "tensor_active": float(got.metrics[1].value)}
        except Exception:  # noqa: BLE001 (GPM refused: no such figures from now on)
            self.supported = False
            return {}


class ResourceMonitor:
    """Samples every `interval_s` in a background thread: `gpu/*` for the training device
    (`gpu<k>/*` for the other visible ones) and `cpu/*` for the host and this process."""

    def __init__(self, interval_s: float, device: torch.device, enabled: bool = True):
        self.interval_s, self.enabled = interval_s, enabled
        self.samples: list[dict[str, float]] = []
        self.phases: list[str] = []  # what the run was doing at each sample: start-up, train, evaluation, checkpoint
        self.phase = "start-up"  # set by the engine: "train" once the steady state starts
        self._taken = 0  # samples already averaged into a window
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pynvml, self.handles = None, []
        self._failed = 0  # samples that failed (logged once)
        if not enabled:
            return
        self.pynvml, why = open_nvml()
        if self.pynvml is None:
            # a warning when training on CUDA; without a GPU it is no news (the report says "not sampled")
            say = log.warning if device.type == "cuda" else log.debug
            say("monitor: no NVML (%s); GPU utilisation is not sampled, CPU use is", why)
        else:
            try:
                self.handles = visible_nvml_handles(self.pynvml, cuda_uuids())
            except Exception as e:  # noqa: BLE001 (a UUID NVML does not know, a driver error: sample the CPU only)
                log.warning(
                    "monitor: NVML cannot list the visible GPUs (%s: %s); GPU utilisation is not sampled",
                    type(e).__name__,
                    e,
                )
            if not self.handles:
                log.info("monitor: NVML found no visible NVIDIA GPU; GPU utilisation is not sampled, CPU use is")
        self.own = device.index if device.type == "cuda" and device.index is not None else 0
        self.gpm = {index: Gpm(self.pynvml, handle) for index, handle in self.handles if index == self.own}
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # the first reading only starts the clock
        self.children: dict[int, psutil.Process] = {}  # the workers, kept so that each one's CPU clock runs
        self.cores = psutil.cpu_count() or 1
        psutil.cpu_percent(None)

    def _tree_util(self) -> tuple[float, float]:
        """CPU use of this process and of its workers, each % of one core (a worker's first
        reading only starts its clock: a worker that lived under one interval is not counted)."""
        main, workers = self.process.cpu_percent(None), 0.0
        alive = {}
        for child in self.process.children(recursive=True):
            known = self.children.get(child.pid, child)
            try:
                workers += known.cpu_percent(None)
                alive[child.pid] = known
            except psutil.Error:  # exited meanwhile
                continue
        self.children = alive
        return main, workers

    def sample(self) -> dict[str, float]:
        host = psutil.cpu_percent(None)
        main, workers = self._tree_util()
        tree = main + workers
        values = {
            names.CPU_UTIL: host,  # all the host's cores, every process
            names.PROCESS_UTIL: tree,  # this run's processes (main and workers), % of one core
            names.WORKERS_UTIL: workers,  # the loader's worker processes, % of one core
            names.RUN_UTIL: min(100.0, tree / self.cores),  # this run's share of the host's cores, %
            names.OTHER_UTIL: max(0.0, host - tree / self.cores),  # other processes' share, %
            names.RSS_MB: self.process.memory_info().rss / 2**20,
            names.WORKERS_RSS_MB: sum(_rss(w) for w in self.children.values()) / 2**20,
        }
        for index, handle in self.handles:
            prefix = "gpu" if index == self.own else f"gpu{index}"
            values.update({f"{prefix}/{k}": v for k, v in read_gpu(self.pynvml, handle).items()})
            if index in self.gpm:
                values.update({f"gpu/{k}": v for k, v in self.gpm[index].read().items()})
        return values

    def _take(self) -> bool:
        """Take one sample; a failure is logged (once) and skipped: the monitor never stops
        training. Returns whether it worked."""
        try:
            self.samples.append(self.sample())
            self.phases.append(self.phase)
            return True
        except Exception as e:  # noqa: BLE001 (a GPU that fell off the bus, a process gone)
            if not self._failed:
                log.warning("monitor: a sample failed (%s: %s); skipping it", type(e).__name__, e)
            self._failed += 1
            return False

    def _run(self) -> None:
        misses = 0
        while not self._stop.wait(self.interval_s):
            misses = 0 if self._take() else misses + 1
            if misses >= 5:
                log.warning("monitor: 5 samples in a row failed; no more sampling in this run")
                return

    def start(self) -> ResourceMonitor:
        if self.enabled:
            self._take()  # one now: even a short run has a reading
            self._thread = threading.Thread(target=self._run, name="saturate-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1)
        if self.pynvml is not None:
            try:
                self.pynvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 (shutting down: nothing left to save)
                pass

    def window(self) -> dict[str, float]:
        """Averages of the samples since the last call (empty if there were none)."""
        new, self._taken = self.samples[self._taken :], len(self.samples)
        if not new:
            return {}
        return {key: statistics.fmean(s[key] for s in new if key in s) for key in new[-1]}

    def steady(self) -> list[dict[str, float]]:
        """The samples taken while training steps ran in the steady state (not start-up,
        compilation, evaluation or checkpoints); all of them when there are none such."""
        kept = [s for s, phase in zip(self.samples, self.phases, strict=True) if phase == "train"]
        return kept or self.samples

    def cpu_mean(self) -> float | None:
        """The host's mean CPU use over the steady state, %, or None if nothing was sampled."""
        util = [s[names.CPU_UTIL] for s in self.steady() if names.CPU_UTIL in s]
        return statistics.fmean(util) if util else None

    def cpu_summary(self) -> dict[str, float]:
        """The run's own CPU share and other processes' (host %), and the host's, over the steady state."""
        steady = self.steady()
        out = {}
        for key in (names.CPU_UTIL, names.RUN_UTIL, names.OTHER_UTIL, names.WORKERS_UTIL):
            values = [s[key] for s in steady if key in s]
            if values:
                out[f"{key}_mean"] = statistics.fmean(values)
        return out

    def gpu_summary(self) -> dict[str, float] | None:
        """The run's GPU figures over the steady state for the report (utilisation, and SM
        and tensor activity where NVML offers them), or None if none was sampled."""
        steady = self.steady()
        util = [s[names.GPU_UTIL] for s in steady if names.GPU_UTIL in s]
        if not util:
            return None
        a = analyse(util)
        out = {
            names.GPU_UTIL_MEAN: a.mean,
            names.GPU_UTIL_STD: a.std,
            names.GPU_UTIL_MIN: a.minimum,
            names.GPU_UTIL_UNDER_50: a.under_50,
        }
        for key in (names.SM_ACTIVE, names.TENSOR_ACTIVE, names.GPU_MEM_USED_MB):
            values = [s[key] for s in steady if key in s]
            if values:
                out[f"{key}_mean"] = statistics.fmean(values)
        return out

    def __enter__(self) -> ResourceMonitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _rss(process: psutil.Process) -> int:
    try:
        return process.memory_info().rss
    except psutil.Error:  # a worker that just exited
        return 0
