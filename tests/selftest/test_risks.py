"""The self-test's CUDA risks decide from the figures their checks record: each decision held
to a passing and a failing input here, where no GPU can record them (saturate.selftest.risks)."""

from __future__ import annotations

import json

from saturate.selftest import risks
from tests.conftest import ROOT, python


def test_kernels_per_step_counts_the_traces_kernels_only():
    trace = {
        "traceEvents": [
            {"cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel"},
            {"cat": "kernel", "name": "sm90_xmma_gemm"},
            {"cat": "cuda_runtime", "name": "cudaLaunchKernel"},
            {"cat": "cpu_op", "name": "aten::where"},
            {"cat": "kernel", "name": "multi_tensor_apply_kernel"},
        ]
    }
    assert risks.kernels_per_step(trace, steps=3) == 1.0


def test_the_guard_passes_a_handful_of_launches_and_fails_one_per_buffer():
    ok, line = risks.guard_launches(guarded=612, unguarded=590)
    assert ok and "adds 22 kernel launches" in line
    ok, line = risks.guard_launches(guarded=770, unguarded=590)  # a where and a copy per BatchNorm buffer
    assert not ok and "adds 180 kernel launches" in line


def test_augmentation_passes_without_syncs_and_fails_with_one_per_batch():
    ok, line = risks.augmentation_syncs({"presets": 0, "transforms": 0}, batches=20, kornia="0.9.0")
    assert ok and "no host synchronisation" in line
    ok, line = risks.augmentation_syncs({"presets": 60, "transforms": 0}, batches=20, kornia="0.7.0")
    assert not ok and "kornia 0.7.0 synchronises" in line and "presets 3" in line


def test_cudnn_autotuning_passes_only_on_for_fixed_and_off_for_varying_shapes():
    assert risks.cudnn_follows_shapes(fixed=True, varying=False)[0]
    assert not risks.cudnn_follows_shapes(fixed=True, varying=True)[0]
    assert not risks.cudnn_follows_shapes(fixed=False, varying=False)[0]


def test_the_ddp_agreement_passes_a_busy_gpu_and_fails_one_idle_on_the_host():
    assert risks.agreement_idle(0.01, world=2)[0]
    ok, line = risks.agreement_idle(0.18, world=2)
    assert not ok and "idled 18.0% of step time" in line


def test_nvml_uuids_pass_when_accepted_and_name_a_mig_instance_when_refused():
    uuids = ["GPU-4c1c2a1e-0000-1111-2222-333344445555"]
    assert risks.nvml_uuids(uuids, refused=[])[0]
    ok, line = risks.nvml_uuids(uuids, refused=uuids)
    assert not ok and "MIG" in line and "falls back to device positions" in line


def test_the_augmentation_probe_runs_and_writes_its_figures_on_the_cpu(tmp_path):
    """Its counts mean something on a GPU only; here its command and figures are checked."""
    out = tmp_path / "syncs.json"
    done = python(ROOT / "scripts" / "probe_syncs.py", "--batches", "2", "--batch", "4", "--json", out, timeout=120)
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert set(figures["syncs"]) == {"presets", "transforms"} and figures["batches"] == 2
    assert risks.augmentation_syncs(figures["syncs"], figures["batches"], figures["kornia"])[0]
