"""train.py builds the data in a forked process while it imports torch (saturate.compose.ahead):
the run gets the same data and its random streams stand where building the data in its own
process would have left them, so the result is bit-identical; data that cannot come back is built
in the run's process, saying why; the builder's own mistake is answered as before."""

from __future__ import annotations

import io
import pickle
import random
import textwrap
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

from saturate.compose import ahead
from tests.conftest import read_metrics, run_cli

BUILDER = '''
import random

import numpy as np
import torch
from torch.utils.data import Dataset

from saturate.errors import DataError


class Drawn(Dataset):
    def __init__(self, x, y, offsets, transform=None):
        self.x, self.y, self.offsets, self.transform = x, y, offsets, transform

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i] + float(self.offsets[i, 0])
        return (self.transform(x) if self.transform else x), self.y[i]


def build(kind="plain"):
    """A random split and noise from all three global generators, as a user's builder may draw."""
    if kind == "broken":
        raise DataError("drawn: no files under data/raw (kind=broken)")
    order = torch.randperm(640)
    x = torch.randn(640, 1, 8, 8)[order]
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    offsets = (np.random.rand(640, 512) * 0.01 + random.random() * 0.01).astype(np.float32)  # 1.25 MiB: shared
    transform = (lambda t: t) if kind == "lambda" else None  # a lambda does not pickle
    return {"train": Drawn(x[:512], y[:512], offsets[:512], transform), "val": Drawn(x[512:], y[512:], offsets[512:])}
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


def _train(tmp_path, name, *extra):
    return run_cli(*ARGS, *extra, f"hydra.run.dir={name}", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, fresh=True)


def _learnt(run_dir) -> dict:
    return {k: v for k, v in read_metrics(run_dir).items() if k.startswith(("val/", "train/loss", "train/grad_norm"))}


def test_data_built_ahead_trains_bit_identically_to_data_built_in_the_run(tmp_path):
    """The builder draws a split and noise from torch's, NumPy's and Python's generators and
    returns tensors and a NumPy array large enough to come back through shared memory; the model's
    initialisation and dropout then draw from the same generators. Built ahead or in the run, the
    metrics are the same bits."""
    _user_dir(tmp_path)
    ahead_run = _train(tmp_path, "ahead")
    here = _train(tmp_path, "here", "loader.build_ahead=false")
    assert ahead_run.returncode == 0, ahead_run.stderr[-3000:]
    assert here.returncode == 0, here.stderr[-3000:]
    assert FORKED in ahead_run.stdout
    assert "forked" not in here.stdout
    learnt = _learnt(tmp_path / "ahead")
    assert learnt and "val/acc" in learnt
    assert learnt == _learnt(tmp_path / "here")
    assert read_metrics(tmp_path / "ahead")["ahead/data_s"] > 0  # the child's build, beside the imports
    assert "ahead/data_s" not in read_metrics(tmp_path / "here")


@pytest.mark.slow
def test_data_that_does_not_pickle_is_built_in_the_run_and_a_builders_mistake_is_answered_as_before(tmp_path):
    """A dataset holding a lambda cannot come back from the child: the run builds it itself,
    says why, and learns what it would have (the lambda is the identity). A builder's own error
    reaches the user once, in one line, as without the child: no traceback from either process."""
    _user_dir(tmp_path)
    here = _train(tmp_path, "here", "loader.build_ahead=false")
    lam = _train(tmp_path, "lambda", "data.kind=lambda")
    assert lam.returncode == 0, lam.stderr[-3000:]
    assert "data: built here, not ahead in a forked process: it does not pickle" in lam.stdout
    assert _learnt(tmp_path / "lambda") == _learnt(tmp_path / "here")

    broken = [_train(tmp_path, f"broken-{on}", "data.kind=broken", f"loader.build_ahead={on}") for on in (True, False)]
    for result in broken:
        assert result.returncode == 1
        assert "Traceback" not in result.stdout + result.stderr and "saturate-data" not in result.stdout + result.stderr
    errors = [[line for line in r.stderr.splitlines() if line.startswith("error:")] for r in broken]
    assert errors[0] == errors[1] == ["error: drawn: no files under data/raw (kind=broken)"]
    assert here.returncode == 0


def _round_trip(obj):
    """What the run receives of `obj` sent by the child (here, both sides in this process)."""
    return ForkingPickler.loads(ahead._pickled(obj))


def test_tensors_and_large_arrays_come_back_in_shared_memory_the_rest_by_value():
    big = np.arange(300_000, dtype=np.float32).reshape(600, 500)  # 1.1 MiB
    small = np.arange(10, dtype=np.int16)
    tensor = torch.randn(1000, 300)  # 1.1 MiB
    clips = [torch.randn(30, 21) for _ in range(ahead.MAX_PIECES + 1)]  # small ones: by value, however many
    halves = torch.zeros(3, dtype=torch.bfloat16)  # no NumPy dtype: shared, however small
    sent = {"big": big, "small": small, "tensor": tensor, "view": tensor[10:20], "clips": clips, "halves": halves}
    back = _round_trip({**sent, "names": ["a", "b"]})
    assert type(back["big"]) is np.ndarray and back["big"].dtype == np.float32
    assert np.array_equal(back["big"], big) and np.array_equal(back["small"], small)
    assert torch.equal(back["tensor"], tensor) and torch.equal(back["view"], tensor[10:20])
    assert back["tensor"].is_shared() and back["halves"].is_shared() and back["halves"].dtype == torch.bfloat16
    assert all(torch.equal(a, b) and not b.is_shared() for a, b in zip(clips, back["clips"], strict=True))
    back["clips"][0][0, 0] = 1.0  # a writable copy
    assert back["names"] == ["a", "b"]


def test_what_cannot_come_back_is_declined_with_the_reason(tmp_path):
    memmapped = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(4, 4))
    cases = {
        "it does not pickle": {"transform": lambda x: x},
        "memory-mapped": {"x": memmapped},
        "by value": {"blob": b"\0" * (ahead.BY_VALUE_LIMIT + 1)},
    }
    for says, data in cases.items():
        declined = pickle.loads(ahead._pickled(data))
        assert isinstance(declined, ahead.Declined) and says in declined.why, (says, declined)
        assert not declined.build_error
    pickler = ahead._Pickler(io.BytesIO(), limit=2**30, pieces=2)  # the limits' own logic, at small limits
    with pytest.raises(ahead._TooMuch, match="over 2 tensors of 1 MiB"):
        pickler.dump([torch.zeros(2**18) for _ in range(3)])
    with pytest.raises(ahead._TooMuch, match="3 MiB of shared memory"):
        ahead._Pickler(io.BytesIO(), limit=3 * 2**20).dump([torch.zeros(2**18) for _ in range(4)])


def test_data_is_taken_only_where_building_it_here_would_give_the_same():
    """The node, the intra-op threads, the deterministic switch and the three generators' states
    must be those the child built under; the generators are then left where its build left them."""
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    before = ahead._states()
    torch.rand(5)
    after = ahead._states()
    built = ahead.Built({"_target_": "x"}, "data", 1.0, torch.get_num_threads(), False, before, after)
    ahead._set_states(before)
    assert ahead._mismatch(built, {"_target_": "x"}) is None
    assert "node differs" in ahead._mismatch(built, {"_target_": "y"})
    other_threads = ahead.Built({"_target_": "x"}, "data", 1.0, torch.get_num_threads() + 1, False, before, after)
    assert "intra-op threads" in ahead._mismatch(other_threads, {"_target_": "x"})
    deterministic = ahead.Built({"_target_": "x"}, "data", 1.0, torch.get_num_threads(), True, before, after)
    assert "deterministic" in ahead._mismatch(deterministic, {"_target_": "x"})
    for draw in (random.random, np.random.rand, torch.rand):
        ahead._set_states(before)
        draw() if draw is random.random else draw(1)
        assert "random generators" in ahead._mismatch(built, {"_target_": "x"}), draw
    ahead._set_states(after)
    assert ahead._same_states(ahead._states(), after)
