"""The verdict: right on constructed facts, blind to other processes' load, in the terms the
GPU world measures (idle gaps, SM activity, MFU, launches). The CUDA paths are checked with
faked events and NVML; the whole-run cases live in scripts/bench_verdict.py (slow tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

from saturate.components.precision import Precision
from saturate.diagnostics import timing
from saturate.diagnostics.costs import StepCost, peak_tflops, step_cost
from saturate.diagnostics.monitor import Gpm, ResourceMonitor
from saturate.diagnostics.report import OTHER_BUSY, diagnose, render
from saturate.diagnostics.timing import StepTimer
from tests.data.test_pipeline import facts, perf


def test_load_from_other_processes_is_named_and_never_turned_into_worker_advice():
    """The issue's case: a compute-bound run on a host another job keeps busy. The host is 97%
    busy, the run's own processes 45% of its CPUs: compute-bound, and the report says whose
    load it is."""
    shared = facts(
        device="cpu", cpus=2, cores=2, num_workers=1, placement="none", cpu_util=45.0, host_cpu=97.0, other_cpu=52.0
    )
    verdict = diagnose(perf(0.001), shared, steps=100)
    assert verdict.kind == "compute-bound" and not any("num_workers" in o for o, _ in verdict.suggestions)
    text = render(perf(0.001), verdict, steps=100, facts=shared)
    assert "this run 45% of its 2 CPU(s)" in text and "the host 97% of its 2 cores" in text
    assert "busy with other processes: 1.0 of 2 cores" in text
    own = facts(
        device="cpu", cpus=2, cores=2, num_workers=2, placement="cpu", cpu_util=97.0, host_cpu=98.0, other_cpu=1.0
    )
    assert diagnose(perf(0.02), own, steps=100).kind == "CPU-saturated"  # the run's own workers: the advice applies


@pytest.mark.parametrize(
    ("shares", "kind", "first"),
    [
        ({"evaluation": 0.45, "checkpoint": 0.05}, "evaluation-heavy", "trainer.eval_interval=5"),
        ({"evaluation": 0.1, "checkpoint": 0.35}, "checkpoint-heavy", "trainer.checkpoint_interval=5"),
        ({"logging": 0.25}, "logging-heavy", "trainer.log_interval=50"),
        ({"evaluation": 0.2, "checkpoint": 0.1, "logging": 0.1}, "input-bound", "augmentation=gpu"),
    ],
)
def test_a_loop_that_spends_its_time_outside_the_steps_says_where(shares, kind, first):
    verdict = diagnose(perf(0.35), facts(loop_shares=shares), steps=100)
    assert verdict.kind == kind and verdict.suggestions[0][0] == first


def test_launch_and_copy_bound_verdicts():
    cuda = diagnose(perf(0.01), facts(placement="gpu", launch_frac=0.8, in_memory=True), steps=100)
    assert cuda.kind == "launch-bound" and "waited on kernel launches in 80% of the steps" in cuda.reason
    assert [o for o, _ in cuda.suggestions] == ["trainer.compile=true", "loader.batch_size=256", "loader=resident"]
    cpu = diagnose(perf(0.01), facts(device="cpu", placement="none", launch_frac=0.6, launches=300, cpus=2), steps=100)
    assert (
        cpu.kind == "launch-bound"
        and "60% of the step's compute does not grow with the batch (300 operator launches)" in cpu.reason
    )
    # beside other processes' load the step's timings stretch and the start-up's do not (a compute-bound
    # CNN measured 51% "fixed" beside two CPU burners): not judged, and the report says why
    busy = facts(
        device="cpu", placement="none", launch_frac=0.6, launches=300, cpus=2, cores=2, cpu_util=49.0, other_cpu=51.0
    )
    assert diagnose(perf(0.01), busy, steps=100).kind == "compute-bound"
    costs = {
        **perf(0.01),
        "cost/flops_per_step": 1e9,
        "cost/launches_per_step": 300.0,
        "cost/fixed_frac": 0.6,
        "cost/per_sample_ms": 0.1,
    }
    assert "(not judged: other processes' load stretched" in render(
        costs, diagnose(perf(0.01), busy, steps=100), steps=100, facts=busy
    )
    copy = {**perf(0.01), "perf/copy_ms": 3.0}
    assert diagnose(copy, facts(placement="gpu", in_memory=True), steps=100).kind == "copy-bound"
    # no copy on a CPU
    assert diagnose(copy, facts(device="cpu", placement="none", cpus=2), steps=100).kind == "compute-bound"


def test_mfu_against_the_detected_gpus_peak_never_borrowed_never_over_100_percent():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0 and peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA GeForce GTX 1080", "fp32") is None
    cost = StepCost(flops=4.945e12, launches=1000, batch=512)
    figures = cost.figures(0.01, "NVIDIA H100 80GB HBM3", "bf16", None, 0.009)
    assert figures["cost/mfu"] == pytest.approx(0.5) and figures["cost/flops_per_launch"] == pytest.approx(4.945e9)
    text = render({**perf(0.01), **figures, "cost/device": "cuda"}, diagnose(perf(0.01), facts()), steps=100)
    assert "MFU 50.0% of the 989 TFLOP/s peak" in text and "1,000 operator launches per step" in text
    wrong = cost.figures(0.001, "NVIDIA H100 80GB HBM3", "bf16", None, 0.0009)  # 5x the peak: a wrong count
    text = render({**perf(0.01), **wrong, "cost/device": "cuda"}, diagnose(perf(0.01), facts()), steps=100)
    assert "MFU not shown: 500% of the 989 TFLOP/s peak is impossible" in text
    unknown = cost.figures(0.01, "NVIDIA GeForce GTX 1080", "fp32", None, 0.009)
    assert "cost/mfu" not in unknown
    text = render({**perf(0.01), **unknown, "cost/device": "cuda"}, diagnose(perf(0.01), facts()), steps=100)
    assert "MFU: no peak known for this GPU" in text


# The names NVML and torch.cuda.get_device_name report for each card in the table, and the
# card's dense peaks in TFLOP/s from its data sheet: bf16 (- where it has none), fp32
NVML_NAMES = {
    name.strip(): (None if bf16.strip() == "-" else float(bf16), float(fp32))
    for name, bf16, fp32 in (
        line.split("|")
        for line in """
        NVIDIA H100 80GB HBM3 | 989 | 67
        NVIDIA H100 PCIe | 756 | 51
        NVIDIA H100 NVL | 835 | 60
        NVIDIA H200 | 989 | 67
        NVIDIA H200 NVL | 835 | 60
        NVIDIA GH200 480GB | 989 | 67
        NVIDIA A100-SXM4-80GB | 312 | 19.5
        NVIDIA A100-SXM4-40GB | 312 | 19.5
        NVIDIA A100 80GB PCIe | 312 | 19.5
        NVIDIA A100-PCIE-40GB | 312 | 19.5
        NVIDIA A10G | 70 | 31.2
        NVIDIA A10 | 125 | 31.2
        NVIDIA L40S | 362 | 91.6
        NVIDIA L40 | 181 | 90.5
        NVIDIA L4 | 121 | 30.3
        NVIDIA GeForce RTX 4090 | 165 | 82.6
        Tesla V100-SXM2-16GB | - | 15.7
        Tesla V100-SXM2-32GB | - | 15.7
        Tesla V100-PCIE-16GB | - | 14.0
        Tesla V100-PCIE-32GB | - | 14.0
        Tesla V100S-PCIE-32GB | - | 16.4
        Tesla T4 | - | 8.1
        """.strip().splitlines()
    )
}


@pytest.mark.parametrize("name", list(NVML_NAMES))
def test_each_card_gets_its_own_peak_by_its_whole_name(name):
    """A fragment of a name matched its neighbours: "NVIDIA L40" took the L4's peak (MFU 1.5x
    too high in bf16), "NVIDIA H200 NVL" the SXM's, the V100 PCIe and V100S the SXM2's."""
    bf16, fp32 = NVML_NAMES[name]
    assert peak_tflops(name, "bf16") == bf16 and peak_tflops(name, "fp32") == fp32


@pytest.mark.parametrize(
    "name", ["NVIDIA GeForce RTX 4090 D", "NVIDIA A100-SXM4-40GB MIG 1g.5gb", "NVIDIA H100", "NVIDIA L4 Max"]
)
def test_a_name_not_in_the_table_gets_no_peak_rather_than_a_neighbours(name):
    assert peak_tflops(name, "bf16") is None and peak_tflops(name, "fp32") is None


def test_a_steps_flops_are_counted_on_real_samples_and_leave_the_model_as_it_was():
    """Linear(10 -> 5) on 8 samples: forward 2*8*10*5 = 800 FLOPs, backward 800 more (the
    weight's gradient; the input needs none); scaled to a batch of 32: 6400."""
    from saturate.tasks import Classification

    model = torch.nn.Sequential(torch.nn.Linear(10, 5), torch.nn.BatchNorm1d(5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(8, 10), torch.randint(0, 5, (8,)))
    fp32 = Precision("fp32", "cpu", None, torch.amp.GradScaler("cpu", enabled=False))
    cost = step_cost(model, batch, Classification(5), fp32, batch=32)
    assert cost.flops == 4 * 1600 and cost.launches > 5 and cost.batch == 32
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm's statistics did not move
    assert all(p.grad is None for p in model.parameters())


class SimulatedGpu:
    """A device that cannot exist here, simulated: kernels run one after another in launch
    order, each starting when launched or when the one before ends, whichever is later;
    CUDA's launch queue holds `queue` pending kernels, and a launch into a full queue waits
    for a slot. The host's clock advances by each launch's cost and by its waits. Events
    complete when the device reaches them; `query()` asks without waiting, as CUDA's does."""

    def __init__(self, queue: int = 1024):
        self.host, self.queue = 0.0, queue
        self.ends: list[float] = []  # device end times of the kernels launched so far
        self.reads = 0  # event timings read (CUDA: only after a synchronise)

    @property
    def free(self) -> float:
        return self.ends[-1] if self.ends else 0.0

    def launch(self, host_s: float, device_s: float, count: int = 1) -> None:
        for _ in range(count):
            pending = [e for e in self.ends[-self.queue :] if e > self.host]
            if len(pending) >= self.queue:
                self.host = pending[0]  # a full queue: the launch waits for the oldest kernel to end
            self.host += host_s
            self.ends.append(max(self.host, self.free) + device_s)

    def wait(self, seconds: float) -> None:
        self.host += seconds

    def read(self) -> None:
        """A host read of a device value: the host waits for everything launched."""
        self.host = max(self.host, self.free)

    def install(self, monkeypatch) -> None:
        gpu = self

        class Event:
            def __init__(self, enable_timing=True):
                self.at = None

            def record(self):
                self.at = max(gpu.host, gpu.free)

            def query(self) -> bool:
                return self.at <= gpu.host

            def elapsed_time(self, other) -> float:
                gpu.reads += 1
                return (other.at - self.at) * 1000  # ms

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: gpu.read())
        monkeypatch.setattr(timing.time, "perf_counter", lambda: gpu.host)


def simulated_steps(gpu: SimulatedGpu, step, steps: int = 12, wait_s: float = 0.0):
    """`steps` training steps timed by a StepTimer on the simulated GPU; `step(gpu, timer)`
    launches one step's compute. Returns the window flushed after them."""
    timer = StepTimer(torch.device("cuda"))
    timer.cuda = True

    def batches():
        for _ in range(steps):
            gpu.wait(wait_s)  # the host waits for the batch
            yield None

    for _ in timer.fetch(batches()):
        with timer.phase("copy"):
            gpu.launch(5e-6, 20e-6)
        with timer.phase("compute"):
            step(gpu, timer)
        timer.step_done(32)
        gpu.wait(50e-6)  # the loop's own work between steps
    assert gpu.reads == 0  # nothing read while the steps ran
    return timer.flush()


def launch_bound_step(gpu, timer):
    """A tiny model: 200 kernels a step, each launched in 10 us and run in 4."""
    gpu.launch(10e-6, 4e-6, count=200)


def compute_bound_step_reading_the_device(gpu, timer):
    """fp16's non-finite check: forward and backward (launched in 2 ms, run in 10 ms), a host
    read that waits for them, then the optimizer's update."""
    gpu.launch(10e-6, 50e-6, count=200)
    timer.host_read()
    gpu.read()
    gpu.launch(10e-6, 20e-6, count=20)


def compute_bound_step_filling_the_queue(gpu, timer):
    """A ResNet-sized step, no read: 800 kernels launched in 10 us, run in 50 us each; the
    launch queue fills in the second step, and from then on each launch waits for a slot."""
    gpu.launch(10e-6, 50e-6, count=800)


@pytest.mark.parametrize(
    ("step", "launch_bound"),
    [
        (launch_bound_step, True),
        (compute_bound_step_reading_the_device, False),
        (compute_bound_step_filling_the_queue, False),
    ],
)
def test_launch_bound_steps_are_those_the_device_waited_on_launches_for(monkeypatch, step, launch_bound):
    """The host's time inside the compute phase equals the device's in all three: the tiny
    model's because the device keeps pace with the launches, the read's because the host
    waits for the device inside the phase, the full queue's because each launch waits for a
    slot. Only the first is launch-bound: its device had finished the previous step when
    the host began this one, and kept pace with what was launched before any host read."""
    gpu = SimulatedGpu(queue=1024)
    gpu.install(monkeypatch)
    window = simulated_steps(gpu, step)
    assert window.timed_steps == 11  # the first step after a flush follows a synchronise: not judged
    assert window.enqueue_s > 0
    frac = window.metrics()["perf/launch_bound_frac"]
    assert (frac >= 0.5) is launch_bound, frac


def test_gpu_idle_gaps_are_split_between_data_and_the_hosts_own_work(monkeypatch):
    """Between steps the device idles while the host waits 3 ms for each batch and does
    50 us of its own work; the split counts the wait as data, the rest as the host's."""
    gpu = SimulatedGpu()
    gpu.install(monkeypatch)
    window = simulated_steps(gpu, launch_bound_step, steps=4, wait_s=0.003)
    assert window.gap_s > window.gap_data_s == pytest.approx(3 * 0.003, rel=1e-6)
    assert window.gap_s - window.gap_data_s == pytest.approx(3 * 50e-6, rel=0.2)


def test_the_run_cpu_share_counts_its_workers_and_not_other_processes():
    """A worker (a child of this process) burning a core counts as the run's; a stranger (not
    a child: started through a shell that exits, as another job is) burning one does not.

    The figures are held against each process's own CPU clock over the same window, so the
    test does not depend on how much of a core either got on a loaded machine."""
    from scripts.bench_verdict import burning

    def busy(process: psutil.Process) -> float:
        times = process.cpu_times()
        return times.user + times.system

    burn = [sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
    monitor = ResourceMonitor(60, torch.device("cpu"))
    with burning(1) as strangers:
        child = subprocess.Popen(burn)
        try:
            worker, stranger = psutil.Process(child.pid), psutil.Process(strangers[0])
            monitor.sample()  # starts the worker's clock
            began, worker_before, stranger_before = time.monotonic(), busy(worker), busy(stranger)
            time.sleep(1.5)
            sample = monitor.sample()
            window = time.monotonic() - began
            worker_pct = 100 * (busy(worker) - worker_before) / window
            stranger_pct = 100 * (busy(stranger) - stranger_before) / window
            children = {p.pid for p in psutil.Process().children(recursive=True)}
        finally:
            child.kill()
    # the stranger is not among the run's processes (which may hold other tests' leftovers in this worker)
    assert child.pid in children and len(strangers) == 1 and not children & set(strangers)
    cores = psutil.cpu_count()
    assert worker_pct > 0 and stranger_pct > 0  # both ran in the window
    # the workers' figure is the worker's own use (% of one core), without the stranger's
    assert sample["cpu/workers_util"] == pytest.approx(worker_pct, abs=10)
    assert sample["cpu/run_util"] == pytest.approx(min(100.0, sample["cpu/process_util"] / cores))
    # the stranger's use (a share of the host's cores) is counted as other processes', not the run's
    assert sample["cpu/other_util"] >= stranger_pct / cores - 5


class FakeGpmNvml:
    NVML_GPM_METRICS_GET_VERSION, NVML_GPM_METRIC_SM_UTIL, NVML_GPM_METRIC_ANY_TENSOR_UTIL = 1, 2, 3

    class _Metric:
        metricId, value = 0, 0.0

    class c_nvmlGpmMetricsGet_t:
        def __init__(self):
            self.metrics = [FakeGpmNvml._Metric(), FakeGpmNvml._Metric()]

    def __init__(self, supported=True):
        self.supported, self.freed = supported, 0

    def nvmlGpmQueryDeviceSupport(self, handle):
        return type("S", (), {"isSupportedDevice": int(self.supported)})()

    def nvmlGpmSampleAlloc(self):
        return object()

    def nvmlGpmSampleGet(self, handle, sample):
        return sample

    def nvmlGpmSampleFree(self, sample):
        self.freed += 1

    def nvmlGpmMetricsGet(self, request):
        values = {2: 72.5, 3: 41.0}
        for m in request.metrics:
            m.value = values[m.metricId]
        return request


def test_sm_and_tensor_activity_from_nvml_gpm_where_offered():
    nvml = FakeGpmNvml()
    gpm = Gpm(nvml, handle=0)
    assert gpm.read() == {}  # the first sample only starts the interval
    assert gpm.read() == {"sm_active": 72.5, "tensor_active": 41.0} and nvml.freed == 1
    assert Gpm(FakeGpmNvml(supported=False), handle=0).read() == {}  # before Hopper: no such figures


@pytest.mark.slow  # eleven short runs, about two minutes
def test_every_constructed_cpu_case_gets_its_verdict(tmp_path):
    """scripts/bench_verdict.py's CPU cases, once each: the verdict names the cause built in,
    its advice is the one the cause calls for, and the run beside two CPU-burning processes is
    told about its threads, not its workers."""
    from tests.conftest import ROOT

    out = tmp_path / "verdicts.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_verdict.py"),
            "--rounds",
            "1",
            "--no-traceml",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        # torch's own thread count, as a user's run has it: pytest's workers set OMP_NUM_THREADS=1 (tests/conftest.py),
        # which leaves a run no threads to oversubscribe the host with
        env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
    )
    results = json.loads(out.read_text())
    # other processes (the suite's other workers) using OTHER_BUSY % of the host stretch the step's timings against the
    # start-up's probe: the report does not judge launch-boundness then (the step is compute-bound); and where they
    # leave fewer cores free than torch has threads, a compute-bound case is oversubscribed, as the rule says
    allowed = {name: {r["expected"]} for name, r in results.items()}
    for name, r in results.items():
        if (r["other_cpu"] or 0) >= OTHER_BUSY and r["expected"] in ("compute-bound", "launch-bound"):
            allowed[name] |= {"compute-bound", "oversubscribed"}
    wrong = {name: r["given"] for name, r in results.items() if not set(r["given"]) <= allowed[name]}
    assert not wrong, done.stdout
    assert all(all(r["advice_ok"]) for r in results.values()), done.stdout
    exact = all(r["given"] == [r["expected"]] for r in results.values())
    assert done.returncode == (0 if exact else 1) and len(results) == 11
    assert not any("num_workers" in o for o in results["cpu-contention"]["suggestions"])


def test_the_report_names_the_settings_that_change_the_numerics():
    """precision, channels_last and compile change what a run computes (issue 35): said as such."""
    plain = render(perf(0.01), diagnose(perf(0.01), facts()), steps=100, facts=facts())
    assert "- numerics:" not in plain
    changed = facts(precision="bf16", channels_last=True, compile=True)
    text = render(perf(0.01), diagnose(perf(0.01), changed), steps=100, facts=changed)
    assert (
        "- numerics: bf16 autocast, channels_last (other convolution kernels), compile (fused kernels): the same seed "
        "gives other float results than fp32 eager"
    ) in text


def test_the_start_up_line_names_what_each_heavy_import_took_of_the_imports_span():
    timed = {"time/first_step_s": 3.7, "startup/interpreter_and_imports_s": 2.74, "startup/data_s": 0.27}
    timed |= {"imports/torch_s": 1.21, "imports/torch._dynamo_s": 0.74, "imports/torchmetrics_s": 0.98}
    text = render({**perf(0.01), **timed}, diagnose(perf(0.01), facts()), steps=100)
    assert (
        "- start-up: 3.7 s to the end of the first step: interpreter and imports 2.74 s (torch 1.21 s, "
        "torch._dynamo 0.74 s, torchmetrics 0.98 s), data 0.27 s" in text
    )
    untimed = {k: v for k, v in timed.items() if not k.startswith("imports/")}  # saturate.fit: none timed
    text = render({**perf(0.01), **untimed}, diagnose(perf(0.01), facts()), steps=100)
    assert "interpreter and imports 2.74 s, data 0.27 s" in text
    split = {k: v for k, v in timed.items() if k != "startup/interpreter_and_imports_s"}  # train.py's own process
    split = {"startup/interpreter_s": 0.31, "startup/hydra_s": 0.62, "startup/imports_s": 1.81, **split}
    text = render({**perf(0.01), **split}, diagnose(perf(0.01), facts()), steps=100)
    assert (
        "- start-up: 3.7 s to the end of the first step: interpreter 0.31 s, hydra 0.62 s, imports 1.81 s (torch "
        "1.21 s, torch._dynamo 0.74 s, torchmetrics 0.98 s), data 0.27 s" in text
    )


def busy_host(**changes):
    """A CPU run on 2 cores beside a process holding about one of them: torch's default 2
    threads, the main process getting `run_cores` of CPU per second of wall time."""
    base = dict(device="cpu", cpus=2, cores=2, num_workers=0, placement="none", in_memory=True, resident=True)
    base.update(cpu_util=55.0, host_cpu=100.0, other_cpu=45.0, threads=2, run_cores=1.1, channels_last_ok=True)
    return facts(**{**base, **changes})


def test_threads_that_outnumber_the_cores_left_free_are_judged_oversubscribed_with_the_thread_count_first():
    oversubscribed = busy_host()
    verdict = diagnose(perf(0.001), oversubscribed, steps=100)
    assert verdict.kind == "oversubscribed"
    assert verdict.suggestions[0][0] == "device.threads=1"
    assert "2 intra-op threads" in verdict.reason and "1 of 2 cores free" in verdict.reason
    assert "1.10 cores of CPU time per second" in verdict.reason
    text = render(perf(0.001), verdict, steps=100, facts=oversubscribed)
    assert "**Verdict: oversubscribed**" in text and "- `device.threads=1`" in text
    assert "the main process's 2 intra-op threads got 1.10 cores of CPU time" in text


@pytest.mark.parametrize(
    "changes",
    [
        {"other_cpu": 2.0, "host_cpu": 60.0},  # a quiet host: the cores are the run's
        {"run_cores": 1.8},  # the threads got their CPU time: the other load did not hold them up
        {"threads": 1},  # one thread: nothing to take away
        {"device": "cuda"},
    ],
)
def test_a_run_whose_threads_got_their_cores_is_judged_as_before(changes):
    verdict = diagnose(perf(0.001), busy_host(**changes), steps=100)
    assert verdict.kind == "compute-bound" and not any(o.startswith("device.threads") for o, _ in verdict.suggestions)


def test_a_run_waiting_for_its_data_on_a_busy_host_is_input_bound():
    """Waiting for batches lowers the CPU a run gets as much as waiting for cores: the input
    side is judged first."""
    assert diagnose(perf(0.35), busy_host(run_cores=0.5), steps=100).kind == "input-bound"


def test_a_model_without_convolutions_gets_no_layout_advice_and_one_without_autocast_kernels_no_precision():
    """channels_last_ok and amp_ok as saturate.components.model.takes_advice finds them: False for
    a model without convolutions, and for one whose operators autocast leaves in fp32."""

    def advised(**changes):
        return [o for o, _ in diagnose(perf(0.001), busy_host(**changes), steps=100).suggestions]

    assert "trainer.channels_last=true" in advised(other_cpu=2.0)
    assert "trainer.channels_last=true" in advised(other_cpu=2.0, device="cuda")
    assert "precision=amp" in advised(other_cpu=2.0, device="cuda")
    assert "trainer.channels_last=true" not in advised(other_cpu=2.0, channels_last_ok=False)
    assert not {"trainer.channels_last=true", "precision=amp"} & set(
        advised(other_cpu=2.0, device="cuda", channels_last_ok=False, amp_ok=False)
    )
    assert advised(channels_last_ok=False) == ["device.threads=1", "device=cuda"]


class _Recurrent(torch.nn.Module):
    """A word-level language model's shape: embedding, LSTM, decoder (to 4 classes here)."""

    def __init__(self, vocab=50, width=16, classes=4):
        super().__init__()
        self.embed, self.decode = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, classes)
        self.lstm = torch.nn.LSTM(width, width, batch_first=True)

    def forward(self, x):
        return self.decode(self.lstm(self.embed(x))[0]).mean(1)


class _Bag(torch.nn.Module):
    """Embeddings averaged: no operator that autocast computes in lower precision."""

    def __init__(self, vocab=50, classes=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, classes)

    def forward(self, x):
        return self.embed(x).mean(1)


def _advice(model, batch):
    from types import SimpleNamespace

    from saturate.components.model import takes_advice
    from saturate.tasks.classification import Classification

    fp32 = Precision("fp32", "cpu", None, torch.amp.GradScaler("cpu", enabled=False))
    trainer = SimpleNamespace(channels_last=False)
    return takes_advice(model, batch, Classification(4), fp32, image=True, trainer=trainer, device=torch.device("cpu"))


def test_layout_advice_only_for_convolutions_and_precision_advice_only_for_operators_autocast_lowers():
    """(channels_last_ok, amp_ok) from the operators the model runs on two real samples: the
    layout for 2-D convolutions, the precision where autocast computes some operator in bf16.
    An LSTM under CPU autocast runs oneDNN's mkldnn_rnn_layer in bf16 (0.63x the fp32 step of a
    200-wide 2-layer LSTM on an AMX CPU): it may be tried where the CPU has native bf16."""
    images, labels = torch.rand(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    tokens = torch.randint(0, 50, (4, 6))
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(4))
    conv(images)
    mlp = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    assert _advice(conv, (images, labels)) == (True, True)
    assert _advice(mlp, (images, labels)) == (False, True)  # no convolution for the layout to change
    assert _advice(_Recurrent(), (tokens, labels)) == (False, True)
    assert _advice(_Bag(), (tokens, labels)) == (False, False)  # nothing autocast lowers
    # the facts tune's candidates read are the report's
    from saturate.tune.options import candidates

    for model, batch in ((mlp, (images, labels)), (_Bag(), (tokens, labels))):
        layout_ok, amp_ok = _advice(model, batch)
        f = {**facts(device="cpu", image=True, channels_last_ok=layout_ok, amp_ok=amp_ok, cpu_bf16=True).__dict__}
        assert candidates("channels_last", f, allow=[], cuda=False) == []
    bag = {**facts(device="cpu", amp_ok=False, cpu_bf16=True).__dict__}
    assert candidates("precision", bag, allow=["precision"], cuda=False) == []


def test_a_linear_models_real_run_gets_no_layout_advice(tmp_path):
    """The VAE example (linear layers only), trained for enough steps to be judged: its report
    and the facts tune reads."""
    from tests.e2e.test_examples import example_cli

    metrics = example_cli(tmp_path, "vae", "vae", "trainer.limit_train_batches=14")
    assert metrics["verdict"] != "not judged" and metrics["facts"]["channels_last_ok"] is False
    assert "channels_last" not in (tmp_path / "run" / "report.md").read_text()
