"""WebDataset shards (data=shards): made from a real image folder with scripts/make_shards.py,
read back by index, trained on, resumed bit for bit; bad indexes answered in one line."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from hydra.errors import CompactHydraException

import saturate
from saturate.data.image_folder import load_image_folder
from saturate.data.shards import load_shards
from scripts.make_image_folder import write_digits
from tests.conftest import ROOT, read_metrics
from tests.test_resume import EXACT, final_weights, interrupted_then_resumed, step_losses

pytest.importorskip("wids")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, Path]:
    """(folder, shards): the digits as JPEGs with 2 broken files, converted by the script."""
    root = tmp_path_factory.mktemp("shards")
    write_digits(root / "folder", size=16, fmt="jpg", corrupt=2)
    done = subprocess.run([sys.executable, str(ROOT / "scripts/make_shards.py"), str(root / "folder"), str(root / "shards"),
                           "--per-shard", "400"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 broken files skipped" in done.stdout
    return root / "folder", root / "shards"


def contents(dataset) -> list[tuple[int, str]]:
    """Every sample as (label, digest of its pixels), sorted: what a data set holds, in any order."""
    found = []
    for start in range(0, len(dataset), 256):
        x, y = dataset.__getitems__(list(range(start, min(start + 256, len(dataset)))))
        found += [(int(label), hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest()) for image, label in zip(x, y, strict=True)]
    return sorted(found)


def test_shards_hold_the_folders_split_sample_for_sample(shards):
    folder, out = shards
    train, val = load_shards(train=str(out / "train.json"), val=str(out / "val.json"), image_size=16, channels=3)
    f_train, f_val = load_image_folder(root=str(folder), image_size=16, channels=3, val_fraction=0.2, split_seed=0, strict=False,
                                       check=True, index_cache="")  # fmt: skip
    assert len(list(out.glob("train-*.tar"))) == 4 and len(train) == len(f_train)
    assert len(train) + len(val) == 1797  # every digit, no broken file
    assert contents(train) == contents(f_train) and contents(val) == contents(f_val)
    assert train.classes == f_train.classes and train.mean == pytest.approx(f_train.mean, abs=0.005)  # taken at 64 px, here at 16


def test_training_on_shards_with_workers(make_cfg, shards):
    _, out = shards
    cfg = make_cfg("data=shards", f"data.train={out / 'train.json'}", f"data.val={out / 'val.json'}", "data.image_size=16",
                   "loader.num_workers=2", "model.width=8")  # fmt: skip
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 3 and read_metrics(cfg.run_dir)["data"] == "shards"


@pytest.mark.slow
def test_a_run_on_shards_resumed_mid_epoch_equals_the_uninterrupted_one(make_cfg, monkeypatch, shards):
    _, out = shards
    overrides = ["data=shards", f"data.train={out / 'train.json'}", f"data.val={out / 'val.json'}", "data.image_size=16",
                 "loader.num_workers=2", "model.width=8"]  # fmt: skip
    full = make_cfg(*EXACT, *overrides)
    saturate.train(full)
    first, second = interrupted_then_resumed(make_cfg, monkeypatch, overrides, 16)
    assert step_losses(first, second) == step_losses(full.run_dir)
    weights, resumed = final_weights(full.run_dir), final_weights(second)
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)


@pytest.mark.parametrize(
    ("write", "says"),
    [
        (None, "data.train='{path}': no such file; expected a shard index (scripts/make_shards.py writes one)"),
        ("{ not json", "data.train='{path}': not a readable shard index (JSONDecodeError"),
        ('{"shardlist": [{"url": "a.tar"}]}', "data.train='{path}': expected a JSON object whose 'shardlist' lists"),
    ],
)
def test_a_bad_index_is_one_line_naming_the_key(make_cfg, tmp_path, write, says):
    path = tmp_path / "train.json"
    if write is not None:
        path.write_text(write)
    with pytest.raises(CompactHydraException) as e:
        saturate.train(make_cfg("data=shards", f"data.train={path}", "data.val=null"))
    assert says.format(path=path) in str(e.value) and "\n" not in str(e.value)


def test_nothing_in_a_shard_is_unpickled(tmp_path):
    """A sample that carries a pickle (WebDataset's .pyd) is read for its image and class only."""

    class Boom:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    image = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (8, 8), (9, 9, 9)).save(image, "PNG")
    with tarfile.open(tmp_path / "evil-000000.tar", "w") as tar:
        for name, data in (("0.png", image.getvalue()), ("0.cls", b"1"), ("0.pyd", pickle.dumps(Boom()))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "evil.json").write_text(json.dumps({"shardlist": [{"url": "evil-000000.tar", "nsamples": 1}], "classes": ["a", "b"]}))
    train, _ = load_shards(train=str(tmp_path / "evil.json"), val=None, image_size=8, channels=3)
    x, y = train.__getitems__([0])
    assert y.tolist() == [1] and int(x.max()) == 9 and not (tmp_path / "pwned").exists()


def test_shards_are_shuffled_a_few_at_a_time_the_same_way_on_every_rank():
    """A permutation that is a function of (seed, epoch); its first 4 shards' worth of samples
    come from 4 shards (a worker keeps few open); the ranks' shares are disjoint and cover it."""
    from saturate.loader import ResumableSampler

    class Sharded(torch.utils.data.Dataset):
        sample_groups = [100] * 12 + [37]

        def __len__(self):
            return sum(self.sample_groups)

    def share(rank, epoch=0):
        sampler = ResumableSampler(Sharded(), batch_size=10, shuffle=True, seed=5, rank=rank, world_size=2, keyed=False)
        sampler.set_epoch(epoch)
        return list(sampler)

    first, second = share(0), share(1)
    assert sorted(first + second) == sorted([*range(1237), first[0]])  # padded by one to equal shares, as DistributedSampler
    assert share(0) == first and share(0, epoch=1) != first
    together = [i for pair in zip(first, second, strict=True) for i in pair]  # the order before the ranks took their shares
    assert len({i // 100 for i in together[:400]}) <= 4
