"""device.threads: torch's intra-op CPU threads, set for a run, put back for the next run of
the same process (tune's trials) and otherwise left as the caller has them; auto follows the
cores the process may use (its cgroup's CPU quota, its affinity mask)."""

from __future__ import annotations

import os

import pytest
import torch

from saturate.components import device
from saturate.components.device import set_threads


@pytest.fixture
def threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setitem(device._THREADS, "default", 2)
    monkeypatch.setitem(device._THREADS, "set", False)
    yield
    torch.set_num_threads(before)


def test_a_number_sets_them_and_a_later_auto_puts_torchs_default_back(threads):
    set_threads(1)
    assert torch.get_num_threads() == 1
    set_threads("auto")
    assert torch.get_num_threads() == 2


def test_auto_leaves_the_callers_own_setting(threads):
    torch.set_num_threads(1)  # the user's notebook, before saturate.fit
    set_threads("auto")
    assert torch.get_num_threads() == 1


def test_auto_takes_slurms_cpus_per_task(threads, monkeypatch):
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    set_threads("auto")
    assert torch.get_num_threads() == 1


def test_a_run_with_threads_set_trains_with_them(make_cfg, threads):
    import saturate

    saturate.train(make_cfg("device.threads=1"))
    assert torch.get_num_threads() == 1


def test_threads_below_one_are_refused(make_cfg):
    from saturate.errors import ConfigError

    with pytest.raises(ConfigError, match="device.threads=0: expected an integer >= 1 or 'auto'"):
        import saturate

        saturate.train(make_cfg("device.threads=0"))


@pytest.mark.parametrize(
    ("recorded", "expected"),
    [
        ("100000 100000", (1, "the cgroup's CPU quota")),  # one core's worth of quota on a 2-core host
        ("150000 100000", (None, "")),  # 1.5 cores: 2 threads, torch's default
        ("max 100000", (None, "")),  # no quota
        ("garbage", (None, "")),
        ("100000", (None, "")),
        ("-1 100000", (None, "")),
    ],
)
def test_auto_follows_the_cgroups_cpu_quota(threads, monkeypatch, tmp_path, recorded, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: {0, 1})
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(recorded + "\n")
    assert device.auto_threads(cpu_max) == expected


def test_omp_num_threads_set_by_the_user_wins_over_the_quota(threads, monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert device.auto_threads(tmp_path / "cpu.max") == (None, "")


def test_a_run_under_a_one_core_quota_trains_with_one_thread_and_says_why(
    make_cfg, threads, monkeypatch, tmp_path, caplog
):
    """The quota read from this process's cgroup folder (its own cgroup's cpu.max and the
    root's), pointed at a recorded one."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(device, "CGROUP_ROOT", tmp_path)
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    import saturate

    with caplog.at_level("INFO", logger="saturate"):
        saturate.train(make_cfg("device=cpu"))
    assert torch.get_num_threads() == 1
    assert "device: cpu (1 threads: the cgroup's CPU quota)" in caplog.text


def test_a_run_on_one_core_of_its_affinity_mask_trains_with_one_thread(tmp_path, monkeypatch):
    """`python train.py` in a process whose affinity mask holds one core (as under `taskset
    -c 0`), set after torch was imported (as a launcher or a notebook may): a new interpreter
    without the OMP_NUM_THREADS=1 the test workers run with."""
    from tests.conftest import ROOT, TINY, python

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    run_dir = tmp_path / "run"
    code = (
        "import os, runpy, sys, torch; os.sched_setaffinity(0, {0}); "
        f"sys.argv = ['train.py', *{[*TINY, f'run_dir={run_dir}', 'device=cpu']!r}]; "
        f"runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')"
    )
    assert "OMP_NUM_THREADS" not in os.environ and "SLURM_CPUS_PER_TASK" not in os.environ  # neither decides here
    done = python("-c", code, cwd=tmp_path, fresh=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "device: cpu (1 threads: the CPU affinity mask)" in done.stdout + done.stderr
