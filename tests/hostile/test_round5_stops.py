"""Stops that always stop, loads that cannot block, and several processes started by hand:
a file that is not a regular one is refused at once, a checkpoint that holds no state dict is
one line, a stop signal before the loop ends the process at once with one line, a rank
waiting for peers says whom it waits for and gives up in time, and a bad rank variable is one
line naming it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from saturate.checkpoint.files import load
from saturate.components.model import load_pretrained, load_weights
from saturate.errors import CheckpointError, ConfigError, UserError
from saturate.files import NotAFile
from tests.conftest import ROOT, TINY, python, run_cli
from tests.hostile.test_round5_writes import one_line_refusal


def _pretrained(path) -> SimpleNamespace:
    return SimpleNamespace(path=str(path), rename=None, strict=True, freeze=[])


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "fifo.pt"
    os.mkfifo(path)
    return path


FIFO_LOADS = """
import sys
from types import SimpleNamespace
from torch import nn
from saturate.checkpoint.files import load
from saturate.components.model import load_pretrained
from saturate.files import NotAFile
for what, read in (
    ("trainer.resume", lambda: load(sys.argv[1])),
    ("pretrained.path", lambda: load_pretrained(nn.Linear(2, 2), SimpleNamespace(path=sys.argv[1], rename=None))),
):
    try:
        read()
    except NotAFile as e:
        print(e)
"""


def test_a_fifo_named_as_a_checkpoint_or_pretrained_weights_is_refused_without_waiting_for_a_writer(fifo, tmp_path):
    """Read in a process of its own: one that waited for a writer would run into the timeout."""
    done = python("-c", FIFO_LOADS, fifo, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        f"{what}={fifo}: expected a regular file; this is a FIFO" for what in ("trainer.resume", "pretrained.path")
    ]
    done = run_cli(*TINY, f"trainer.resume={fifo}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120)
    assert "expected a regular file; this is a FIFO" in one_line_refusal(done)


def test_pretrained_files_with_payloads_or_no_pickle_are_refused_as_such_never_pointing_at_unsafe_loading(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    torch.save({"weight": Payload()}, tmp_path / "object.pt")
    with pytest.raises(CheckpointError) as refused:
        load_pretrained(nn.Linear(2, 2), _pretrained(tmp_path / "object.pt"))
    said = str(refused.value)
    assert "pretrained.path: refusing" in said and "arbitrary unpickling" in said and "weights_only" not in said
    with pytest.raises(NotAFile, match="expected a regular file; this is not a file"):
        load_pretrained(nn.Linear(2, 2), _pretrained("/dev/zero"))
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ([1, 2, 3], "its model is a list, not a state dict"),
        ({"weight": "text"}, "holds a str at 'weight', not a tensor"),
    ],
)
def test_a_checkpoint_whose_model_is_no_state_dict_is_one_line_wherever_it_is_loaded(tmp_path, model, says):
    path = tmp_path / "odd.pt"
    torch.save({"model": model, "step": 5, "epoch": 1}, path)
    with pytest.raises(CheckpointError, match=says):
        load(path)
    with pytest.raises(CheckpointError, match=says.replace("its model", "")):
        load_weights(nn.Linear(2, 2), model, str(path))
    with pytest.raises(ConfigError, match=says.replace("its model ", "this ")):
        load_pretrained(nn.Linear(2, 2), _pretrained(path))


def test_eval_of_a_checkpoint_whose_model_is_a_list_is_one_line(tmp_path):
    torch.save({"model": [1, 2, 3], "step": 5, "epoch": 1}, tmp_path / "odd.pt")
    done = python("-m", "saturate", "eval", tmp_path / "odd.pt", "--out", tmp_path / "ev", cwd=tmp_path)
    assert "its model is a list, not a state dict" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.returncode != 0


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment: expected the run's number of processes"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' in the environment: expected the run's number of processes"),
        ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK=1 in the environment: expected 0 to WORLD_SIZE - 1 = 0"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' in the environment: expected this process's rank"),
        ({"SUBMITIT_EXECUTOR": "slurm", "SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' in the environment: expected"),
    ],
)
def test_a_rank_variable_that_cannot_be_this_processs_is_one_line_naming_it(monkeypatch, env, says):
    from saturate.scale.ranks import rank_zero, world_size

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SUBMITIT_EXECUTOR", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for asked in (world_size, rank_zero):
        with pytest.raises(UserError) as refused:
            asked()
        assert says in str(refused.value)


def test_a_rank_variable_read_while_the_config_is_composed_is_one_line(tmp_path):
    """The run dir's name is resolved with the ranks' help: the mistake is still one line."""
    done = run_cli(*TINY, cwd=tmp_path, env={"WORLD_SIZE": "abc"})
    assert one_line_refusal(done).startswith("error: WORLD_SIZE='abc' in the environment")  # no key it never typed
    alone = run_cli(*TINY, "hydra.run.dir=run", cwd=tmp_path, env={"RANK": "1", "WORLD_SIZE": "1"})
    assert "RANK=1 in the environment: expected 0 to WORLD_SIZE - 1 = 0" in one_line_refusal(alone)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_launcher_names_the_rank_that_failed_for_its_own_reason_not_one_stopped_by_it(tmp_path):
    """Both ranks end in the same second: the one whose error file says another rank failed
    is not the first failure, whatever the order."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from saturate.scale.distributed import PEER_STOPPED
    from saturate.scale.launch import first_failure

    stopped = tmp_path / "rank0.json"
    stopped.write_text(json.dumps({"message": f"rank 0: {PEER_STOPPED} (...)", "timestamp": 100}))
    failures = {
        0: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(stopped)),
        1: ProcessFailure(local_rank=1, pid=2, exitcode=1, error_file=str(tmp_path / "none.json")),
    }
    failures[1].timestamp = 100
    rank, failure = first_failure(ChildFailedError("train", failures))
    assert rank == 1 and failure is failures[1]


# --- slow: real processes stopped by signals, waiting for peers that never come


SLEEPS_IN_ITS_BUILD = """
import os, time
def load(**kwargs):
    open(os.environ["MARKER"], "w").close()
    time.sleep(600)
"""


def _started(marker: Path, proc) -> None:
    deadline = time.monotonic() + 180
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


def _train(*args, cwd: Path, env: dict) -> subprocess.Popen:
    """train.py with SIGINT at its default, as in a terminal (a background job's child inherits it ignored)."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_the_data_is_built_ends_the_run_at_once_with_one_line(tmp_path, signum):
    (tmp_path / "sleeper.py").write_text(SLEEPS_IN_ITS_BUILD)
    marker = tmp_path / "building"
    env = {"PYTHONPATH": str(tmp_path), "MARKER": str(marker)}
    proc = _train(*TINY, "data._target_=sleeper.load", "hydra.run.dir=run", cwd=tmp_path, env=env)
    try:
        _started(marker, proc)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err[-3000:]
    assert f"stopped by {name} while building the data, the model and the other parts of the run: nothing was " in err
    assert "Traceback" not in err, err[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_rank_whose_peers_never_come_says_whom_it_waits_for_and_gives_up_in_time(tmp_path):
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "SATURATE_RENDEZVOUS_TIMEOUT_S": "3",
    }
    proc = _train(*TINY, "device=cpu", "hydra.run.dir=run", cwd=tmp_path, env=env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert "rank 0 of 2 (RANK=0 WORLD_SIZE=2): waiting up to 3 s for rank 1 at 127.0.0.1:" in err
    assert "error: RANK=0 WORLD_SIZE=2: rank(s) 1 of 2 never came to 127.0.0.1:" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_slurm_environment_without_its_other_tasks_is_said_and_a_stop_signal_ends_the_wait(tmp_path):
    env = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_ID": str(os.getpid()),  # submitit derives MASTER_PORT from it: one of its own per test run
        "SLURM_NODELIST": "localhost",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
    }
    proc = _train(*TINY, "device=cpu", cwd=tmp_path, env=env)  # the run dir's name waits for rank 0's
    try:
        deadline = time.monotonic() + 180
        line = ""
        while "waiting up to 600 s" not in line:
            line = proc.stderr.readline()
            assert line and time.monotonic() < deadline, proc.communicate()
        assert "rank 0 of 2 (SUBMITIT_EXECUTOR=slurm SLURM_NTASKS=2 SLURM_PROCID=0)" in line
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM while waiting for the other ranks: nothing was trained yet" in err


@pytest.mark.slow
def test_ranks_given_different_models_under_torchrun_fail_in_one_line(tmp_path):
    script = tmp_path / "differs.py"
    script.write_text(
        "import os, runpy, sys\n"
        "if os.environ.get('RANK') == '1':\n"
        "    sys.argv.append('model.width=16')\n"
        f"sys.argv[0] = {str(ROOT / 'train.py')!r}\n"
        f"runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *TINY]
        + ["device=cpu", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "error: rank 1: its model differs from rank 0's ([1]: params[0] in this process with sizes [16, 1, 3" in out
    # the ranks' own output: one line each (what follows is torchrun's own summary of its failed children)
    ranks = out.split("ChildFailedError")[0]
    assert "[rank1]:" not in ranks and "RuntimeError" not in ranks, out[-3000:]
    assert "error: rank 0: stopped because another rank failed" in ranks
