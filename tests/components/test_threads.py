"""device.threads: torch's intra-op CPU threads, set for a run, put back for the next run of
the same process (tune's trials) and otherwise left as the caller has them."""

from __future__ import annotations

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
