"""DDP for real: `torchrun` processes talking gloo on the CPU. One run directory, identical
parameters on every rank, the single-process result at the same global batch, resume after
a SIGTERM, out-of-memory and non-finite decisions agreed across ranks, multirun under
torchrun, and the SLURM wiring."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

import saturate
from tests.checkpoint.test_resume import final_weights, step_losses
from tests.conftest import CONF, ROOT, run_cli

pytestmark = pytest.mark.slow

TORCHRUN = shutil.which("torchrun") or "torchrun"
# group norm: per-sample statistics, so 2 x 32 on two ranks is the same computation as 64 on one
SAME = [
    "device=cpu",
    "model.norm=group",
    "trainer.deterministic=true",
    "trainer.max_epochs=2",
    "trainer.progress=false",
    "trainer.log_interval=5",
]


def torchrun(
    *args: str, cwd: Path, script: str | Path = ROOT / "train.py", env: dict | None = None, timeout: float = 300
):
    return subprocess.run(
        [TORCHRUN, "--nproc_per_node=2", str(script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    """An uninterrupted 2-process run, batch 32 per rank."""
    cwd = tmp_path_factory.mktemp("ddp")
    result = torchrun(*SAME, "loader.batch_size=32", f"hydra.run.dir={cwd / 'run'}", cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return cwd / "run"


def test_two_processes_one_run_dir_identical_ranks_and_the_single_process_result(ddp_run, make_cfg):
    outputs = [p for p in ddp_run.parent.rglob("metrics.json")]
    assert outputs == [ddp_run / "metrics.json"]  # exactly one run dir and one metrics.json
    assert len(list(ddp_run.glob("events.out.tfevents.*"))) == 1  # rank 0's TensorBoard events
    assert sorted(p.name for p in ddp_run.iterdir() if not p.name.startswith("events.out.tfevents.")) == [
        ".hydra",
        ".lock",  # rank 0 holds the run dir (saturate.checkpoint.rundir)
        "checkpoints",
        "metrics.json",
        "report.md",
        "train.log",
        "train.rank1.log",
    ]
    metrics = json.loads((ddp_run / "metrics.json").read_text())
    assert (
        metrics["world_size"] == 2 and metrics["distributed/params_identical"] == 1.0 and metrics["progress/step"] == 44
    )

    single = make_cfg(*SAME, "loader.batch_size=64", tiny=False)
    alone = saturate.train(single)
    # the float sums run in another order (each rank's half, averaged by gloo): after 44 steps a few weights drift,
    # as far as the same single-process run drifts between 1 and 2 threads (up to 0.0037, on 24 of one conv's 9,216)
    for key, value in final_weights(single.run_dir).items():
        torch.testing.assert_close(final_weights(ddp_run)[key], value, rtol=1e-3, atol=1e-2)
    assert metrics["val/acc"] == pytest.approx(alone["val/acc"], abs=0.01)
    assert metrics["val/loss"] == pytest.approx(alone["val/loss"], rel=1e-3)


def test_two_processes_stop_on_sigterm_and_resume_to_the_same_weights(ddp_run, tmp_path):
    run_dir = tmp_path / "run"
    command = [
        TORCHRUN,
        "--nproc_per_node=2",
        str(ROOT / "train.py"),
        *SAME,
        "loader.batch_size=32",
        "trainer.checkpoint_interval=1",  # its first save: training is under way
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "last.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    # to torchrun and both ranks at once, as SLURM signals a job step's processes: torchrun's
    # own forwarding took 0.5 s on a loaded machine, longer than the second epoch (0.4 s)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert "SIGTERM at step" in out, out[-3000:]
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "preempted"
    stopped = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["step"]
    assert stopped % 5 == 0 and 22 <= stopped < 44  # ranks agree to stop at a log step

    resumed = torchrun(*SAME, "loader.batch_size=32", f"hydra.run.dir={run_dir}", "trainer.resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads((run_dir / "metrics.json").read_text())["distributed/params_identical"] == 1.0
    assert step_losses(run_dir) == step_losses(ddp_run)
    for key, value in final_weights(ddp_run).items():
        assert torch.equal(final_weights(run_dir)[key], value), key


FAULTS_ON_RANK_1 = """
import os, runpy, sys, torch
import saturate.tasks.classification
from saturate.models import SmallCNN

calls = {"forward": 0, "loss": 0}
original_forward, original_loss = SmallCNN.forward, saturate.tasks.classification.F.cross_entropy

def forward(self, x):
    if self.training and os.environ["RANK"] == "1":
        calls["forward"] += 1
        if calls["forward"] == 3:  # rank 1 alone runs out of memory in step 3
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected on rank 1)")
    return original_forward(self, x)

def cross_entropy(logits, y, *args, **kwargs):
    loss = original_loss(logits, y, *args, **kwargs)
    if logits.requires_grad and os.environ["RANK"] == "1":
        calls["loss"] += 1
        if calls["loss"] == 8:  # and its loss alone is NaN once, later: its gradients stay finite, so only
            return loss + torch.full_like(loss, float("nan")).detach()  # agreement makes rank 0 skip too
    return loss

SmallCNN.forward = forward
saturate.tasks.classification.F.cross_entropy = cross_entropy
sys.argv = [sys.argv[0], *sys.argv[1:]]
runpy.run_path(os.environ["TRAIN_PY"], run_name="__main__")
"""


def faults_on_rank_1(tmp_path, *overrides):
    script = tmp_path / "faults_on_rank_1.py"
    script.write_text(FAULTS_ON_RANK_1)
    args = [
        *SAME,
        "trainer.max_epochs=1",
        "trainer.log_interval=1",
        "loader.batch_size=32",
        "monitor.costs=false",  # the faults count training-mode forwards; the start-up cost count would take the first
        f"hydra.run.dir={tmp_path / 'run'}",
        *overrides,
    ]
    return torchrun(*args, cwd=tmp_path, script=script, env={"TRAIN_PY": str(ROOT / "train.py")}, timeout=120)


@pytest.mark.parametrize("fused", ["true", "false"], ids=["skip-decided-on-the-device", "skip-read-per-step"])
def test_out_of_memory_and_non_finite_decisions_are_agreed_across_ranks(tmp_path, fused):
    result = faults_on_rank_1(tmp_path, "trainer.accumulate=2", f"optim.optimizer.fused={fused}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["distributed/params_identical"] == 1.0  # nobody stepped alone, nobody waited forever
    assert metrics["train/micro_batches"] == 4  # rank 0 split its batches too, when rank 1 ran out of memory
    assert metrics["train/nonfinite_steps"] == 1 and metrics["progress/step"] == 22


def test_out_of_memory_in_the_synchronising_micro_batch_stops_every_rank_together(tmp_path):
    start = time.monotonic()
    result = faults_on_rank_1(tmp_path)  # one micro-batch: the synchronising one fails on rank 1
    assert result.returncode != 0 and time.monotonic() - start < 100  # no rank waits for the others
    out = result.stdout + result.stderr
    assert out.count("out of memory in the last micro-batch's forward pass under DDP") == 2, out[-3000:]


def test_multirun_under_torchrun_runs_each_job_on_both_ranks(tmp_path):
    result = torchrun("-m", "loader.batch_size=32,64", *SAME, "trainer.max_epochs=1", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")  # one sweep dir, shared by the ranks
    for job, batch in (("0_batch_size-32", 32), ("1_batch_size-64", 64)):
        metrics = json.loads((sweep / job / "metrics.json").read_text())
        assert (
            metrics["world_size"] == 2
            and metrics["batch_size"] == batch
            and metrics["distributed/params_identical"] == 1.0
        )


def test_sync_batchnorm_on_cpu_ranks_is_a_clean_error(tmp_path):
    result = torchrun("trainer.sync_batchnorm=true", "trainer.max_epochs=1", cwd=tmp_path)
    assert result.returncode != 0
    assert "trainer.sync_batchnorm=true: SyncBatchNorm works only on CUDA devices" in result.stderr + result.stdout


@pytest.mark.parametrize(("procid", "localid", "rank", "local"), [("0", "0", "0", "0"), ("3", "1", "3", "1")])
def test_slurm_tasks_become_torchrun_ranks(procid, localid, rank, local):
    pytest.importorskip("submitit")
    from saturate.scale import distributed

    slurm = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": procid,
        "SLURM_LOCALID": localid,
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    torch_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    with mock.patch.dict(os.environ, slurm):  # the whole environment is put back afterwards
        for key in torch_vars:
            os.environ.pop(key, None)
        assert distributed.world_size() == 4
        assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == (rank, local, "2")
        assert os.environ["MASTER_ADDR"] == "gpu07" and 20000 <= int(os.environ["MASTER_PORT"]) <= 60000
    assert not any(key in os.environ for key in torch_vars)


def test_slurm_launcher_preset_wires_one_task_per_gpu():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "config", overrides=["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4"], return_hydra_config=True
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.saturate_slurm_launcher.slurm_launcher.SlurmLauncher"
    assert launcher.mem_gb is None and launcher.signal_delay_s < launcher.timeout_min * 60 - 60
    assert launcher.tasks_per_node == 4 and launcher.max_num_timeout == 3


def test_a_single_process_needs_no_process_group():
    from saturate.scale.distributed import Dist

    d = Dist()
    assert (d.world_size, d.rank, d.is_main) == (1, 0, True) and not torch.distributed.is_initialized()
    assert d.agree(False) is False and d.mean({"a": 2.0}) == {"a": 2.0}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


@pytest.mark.slow
def test_trainer_devices_2_on_cpu_trains_in_two_processes_and_one_run_dir(tmp_path):
    from tests.conftest import run_cli

    result = run_cli(
        "device=cpu",
        "trainer.devices=2",
        "model.norm=group",
        "trainer.max_epochs=1",
        "trainer.progress=false",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "trainer.devices=2: 2 processes (gloo on the CPU) through torch's elastic launcher"
        in result.stderr + result.stdout
    )
    (metrics_file,) = (tmp_path / "outputs" / "runs").glob("*/*/metrics.json")
    metrics = json.loads(metrics_file.read_text())
    assert (
        metrics["world_size"] == 2
        and metrics["distributed/params_identical"] == 1.0
        and metrics["status"] == "completed"
    )


@pytest.mark.slow
def test_a_mistake_under_trainer_devices_is_one_line_per_process(tmp_path):
    from tests.conftest import run_cli

    result = run_cli("device=cpu", "trainer.devices=2", "loader.batch_size=5000", cwd=tmp_path)
    out = result.stderr + result.stdout
    assert result.returncode == 1 and "Traceback" not in out
    # each process says it once; the launcher stops the other when the first exits, which may be before it has said it
    assert out.count("error: loader.batch_size=5000: larger than the training set (1437 samples across 2 ranks)") in (
        1,
        2,
    )
    assert "error: trainer.devices=2: rank " in out and "failed first (exit status 1); its message is above" in out


def _syncbn_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from saturate.models import SmallCNN
    from saturate.scale.distributed import Dist, alone

    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    d = Dist()
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(SmallCNN(in_channels=1, num_classes=10, width=4)).train()
    layers = [m for m in model.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    result = {}
    # SyncBatchNorm's forward skips its collective when its group has one rank (on a GPU; the CPU it refuses)
    with alone(model, d):
        result["alone"] = all(m.process_group is not None and dist.get_world_size(m.process_group) == 1 for m in layers)
        result["own"] = all(dist.get_process_group_ranks(m.process_group) == [rank] for m in layers)
    result["restored"] = all(m.process_group is None for m in layers) and len(layers) > 0
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_syncbatchnorm_layers_search_alone_under_ddp(tmp_path):
    """The batch-size search's trials differ between ranks; SyncBatchNorm layers must not
    wait on each other during them (a deadlock on GPUs)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_syncbn_rank, args=(port, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == {"alone": True, "own": True, "restored": True}


def test_files_skipped_on_another_rank_are_counted_in_the_run(tmp_path):
    """Validation is sharded (rank r reads every other image from r), so both broken files of
    this validation folder are met by rank 1 only; rank 0's metrics count them through the
    folder's shared skip log."""
    from tests.data.test_image_folder import photo

    for part, names in (("train", [f"{i}.jpg" for i in range(6)]), ("val", ["0.jpg", "1.jpg"])):
        for label in ("a", "b"):
            (tmp_path / "imgs" / part / label).mkdir(parents=True)
            for i, name in enumerate(names):
                photo(seed=i + 10 * len(part)).save(tmp_path / "imgs" / part / label / name)
    for label in ("a", "b"):  # val order: a/0 a/1 b/0 b/1; rank 1 reads positions 1 and 3
        (tmp_path / "imgs" / "val" / label / "1.jpg").write_bytes(os.urandom(600))
    result = torchrun(
        "device=cpu",
        "data=image_folder",
        f"data.root={tmp_path / 'imgs'}",
        "data.image_size=16",
        "model.width=8",
        "loader.batch_size=2",
        "loader.num_workers=1",
        "trainer.max_epochs=1",
        "trainer.progress=false",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["data/skipped_files"] == 2
    output = result.stdout + result.stderr
    assert "val/a/1.jpg: not a readable image" in output and "val/b/1.jpg: not a readable image" in output


def test_sigterm_to_the_trainer_devices_launcher_saves_and_exits_143(tmp_path):
    """`kill <pid>` of `python train.py trainer.devices=2`, as a user or a scheduler would:
    torch's agent passes the signal to the ranks, which save at a step boundary; the launcher
    exits 143 without a traceback."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "device=cpu",
        "trainer.devices=2",
        "trainer.max_epochs=400",
        "trainer.progress=false",
        "trainer.checkpoint_interval=1",  # its first save: training is under way
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "last.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to the launcher alone
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-3000:]
    assert "Traceback" not in out and "SIGTERM at step" in out and "trainer.devices=2: SIGTERM" in out
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "preempted"


RANK_1_BREAKS = """
import os
from saturate.models import SmallCNN

class Breaks(SmallCNN):
    calls = 0

    def forward(self, x):
        if self.training and os.environ["RANK"] == "1":
            Breaks.calls += 1
            if Breaks.calls == 3:
                raise RuntimeError("the user's model broke on rank 1")
        return super().forward(x)
"""


def test_when_one_rank_fails_the_others_say_one_line_and_the_launcher_names_its_log(tmp_path):
    (tmp_path / "userpkg.py").write_text(RANK_1_BREAKS)
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "breaks.yaml").write_text("_target_: userpkg.Breaks\nwidth: 8\n")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
            "model=breaks",
            "device=cpu",
            "trainer.devices=2",
            "trainer.progress=false",
            "monitor.costs=false",
            "hydra.run.dir=run",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    # the failing rank's own error, with its traceback (a bug)
    assert "RuntimeError: the user's model broke on rank 1" in out
    assert "rank 0: stopped because another rank failed (a collective broke off: Connection closed by peer)" in out
    assert "[rank0]: Traceback" not in out and "[rank0]:" not in out  # gloo's 54 lines are gone
    log = tmp_path / "run" / "train.rank1.log"
    assert (
        f"error: trainer.devices=2: rank 1 failed first (exit status 1); its message is above, its log is {log}" in out
    )


def test_dict_batches_with_a_padding_collate_train_under_ddp_and_resume_bit_exactly_mid_epoch(tmp_path):
    """The sign example (dict samples of variable length, pad_collate, CTC) in two gloo
    processes: interrupted in the middle of its second epoch by a signal to both ranks, then
    resumed, it ends as the uninterrupted two-process run, bit for bit."""
    from tests.checkpoint.test_resume import signal_at

    conf = ROOT / "examples" / "sign" / "conf"
    args = [
        f"hydra.searchpath=[file://{conf}]",
        "experiment=sign",
        "device=cpu",
        "trainer.devices=2",
        "trainer.deterministic=true",
        "data.train=256",
        "data.val=64",
        "data.test=64",
        "loader.batch_size=16",
        "trainer.max_epochs=2",
        "trainer.log_interval=1",
        "trainer.progress=false",
    ]
    env = {"PYTHONPATH": str(ROOT)}
    full = run_cli(*args, f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path, env=env)
    assert full.returncode == 0, full.stderr[-3000:]
    stopped = run_cli(*args, *signal_at(12), f"hydra.run.dir={tmp_path / 'resumed'}", cwd=tmp_path, env=env)
    assert stopped.returncode == 128 + signal.SIGUSR1, stopped.stderr[-3000:]
    # 8 steps per epoch
    assert torch.load(tmp_path / "resumed" / "checkpoints" / "last.pt", weights_only=False)["step"] == 12
    resumed = run_cli(*args, "trainer.resume=auto", f"hydra.run.dir={tmp_path / 'resumed'}", cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["distributed/params_identical"] == 1.0 and "test/ter" in metrics
    assert (
        step_losses(tmp_path / "resumed") == step_losses(tmp_path / "full")
        and len(step_losses(tmp_path / "full")) == 16
    )
    for key, value in final_weights(tmp_path / "full").items():
        assert torch.equal(final_weights(tmp_path / "resumed")[key], value), key
