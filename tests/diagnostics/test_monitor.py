"""GPU and CPU monitoring, the monitor script, the environment doctor, the fingerprint and
profiling. NVML cannot exist on a CPU machine, so where a GPU is needed a scripted stand-in
for the pynvml module plays one; the logic around it is real."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import saturate
from saturate.diagnostics.monitor import analyse
from tests.conftest import python, read_metrics
from tests.trainer.test_run import events

FAKE_NVML = '''
"""A scripted stand-in for pynvml: two GPUs whose utilisation follows FAKE_NVML_UTIL."""
import os
from types import SimpleNamespace
NVML_TEMPERATURE_GPU, NVML_CLOCK_SM = 0, 1
_calls = {}
def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlSystemGetDriverVersion(): return "550.54.15"
def nvmlDeviceGetCount(): return 2
def nvmlDeviceGetHandleByIndex(i): return int(i)
def nvmlDeviceGetHandleByUUID(u): return int(u.rsplit("-", 1)[1])
def nvmlDeviceGetUtilizationRates(h):
    series = [float(u) for u in os.environ.get("FAKE_NVML_UTIL", "90,95,91,96").split(",")]
    n = _calls[h] = _calls.get(h, -1) + 1
    return SimpleNamespace(gpu=series[n % len(series)] / (1 + h), memory=10)
def nvmlDeviceGetMemoryInfo(h): return SimpleNamespace(used=(3 + h) * 2**30, total=80 * 2**30)
def _refused(name):  # FAKE_NVML_REFUSE=power,clock: NVML's answer on MIG slices and some vGPUs
    if name in os.environ.get("FAKE_NVML_REFUSE", "").split(","):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
def nvmlDeviceGetPowerUsage(h): _refused("power"); return 250_000
def nvmlDeviceGetTemperature(h, kind): _refused("temp"); return 61
def nvmlDeviceGetClockInfo(h, kind): _refused("clock"); return 1980
'''


@pytest.fixture
def fake_nvml(monkeypatch, tmp_path):
    module = types.ModuleType("pynvml")
    exec(FAKE_NVML, module.__dict__)  # noqa: S102 (the test's own stand-in for NVML)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    (tmp_path / "fakenvml").mkdir()
    (tmp_path / "fakenvml" / "pynvml.py").write_text(FAKE_NVML)
    return tmp_path / "fakenvml"


def test_analysis_of_recorded_series():
    stable = analyse([90, 92, 88, 95, 91])
    assert (
        stable.status == "stable"
        and stable.mean == pytest.approx(91.2)
        and stable.minimum == 88
        and stable.under_50 == 0
    )
    fluctuating = analyse([95, 40, 96, 97, 38, 99])
    assert fluctuating.status == "fluctuating" and fluctuating.under_50 == pytest.approx(2 / 6)
    assert analyse([10, 30, 45, 60]).status == "starved"
    assert analyse([86, 86, 100, 60]).status == "fluctuating"  # a high mean with a wide swing is not stable


def test_without_nvml_the_run_says_so_once_and_goes_on(make_cfg, caplog):
    cfg = make_cfg("monitor.interval_s=0.05")
    metrics = saturate.train(cfg)
    # no line in every run's log
    assert not [r for r in caplog.records if r.getMessage().startswith("monitor: no NVML")]
    # said once
    assert "GPU utilisation: not sampled (no NVIDIA GPU or no NVML)" in (Path(cfg.run_dir) / "report.md").read_text()
    assert not any(k.startswith("gpu/") for k in metrics)
    assert metrics["cpu/rss_mb"] > 0  # the CPU is sampled anyway


def test_in_run_sampler_logs_gpu_metrics_and_the_report_summarises_them(make_cfg, fake_nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")  # CUDA's device 0 is the machine's GPU 1
    monkeypatch.setenv("FAKE_NVML_UTIL", "60")  # constant: the summary does not depend on how many samples a run took
    cfg = make_cfg("monitor.interval_s=0.02", "trainer.max_epochs=6", "trainer.limit_train_batches=4")
    metrics = saturate.train(cfg)
    tags = set(events(cfg.run_dir).Tags()["scalars"])
    assert {
        "gpu/util",
        "gpu/mem_used_mb",
        "gpu/power_w",
        "gpu/temp_c",
        "gpu/sm_clock_mhz",
        "gpu1/util",
        "cpu/util",
    } <= tags
    assert metrics["gpu/mem_used_mb"] == pytest.approx(4 * 1024)  # GPU 1 of the machine: (3 + 1) GiB
    assert metrics["gpu/util_mean"] == 30 and metrics["gpu/util_std"] == 0  # 60, halved for the machine's GPU 1
    assert metrics["gpu/util_under_50_frac"] == 1.0 and metrics["gpu/util_min"] == 30
    report = (Path(cfg.run_dir) / "report.md").read_text()
    assert "): mean 30%" in report and "100% of samples under 50%" in report


def test_monitor_script_without_a_gpu_says_so_and_exits_non_zero():
    result = python("-m", "saturate", "monitor-gpu", "--duration", "1")
    assert result.returncode == 2
    assert "monitor_gpu: no NVIDIA GPU to watch" in result.stderr and "Traceback" not in result.stderr


def monitor_script(fake_nvml, out, seconds: float, **fake) -> subprocess.CompletedProcess:
    """saturate monitor-gpu over the fake NVML (`fake`: its FAKE_NVML_* settings), CSV to `out`."""
    env = {**os.environ, "PYTHONPATH": f"{fake_nvml}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.update({f"FAKE_NVML_{k.upper()}": v for k, v in fake.items()})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    args = ["--interval", "0.05", "--duration", str(seconds), "--csv", str(out)]
    command = [sys.executable, "-m", "saturate", "monitor-gpu", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_monitor_script_lines_analysis_and_csv(fake_nvml, tmp_path):
    out = tmp_path / "gpu.csv"
    result = monitor_script(fake_nvml, out, 0.5, util="90,95,91,96")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "  gpu0  util" in line]
    assert len(lines) >= 4 and "power   250 W" in lines[0] and "sm 1,980 MHz" in lines[0]
    assert "stable: mean >= 85% and std <= 10; starved: mean < 50%" in result.stdout
    assert "gpu0:" in result.stdout and "-> stable" in result.stdout
    assert "gpu1:" in result.stdout and "-> starved" in result.stdout  # the second fake GPU runs at half
    rows = list(csv.DictReader(out.open()))
    assert {r["gpu"] for r in rows} == {"0", "1"} and float(rows[0]["util"]) == 90


def test_monitor_script_shows_what_nvml_gives_when_it_refuses_a_field(fake_nvml, tmp_path):
    """A MIG slice refuses power and clocks: the script raised KeyError on its first line."""
    out = tmp_path / "gpu.csv"
    result = monitor_script(fake_nvml, out, 0.3, refuse="power,clock")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    line = next(line for line in result.stdout.splitlines() if "  gpu0  util" in line)
    assert "power     - W" in line and "sm     - MHz" in line and "temp  61 C" in line and "-> stable" in result.stdout
    row = next(csv.DictReader(out.open()))
    assert row["power_w"] == "" and row["temp_c"] == "61.0"


def test_check_env_on_cpu_exits_0_and_reports():
    result = python("-m", "saturate", "check-env", "--device", "cpu", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for line in (
        "[ok] versions",
        "[ok] torch.compile",
        "[ok] mixed precision",
        "[ok] gloo",
        "[ok] dataloader workers",
        "[ok] training step on cpu",
        "a training step works on cpu",
        "suggested settings:",
    ):
        assert line in result.stdout, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_check_env_asked_for_cuda_without_it_fails_clearly():
    result = python("-m", "saturate", "check-env", "--device", "cuda")
    assert result.returncode == 1 and "no CUDA device is visible" in result.stderr and "Traceback" not in result.stderr


def test_the_fingerprint_is_in_metrics_and_tensorboard(make_cfg):
    cfg = make_cfg("trainer.channels_last=true")
    saturate.train(cfg)
    fp = read_metrics(cfg.run_dir)["fingerprint"]
    assert fp["torch"] == str(torch.__version__) and fp["precision"] == "fp32" and fp["channels_last"] is True
    assert fp["world_size"] == 1 and fp["cpu_count"] == os.cpu_count() and fp["device"].startswith("cpu: ")
    assert fp["git_commit"] is None or len(fp["git_commit"].split("-")[0]) == 40
    assert {"driver", "cuda", "tf32", "cudnn_benchmark", "compile"} <= fp.keys() and fp[
        "device_index"
    ] is None  # the GPU's index on CUDA
    assert any("fingerprint" in tag for tag in events(cfg.run_dir).Tags()["tensors"])


def test_profile_records_a_trace_and_the_top_operators(make_cfg, caplog):
    cfg = make_cfg(
        "trainer.profile=true", "trainer.profile_wait=2", "trainer.profile_steps=2", "trainer.limit_train_batches=6"
    )
    saturate.train(cfg)
    folder = Path(cfg.run_dir) / "profile"
    (trace,) = folder.glob("trace_step*.json")
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert "aten::convolution_backward" in names and any(str(n).startswith("ProfilerStep#") for n in names)
    assert "Self CPU" in (folder / "top_ops.txt").read_text()
    assert any("top operators by self time" in r.getMessage() for r in caplog.records)


def test_a_gpu_that_refuses_some_fields_never_stops_the_run(make_cfg, fake_nvml, monkeypatch):
    """GPU 0 as a MIG instance on a vGPU: no utilisation query of its own (its parent, GPU 1,
    answers), no power or clock readings; and a listing that fails is CPU-only sampling."""
    module = sys.modules["pynvml"]

    def refuse(*args):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    real_util = module.nvmlDeviceGetUtilizationRates
    monkeypatch.setattr(module, "nvmlDeviceGetUtilizationRates", lambda h: refuse() if h == 0 else real_util(h))
    monkeypatch.setattr(module, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", lambda h: 1, raising=False)
    monkeypatch.setattr(module, "nvmlDeviceGetPowerUsage", refuse)
    monkeypatch.setattr(module, "nvmlDeviceGetClockInfo", refuse)
    monkeypatch.setenv("FAKE_NVML_UTIL", "80")
    cfg = make_cfg("monitor.interval_s=0.02", "trainer.max_epochs=3")
    metrics = saturate.train(cfg)
    assert metrics["gpu/util"] == 40 and metrics["gpu/util_mean"] == 40  # the parent GPU 1's figure (80 / 2)
    assert (
        metrics["gpu/mem_used_mb"] == pytest.approx(3 * 1024)
        and "gpu/power_w" not in metrics
        and "gpu/sm_clock_mhz" not in metrics
    )

    monkeypatch.setattr(module, "nvmlDeviceGetCount", refuse)  # the driver fails when asked for the GPUs
    metrics = saturate.train(make_cfg("monitor.interval_s=0.02"))
    assert metrics["progress/step"] == 3 and not any(k.startswith("gpu") for k in metrics) and metrics["cpu/rss_mb"] > 0


def test_gpus_are_matched_to_nvml_by_uuid_not_position(monkeypatch):
    """CUDA numbers GPUs fastest first, NVML by PCI bus: on a machine with an H100 on bus 1
    and an A10 on bus 0, cuda:0 is the H100 and NVML's index 0 the A10."""
    from saturate.diagnostics.monitor import cuda_uuids, visible_nvml_handles

    nvml_order = ["GPU-aaaa-a10", "GPU-bbbb-h100"]  # by PCI bus
    nvml = SimpleNamespace(
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: nvml_order[i],
        nvmlDeviceGetHandleByUUID=lambda u: nvml_order[nvml_order.index(u)],
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda_order = ["bbbb-h100", "aaaa-a10"]  # fastest first, as torch reports them (no prefix)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=cuda_order[i]))
    assert cuda_uuids() == ["GPU-bbbb-h100", "GPU-aaaa-a10"]
    assert visible_nvml_handles(nvml, cuda_uuids()) == [(0, "GPU-bbbb-h100"), (1, "GPU-aaaa-a10")]
    # by position: the old, wrong answer
    assert visible_nvml_handles(nvml, []) == [
        (0, "GPU-aaaa-a10"),
        (1, "GPU-bbbb-h100"),
    ]

    def unknown(u):
        raise RuntimeError("NVML_ERROR_NOT_FOUND")

    # NVML does not know the UUIDs (some MIG set-ups): by position, not nothing
    nvml.nvmlDeviceGetHandleByUUID = unknown
    assert visible_nvml_handles(nvml, cuda_uuids()) == [(0, "GPU-aaaa-a10"), (1, "GPU-bbbb-h100")]
