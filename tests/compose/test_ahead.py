"""train.py builds the data in a forked process while it imports torch (saturate.compose.ahead):
the run gets the same data, laid out the same, and its random streams stand where building the data
in its own process would have left them, so the result is bit-identical; data that cannot come back
is built in the run's process, saying why; the builder's own mistake is answered once, as before;
the child never outlives the run, and a build under way is not cut short by a run that ends."""

from __future__ import annotations

import io
import itertools
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import psutil
import pytest
import torch

from saturate.compose import ahead
from saturate.parts.device import untouched_rng
from tests.conftest import ROOT, python, read_metrics, run_cli

BUILDER = '''
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from saturate.errors import DataError

torch.manual_seed(123)  # at import: the run's config check imports this module before the run seeds
np.random.seed(123)
if os.environ.get("AHEADDATA_SLOW_IMPORT") and multiprocessing.current_process().name != "saturate-data":
    time.sleep(5)  # the run's config check, not the forked build: the run is still before its training then


class NoRawFiles(DataError):
    """A user's own error class, whose constructor takes other arguments than its message."""

    def __init__(self, root, hint):
        super().__init__(f"drawn: no raw files under {root} ({hint})")


class Drawn(Dataset):
    """Each sample shifted by the sum of its block of a Fortran-ordered array and of a row of a
    transposed tensor: reductions whose order, and so their rounding, follows the memory layout."""

    def __init__(self, x, y, spread, mix, transform=None):
        self.x, self.y, self.spread, self.mix, self.transform = x, y, spread, mix, transform

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i] + float(self.spread[i].sum()) * 1e-3 + float(self.mix[i % len(self.mix)].sum()) * 0.01
        return (self.transform(x) if self.transform else x), self.y[i]


def build(kind="plain", log="builds.txt"):
    """A random split and noise from all three global generators, as a user's builder may draw."""
    Path(log).open("a").write(f"{os.getpid()}\\n")  # one line a build
    if kind == "broken":
        raise DataError("drawn: no files under data/raw (kind=broken)")
    if kind == "broken-own":
        raise NoRawFiles("data/raw", "kind=broken-own")
    if kind == "pool":  # processes of its own, stopped with SIGTERM when the block ends
        with multiprocessing.Pool(1) as pool:
            pool.map(abs, range(4))
    manager = multiprocessing.Manager() if kind == "manager" else None  # a server the data needs
    if kind == "killed" and multiprocessing.current_process().name == "saturate-data":
        os.kill(os.getpid(), signal.SIGKILL)  # the forked build dies (out of memory): the run builds its own
    if kind == "slow":  # a cache written over 1.5 s, and a process of its own
        Path("sleeper.pid").write_text(str(os.spawnlp(os.P_NOWAIT, "sleep", "sleep", "60")))
        cache = Path("cache.txt").open("w")
        for part in ("start", "end"):
            cache.write(part + "\\n")
            cache.flush()
            time.sleep(0.75)
    order = torch.randperm(640)
    x = torch.randn(640, 1, 8, 8)[order]
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    spread = np.asfortranarray((np.random.rand(640, 30, 20) * (1 + random.random())).astype(np.float32))  # 1.5 MiB
    mix = torch.randn(16, 64).t()  # small, transposed: by value, with its strides
    transform = (lambda t: t) if kind == "lambda" else None  # a lambda does not pickle
    train = Drawn(x[:512], y[:512], spread[:512], mix, transform)
    train.seen = manager.list() if manager else None
    return {"train": train, "val": Drawn(x[512:], y[512:], spread[512:], mix)}
'''

ARGS = [
    "hydra.searchpath=[file://conf]",
    "data=drawn",
    "trainer.max_epochs=2",
    "trainer.deterministic=true",
    "trainer.progress=false",
    "precision=fp32",
    "loader.batch_size=64",
    "loader.num_workers=0",
]
FORKED = "data: built in a forked process while the imports ran"


def _user_dir(tmp_path):
    (tmp_path / "aheaddata.py").write_text(textwrap.dedent(BUILDER))
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "drawn.yaml").write_text("_target_: aheaddata.build\nkind: plain\n")


def _path(tmp_path) -> str:
    """The builder's folder first, then the caller's own PYTHONPATH."""
    return os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))


def _train(tmp_path, name, *extra):
    env = {"PYTHONPATH": _path(tmp_path)}
    return run_cli(*ARGS, *extra, f"hydra.run.dir={name}", cwd=tmp_path, env=env, fresh=True)


def _learnt(run_dir) -> dict:
    return {k: v for k, v in read_metrics(run_dir).items() if k.startswith(("val/", "train/loss", "train/grad_norm"))}


def _builds(tmp_path) -> list[str]:
    lines = (tmp_path / "builds.txt").read_text().split() if (tmp_path / "builds.txt").exists() else []
    (tmp_path / "builds.txt").unlink(missing_ok=True)
    return lines


def test_data_built_ahead_trains_bit_identically_to_data_built_in_the_run(tmp_path):
    """The builder's module seeds the generators at import; the builder draws a split and noise from
    torch's, NumPy's and Python's generators and returns tensors, a Fortran-ordered array large
    enough for shared memory with views of it, and a small transposed tensor; the samples read them
    along strided rows; the model's initialisation and dropout then draw from the same generators.
    Built ahead or in the run, the metrics are the same bits, and the data was built once."""
    _user_dir(tmp_path)
    ahead_run = _train(tmp_path, "ahead")
    assert ahead_run.returncode == 0, ahead_run.stderr[-3000:]
    assert len(_builds(tmp_path)) == 1
    here = _train(tmp_path, "here", "loader.build_ahead=false")
    assert here.returncode == 0, here.stderr[-3000:]
    assert FORKED in ahead_run.stdout
    assert "forked" not in here.stdout
    learnt = _learnt(tmp_path / "ahead")
    assert learnt and "val/acc" in learnt
    assert learnt == _learnt(tmp_path / "here")
    assert read_metrics(tmp_path / "ahead")["ahead/data_s"] > 0  # the child's build, beside the imports
    assert "ahead/data_s" not in read_metrics(tmp_path / "here")


@pytest.mark.slow
def test_what_cannot_come_back_is_built_in_the_run_and_a_builders_mistake_is_answered_once(tmp_path):
    """A dataset holding a lambda cannot come back, nor can a child killed mid-build: the run builds
    the data itself, says why, and learns what it would have (the lambda is the identity). A
    builder's own error reaches the user once, in one line, as without the child, from one build:
    no traceback from either process."""
    _user_dir(tmp_path)
    here = _train(tmp_path, "here", "loader.build_ahead=false")
    assert here.returncode == 0, here.stderr[-3000:]
    _builds(tmp_path)
    dead = "the process building it ended without sending it"
    kept = "its build left processes running"
    for kind, says in (("lambda", "it could not be sent"), ("killed", dead), ("manager", kept)):
        result = _train(tmp_path, kind, f"data.kind={kind}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"data: built here, not ahead in a forked process: {says}" in result.stdout
        assert _learnt(tmp_path / kind) == _learnt(tmp_path / "here")
        assert len(_builds(tmp_path)) == 2  # the child's, then the run's own

    said = {
        "broken": "no files under data/raw (kind=broken)",
        "broken-own": "no raw files under data/raw (kind=broken-own)",
    }
    for (kind, says), on in itertools.product(said.items(), (True, False)):
        result = _train(tmp_path, f"{kind}-{on}", f"data.kind={kind}", f"loader.build_ahead={on}")
        assert result.returncode == 1
        output = result.stdout + result.stderr
        assert "Traceback" not in output and "saturate-data" not in output
        assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [f"error: drawn: {says}"]
        assert len(_builds(tmp_path)) == 1

    pooled = _train(tmp_path, "pool", "data.kind=pool")  # its workers stopped as they would be in the run
    assert pooled.returncode == 0 and FORKED in pooled.stdout, pooled.stderr[-3000:]
    assert _learnt(tmp_path / "pool") == _learnt(tmp_path / "here")


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_run_that_ends_first_lets_the_build_finish_and_leaves_no_process(tmp_path):
    """A mistake found after the fork (a model that does not import): the run's one-line error,
    after the build under way wrote its cache whole; then neither the child nor the process the
    builder started is left."""
    _user_dir(tmp_path)
    result = _train(tmp_path, "typo", "data.kind=slow", "model._target_=nowhere.Model")
    assert result.returncode == 1 and "model._target_='nowhere.Model'" in result.stderr, result.stderr[-2000:]
    assert (tmp_path / "cache.txt").read_text() == "start\nend\n"
    (child,) = _builds(tmp_path)
    assert _gone(int(child), 5) and _gone(int((tmp_path / "sleeper.pid").read_text()), 5)


@pytest.mark.slow
@pytest.mark.usefixtures("ctrl_c_reaches_us")  # the run must hear Ctrl-C
def test_ctrl_c_while_the_data_is_built_stops_the_child_and_what_it_started_at_once(tmp_path):
    _user_dir(tmp_path)
    (tmp_path / "conf" / "data" / "drawn.yaml").write_text("_target_: aheaddata.build\nkind: slow\n")
    cmd = [sys.executable, str(ROOT / "train.py"), *ARGS, "hydra.run.dir=stopped"]
    env = {**os.environ, "PYTHONPATH": _path(tmp_path), "AHEADDATA_SLOW_IMPORT": "1"}  # the run: in its config check
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (tmp_path / "cache.txt").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reaches the run's group: the child has its own
    sent = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in out + err, err[-2000:]
    assert time.monotonic() - sent < 3  # not after the build's 1.5 s, nor a 5-s join
    (child,) = _builds(tmp_path)
    assert _gone(int(child), 2) and _gone(int((tmp_path / "sleeper.pid").read_text()), 2)


def test_only_train_pys_single_one_process_run_forks_and_the_check_imports_no_torch(tmp_path):
    """In a fresh interpreter (torch not imported: the only case worth a child)."""
    code = textwrap.dedent(
        """
        import json, os, sys, threading
        from omegaconf import OmegaConf
        from saturate.compose import ahead

        def cfg(**changes):
            base = {"loader": {"build_ahead": True}, "tune": {"enabled": False}, "trainer": {"devices": "auto"}}
            for key, value in changes.items():
                group, name = key.split("__")
                base[group][name] = value
            return OmegaConf.create(base)

        seen = {"default": ahead.wanted(cfg()), "one device": ahead.wanted(cfg(trainer__devices=1))}
        seen["off"] = ahead.wanted(cfg(loader__build_ahead=False))
        seen["tune"] = ahead.wanted(cfg(tune__enabled=True))
        seen["two devices"] = ahead.wanted(cfg(trainer__devices=2))
        os.environ["LOCAL_RANK"] = "0"
        seen["a torchrun rank"] = ahead.wanted(cfg())
        del os.environ["LOCAL_RANK"]
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        seen["one core"] = ahead.wanted(cfg())
        os.sched_setaffinity(0, range(os.cpu_count()))
        stop = threading.Event()
        threading.Thread(target=stop.wait).start()
        seen["a thread"] = ahead.wanted(cfg())
        stop.set()
        seen["torch imported"] = "torch" in sys.modules
        print(json.dumps(seen))
        """
    )
    done = python("-c", code, cwd=tmp_path, timeout=60, fresh=True)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    two_cores = len(os.sched_getaffinity(0)) >= 2
    assert seen == {
        "default": two_cores,
        "one device": two_cores,
        "off": False,
        "tune": False,
        "two devices": False,
        "a torchrun rank": False,
        "one core": False,
        "a thread": False,
        "torch imported": False,
    }


def _round_trip(obj):
    """What the run receives of `obj` sent by the child (here, both sides in this process)."""
    return ForkingPickler.loads(ahead._pickled(obj))


def test_arrays_and_tensors_come_back_with_their_layout_flags_and_shared_buffers():
    big = np.asfortranarray(np.arange(300_000, dtype=np.float32).reshape(600, 500))  # 1.1 MiB: shared memory
    frozen = np.arange(300_000, dtype=np.float64).reshape(600, 500)
    frozen.flags.writeable = False
    tensor, small = torch.randn(1000, 300), torch.randn(40, 30)  # 1.1 MiB; 4.7 KiB
    sent = {
        "big": big,
        "rows": [big[:100], big[100:], big[::-2, 3:]],  # views of one array: one buffer
        "frozen": [frozen, frozen[:5]],
        "small": np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
        "tensor": [tensor, tensor[10:20]],
        "views": [small, small.t()[:5], small[3:]],  # a small storage: sent once, with each view's strides
        "clips": [torch.randn(30, 21) for _ in range(ahead.MAX_PIECES + 1)],  # small ones: by value, however many
        "halves": torch.zeros(3, dtype=torch.bfloat16),
        "expanded": torch.zeros(1).expand(300_000),
        "records": np.zeros(10, dtype=[("a", np.int32), ("b", np.float32)])[2:],  # a view keeps its fields
        "names": ["a", "b"],
    }
    back = _round_trip(sent)
    for name in ("big", "small"):
        assert type(back[name]) is np.ndarray and back[name].flags.f_contiguous
        assert np.array_equal(back[name], sent[name]) and back[name].strides == sent[name].strides
    for got, was in zip(back["rows"], sent["rows"], strict=True):
        assert np.array_equal(got, was) and got.strides == was.strides
    back["big"][599, 3] = -2.0
    assert back["rows"][1][499, 3] == back["rows"][2][0, 0] == -2.0  # still views of one buffer
    assert not back["frozen"][0].flags.writeable and not back["frozen"][1].flags.writeable
    for got, was in zip(back["tensor"] + back["views"], sent["tensor"] + sent["views"], strict=True):
        assert torch.equal(got, was) and got.stride() == was.stride() and got.storage_offset() == was.storage_offset()
    assert back["tensor"][0].is_shared() and not back["views"][0].is_shared()
    back["views"][0][3, 0] = 99.0  # a writable copy whose views are still its views
    assert back["views"][1][0, 3] == 99.0 and back["views"][2][0, 0] == 99.0
    assert all(torch.equal(a, b) and not b.is_shared() for a, b in zip(sent["clips"], back["clips"], strict=True))
    assert back["halves"].dtype == torch.bfloat16 and back["expanded"].stride() == (0,)
    assert back["records"].dtype == sent["records"].dtype and back["records"]["a"].shape == (8,)
    assert back["names"] == ["a", "b"]


def test_what_cannot_come_back_is_declined_with_the_reason(tmp_path):
    mapped = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(4, 4))
    base = np.zeros(100)
    cases = {
        "could not be sent": {"transform": lambda x: x},
        "memory-mapped": {"x": mapped},
        "memory-mapped array": {"x": np.asarray(mapped)[1:]},
        "foreign buffer": {"x": np.lib.stride_tricks.as_strided(base, (10, 10), (8, 16))},
        "by value": {"blob": b"\0" * (ahead.BY_VALUE_LIMIT + 1)},
        "conjugated": {"x": torch.tensor([1 - 2j, 3 + 4j]).conj()},  # torch's sharing would drop the bit
    }
    for says, data in cases.items():
        declined = pickle.loads(ahead._pickled(data))
        assert isinstance(declined, ahead.Declined) and says in declined.why, (says, declined)
    pickler = ahead._Pickler(io.BytesIO(), limit=2**30, pieces=2)  # the limits' own logic, at small limits
    with pytest.raises(ahead._TooMuch, match="over 2 tensors of 1 MiB"):
        pickler.dump([torch.zeros(2**18) for _ in range(3)])
    with pytest.raises(ahead._TooMuch, match="3 MiB of shared memory"):
        ahead._Pickler(io.BytesIO(), limit=3 * 2**20).dump([torch.zeros(2**18) for _ in range(4)])


def test_data_is_taken_only_where_building_it_here_would_give_the_same():
    """The intra-op threads, default dtype, deterministic switch, matmul precision and the three
    generators' states must be those the child built under; the generators are then left where its
    build left them, and a torch.manual_seed in the build is made here too (the CUDA generators)."""
    seed = torch.initial_seed()
    with untouched_rng():
        random.seed(3)
        np.random.seed(3)
        torch.manual_seed(3)
        before = ahead._states()
        torch.rand(5)
        after = ahead._states()
        built = ahead.Built({"_target_": "x"}, "data", 1.0, ahead._switches(), before, after)
        ahead._set_states(before)
        assert ahead._mismatch(built) is None
        threads, dtype, deterministic, matmul = ahead._switches()
        for switches in (
            (threads + 1, dtype, deterministic, matmul),
            (threads, torch.float64, deterministic, matmul),
            (threads, dtype, not deterministic, matmul),
            (threads, dtype, deterministic, "medium" if matmul != "medium" else "high"),
        ):
            other = ahead.Built({"_target_": "x"}, "data", 1.0, switches, before, after)
            assert "differ from the child's" in ahead._mismatch(other), switches
        for draw in (random.random, np.random.rand, torch.rand):
            ahead._set_states(before)
            draw() if draw is random.random else draw(1)
            assert "random generators" in ahead._mismatch(built), draw
        ahead._set_states(before)
        torch.manual_seed(7)  # a builder's own seed
        torch.rand(5)
        after = ahead._states()
        reseeded = ahead.Built({"_target_": "x"}, "data", 1.0, ahead._switches(), before, after, reseeded=7)
        ahead._set_states(before)
        ahead._carry_back(reseeded)
        assert ahead._same_states(ahead._states(), after) and torch.initial_seed() == 7
    state = torch.get_rng_state()
    torch.manual_seed(seed)  # this process's initial seed back, its generator's state untouched
    torch.set_rng_state(state)
