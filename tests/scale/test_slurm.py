"""SLURM through hydra/launcher=slurm. Without a cluster: the job's side (its threads, its
resume command, submitit's signal) and the launcher's checks. With one (slow): a real
one-node cluster on localhost (scripts/local_slurm.py) runs sweeps of 2-task jobs that
are requeued, time out and are cancelled."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from saturate.components.device import setup_device
from saturate.config.invocation import SCRIPT, from_hydra
from saturate.config.schema import DeviceConfig
from saturate.scale.launch import resume_hint
from scripts.local_slurm import PARTITION, SlurmCluster
from tests.checkpoint.test_resume import final_weights
from tests.conftest import CONF, ROOT, read_metrics, run_cli


@pytest.fixture
def threads():
    """torch's intra-op thread count, put back after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_slurm_task_trains_with_the_cpus_slurm_gave_it(monkeypatch, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    torch.set_num_threads(2)
    setup_device(DeviceConfig(type="cpu"))
    assert torch.get_num_threads() == 1


def test_omp_num_threads_wins_over_slurms_cpus(monkeypatch, threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    torch.set_num_threads(2)
    setup_device(DeviceConfig(type="cpu"))
    assert torch.get_num_threads() == 2


@pytest.fixture
def in_a_slurm_job(monkeypatch, tmp_path):
    """Hydra's runtime config and the environment as a job of `python train.py -m
    hydra/launcher=slurm ...` has them (submitit's entry point as the script run)."""
    before = HydraConfig.instance().cfg

    def job(hydra_overrides: list[str], overrides: list[str]):
        with initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[*hydra_overrides, *overrides], return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.mode = "MULTIRUN"
            cfg.hydra.overrides.hydra = [*hydra_overrides, "hydra.mode=MULTIRUN"]
            cfg.hydra.overrides.task = overrides
        HydraConfig.instance().set_config(cfg)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["/venv/lib/python3.11/site-packages/submitit/core/_submit.py", "/x/.submitit"])
    monkeypatch.setenv(SCRIPT, str(tmp_path / "train.py"))  # what train.py's command exported for its jobs
    yield job
    HydraConfig.instance().cfg = before


def test_a_slurm_jobs_resume_command_submits_it_again_into_its_own_run_dir(in_a_slurm_job, tmp_path):
    launcher = ["hydra/launcher=slurm", "hydra.launcher.partition=debug", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    in_a_slurm_job(launcher, ["loader.batch_size=64", "trainer.resume=auto"])
    invocation = from_hydra()
    assert invocation.launcher == "slurm" and invocation.app == str(tmp_path / "train.py")
    hint = resume_hint(str(tmp_path / "sweep" / "1_bs64"), world_size=2, invocation=invocation)
    assert hint == (
        "python train.py -m hydra/launcher=slurm hydra.launcher.partition=debug loader.batch_size=64 "
        f"hydra.sweep.dir={tmp_path / 'sweep'} hydra.sweep.subdir=1_bs64 trainer.resume=auto"
    )


def test_a_launcher_without_multirun_is_one_line_naming_the_fix(tmp_path):
    result = run_cli("hydra/launcher=slurm", "trainer.max_epochs=1", cwd=tmp_path, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: hydra/launcher=slurm: Hydra starts a launcher's jobs in a multirun only; add -m (python train.py -m "
        "hydra/launcher=slurm ...: one job, or one per swept value)"
    )
    assert not list(tmp_path.glob("outputs/runs/*/*/checkpoints"))  # nothing trained here


def test_a_signal_delay_that_leaves_no_time_to_train_is_refused_before_anything_is_submitted(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    args = ["hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=60", "trainer.resume=auto"]
    result = run_cli("-m", "hydra/launcher=slurm", *args, cwd=tmp_path, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: hydra.launcher.signal_delay_s=60: expected less than timeout_min x 60 - 60 = 60 s (SLURM may send the "
        "signal up to 60 s early: every attempt would be signalled before it trains); lower it, or raise "
        "hydra.launcher.timeout_min"
    )


# --- on a local SLURM cluster -------------------------------------------------------------------------------------
# Every job: 2 tasks of 1 CPU, so 2 gloo ranks; with 2 CPUs the jobs of a sweep run one after the other. Group norm
# and deterministic kernels: an interrupted and resumed job ends with the uninterrupted job's weights, bit for bit.
LAUNCH = [
    "hydra/launcher=slurm",
    f"hydra.launcher.partition={PARTITION}",
    "hydra.launcher.gpus_per_node=0",
    "hydra.launcher.tasks_per_node=2",
    "hydra.launcher.cpus_per_task=1",
]
SAME = [
    "device=cpu",
    "model.norm=group",
    "trainer.deterministic=true",
    "trainer.progress=false",
    "trainer.log_interval=5",
    "trainer.max_epochs=20",  # about 10 s of training on 2 idle cores: time to interrupt it after the first epoch
    "trainer.checkpoint_interval=1",  # last.pt at every epoch's end: the tests interrupt a job once it has one
    "loader.batch_size=32",
    "trainer.resume=auto",
]


def sweep(cluster: SlurmCluster, cwd: Path, *overrides: str) -> subprocess.Popen:
    """`python train.py -m` with the SLURM launcher, run from `cwd` into `cwd/sweep`; its output in cwd/sweep.out
    and cwd/sweep.err."""
    command = [sys.executable, str(ROOT / "train.py"), "-m", *LAUNCH, *SAME, f"hydra.sweep.dir={cwd / 'sweep'}"]
    with open(cwd / "sweep.out", "w") as out, open(cwd / "sweep.err", "w") as err:
        return subprocess.Popen([*command, *overrides], cwd=cwd, env=cluster.env, stdout=out, stderr=err)


def finish(proc: subprocess.Popen, cwd: Path, timeout: float = 900) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the sweep did not return in {timeout:.0f} s:\n{output(cwd)[-3000:]}\n{job_logs(cwd)[-3000:]}")


def output(cwd: Path) -> str:
    return (cwd / "sweep.out").read_text() + (cwd / "sweep.err").read_text()


def job_logs(cwd: Path) -> str:
    """What every task of every job of the sweep printed (submitit's logs), in order."""
    return "\n".join(p.read_text(errors="replace") for p in sorted((cwd / "sweep" / ".submitit").glob("*/*_log.*")))


def runs(cwd: Path) -> list[Path]:
    return sorted((p.parent for p in (cwd / "sweep").glob("*/metrics.json")), key=lambda run: run.name)


def running_job_after_first_save(cluster: SlurmCluster, proc: subprocess.Popen, cwd: Path) -> str:
    """The job's id (`<array>_<task>` in a sweep), once its run saved last.pt (the first epoch's): interrupted now."""
    deadline = time.monotonic() + 600
    while not list((cwd / "sweep").glob("*/checkpoints/last.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, output(cwd)[-3000:] + job_logs(cwd)[-3000:]
        time.sleep(0.2)
    (job,) = [j for j in cluster.jobs() if j["JobState"] == "RUNNING"]
    return f"{job['ArrayJobId']}_{job['ArrayTaskId']}" if "ArrayJobId" in job else job["JobId"]  # a sweep's: an array


@pytest.fixture(scope="module")
def two_jobs(slurm_cluster, tmp_path_factory) -> Path:
    """A sweep of 2 jobs, loader.batch_size=32,64, uninterrupted: its folder. Job 0 is what the interrupted jobs
    below must end as."""
    cwd = tmp_path_factory.mktemp("two_jobs")
    proc = sweep(slurm_cluster, cwd, "loader.batch_size=32,64")
    assert finish(proc, cwd) == 0, output(cwd)[-3000:] + job_logs(cwd)[-3000:]
    return cwd


@pytest.mark.slow
def test_a_sweep_of_two_jobs_trains_each_with_two_ranks_in_its_own_run_dir(two_jobs):
    both = runs(two_jobs)
    assert [run.name for run in both] == ["0", "1"]
    for run, batch_size in zip(both, (32, 64), strict=True):
        m = read_metrics(run)
        assert (m["status"], m["world_size"], m["batch_size"]) == ("completed", 2, batch_size)
        assert m["distributed/params_identical"] == 1.0 and (run / "train.rank1.log").exists()
        assert "device: cpu (1 threads)" in (run / "train.log").read_text()  # hydra.launcher.cpus_per_task=1
    said = output(two_jobs)
    assert said.count("SLURM accounting is off here (sacct: Slurm accounting storage is disabled)") == 1
    assert "Bypassing sacct error" not in said and "Traceback" not in said


@pytest.mark.slow
def test_scontrol_requeue_resumes_to_the_same_weights(slurm_cluster, two_jobs, tmp_path):
    proc = sweep(slurm_cluster, tmp_path)  # no swept value: one job
    job = running_job_after_first_save(slurm_cluster, proc, tmp_path)
    slurm_cluster.requeue(job)
    slurm_cluster.wait_state(job, {"PENDING"}, timeout=120)
    assert finish(proc, tmp_path) == 0, output(tmp_path)[-3000:]  # the sweep waited for the requeued job
    logs = job_logs(tmp_path)
    assert "SIGTERM at step" in logs and "resumed from" in logs
    (run,) = runs(tmp_path)
    (reference, _) = runs(two_jobs)
    assert read_metrics(run)["status"] == "completed"
    assert read_metrics(run)["progress/step"] == read_metrics(reference)["progress/step"]
    ours, theirs = final_weights(run), final_weights(reference)
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)


@pytest.mark.slow
def test_a_job_at_its_time_limit_is_requeued_by_submitit_and_resumes(slurm_cluster, two_jobs, tmp_path):
    # SIGUSR2 comes 60-90 s after each attempt starts (slurmctld checks every 30 s). 800 epochs outlast that on any
    # machine this runs on: 200 took 69 s on CI's (job start to exit) and 100 s on 2 idle cores here, and a job that
    # ends before its first signal fails this test. A loaded machine needs more attempts than the preset's 3.
    limit = ["hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=30", "hydra.launcher.max_num_timeout=20"]
    limit += ["trainer.max_epochs=800"]
    proc = sweep(slurm_cluster, tmp_path, *limit)
    assert finish(proc, tmp_path, timeout=2400) == 0, output(tmp_path)[-3000:] + job_logs(tmp_path)[-3000:]
    logs = job_logs(tmp_path)
    assert "SIGUSR2 at step" in logs and "Requeued job" in logs and "resumed from" in logs
    (run,) = runs(tmp_path)
    (reference, _) = runs(two_jobs)
    assert read_metrics(run)["status"] == "completed"
    assert read_metrics(run)["progress/step"] == 40 * read_metrics(reference)["progress/step"]  # 800 epochs, not 20


@pytest.mark.slow
def test_scancel_leaves_last_pt_a_preempted_status_and_a_resume_command_that_finishes_the_job(
    slurm_cluster, two_jobs, tmp_path
):
    proc = sweep(slurm_cluster, tmp_path)
    job = running_job_after_first_save(slurm_cluster, proc, tmp_path)
    slurm_cluster.cancel(job)
    assert finish(proc, tmp_path) == 1
    (run,) = runs(tmp_path)
    record = read_metrics(run)
    assert (record["status"], record["stopped_by"]) == ("preempted", "SIGTERM")
    assert (run / "checkpoints" / "last.pt").exists()
    printed = job_logs(tmp_path).split("resume with: ", 1)[1].splitlines()[0]  # as the job printed it
    assert printed == record["resume_with"]
    assert (tmp_path / "sweep.err").read_text().strip() == (
        f"error: hydra/launcher=slurm: SLURM job(s) ended without a result: {job} cancelled\n"
        f"  {run}: stopped by SIGTERM with last.pt saved; resume with: {printed}"
    )
    path = f"{Path(sys.executable).parent}{os.pathsep}{slurm_cluster.env['PATH']}"
    resumed = subprocess.run(
        printed, shell=True, cwd=tmp_path, env={**slurm_cluster.env, "PATH": path}, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints'}" in job_logs(tmp_path)
    (reference, _) = runs(two_jobs)
    assert read_metrics(run)["status"] == "completed"
    ours, theirs = final_weights(run), final_weights(reference)
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)


@pytest.mark.slow
def test_a_job_sbatch_refuses_is_one_message_with_sbatchs_reason(slurm_cluster, tmp_path):
    proc = sweep(slurm_cluster, tmp_path, "hydra.launcher.mem_gb=100000")  # more than the node has
    assert finish(proc, tmp_path, timeout=120) == 1
    (line,) = (tmp_path / "sweep.err").read_text().strip().splitlines()
    assert line.startswith(
        "error: hydra/launcher=slurm: sbatch refused the job (Memory specification can not be satisfied; Batch job "
        "submission failed: Requested node configuration is not available); hydra.launcher asks for partition=debug"
    )
