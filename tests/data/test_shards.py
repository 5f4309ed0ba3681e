"""WebDataset shards (data=shards): made from a real image folder with saturate make-shards,
read back by index, trained on, resumed bit for bit; bad indexes answered in one line."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import tarfile
from pathlib import Path

import pytest
import torch
from hydra.errors import CompactHydraException

import saturate
from saturate.commands.make_image_folder import write_digits
from saturate.data.image_folder import load_image_folder
from saturate.data.shards import load_shards
from tests.checkpoint.test_resume import EXACT, final_weights, interrupted_then_resumed, step_losses
from tests.conftest import python, read_metrics

pytest.importorskip("wids")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, Path]:
    """(folder, shards): the digits as JPEGs with 2 broken files, converted by the script."""
    root = tmp_path_factory.mktemp("shards")
    write_digits(root / "folder", size=16, fmt="jpg", corrupt=2)
    done = python("-m", "saturate", "make-shards", root / "folder", root / "shards", "--per-shard", "400", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "2 broken files skipped" in done.stdout
    return root / "folder", root / "shards"


def contents(dataset) -> list[tuple[int, str]]:
    """Every sample as (label, digest of its pixels), sorted: what a data set holds, in any order."""
    found = []
    for start in range(0, len(dataset), 256):
        x, y = dataset.__getitems__(list(range(start, min(start + 256, len(dataset)))))
        found += [
            (int(label), hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest())
            for image, label in zip(x, y, strict=True)
        ]
    return sorted(found)


def test_shards_hold_the_folders_split_sample_for_sample(shards):
    folder, out = shards
    train, val = load_shards(train=str(out / "train.json"), val=str(out / "val.json"), image_size=16, channels=3)
    f_train, f_val = load_image_folder(
        root=str(folder),
        image_size=16,
        channels=3,
        val_fraction=0.2,
        split_seed=0,
        strict=False,
        check=True,
        index_cache="",
    )
    assert len(list(out.glob("train-*.tar"))) == 4 and len(train) == len(f_train)
    assert len(train) + len(val) == 1797  # every digit, no broken file
    assert contents(train) == contents(f_train) and contents(val) == contents(f_val)
    # taken at 64 px, here at 16
    assert train.classes == f_train.classes and train.mean == pytest.approx(f_train.mean, abs=0.005)


def on_shards(out) -> list[str]:
    """data=shards over the shards in `out`, small images, two workers."""
    return [
        "data=shards",
        f"data.train={out / 'train.json'}",
        f"data.val={out / 'val.json'}",
        "data.image_size=16",
        "loader.num_workers=2",
        "model.width=8",
    ]


def test_training_on_shards_with_workers(make_cfg, shards):
    _, out = shards
    cfg = make_cfg(*on_shards(out))
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 3 and read_metrics(cfg.run_dir)["data"] == "shards"


@pytest.mark.slow
def test_a_run_on_shards_resumed_mid_epoch_equals_the_uninterrupted_one(make_cfg, monkeypatch, shards):
    _, out = shards
    overrides = on_shards(out)
    full = make_cfg(*EXACT, *overrides)
    saturate.train(full)
    first, second = interrupted_then_resumed(make_cfg, monkeypatch, overrides, 16)
    assert step_losses(first, second) == step_losses(full.run_dir)
    weights, resumed = final_weights(full.run_dir), final_weights(second)
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)


def png(width: int, height: int) -> bytes:
    """A real PNG of 8 x 8 grey 7s, or (any other size) a small one whose header says width x
    height: a decompression bomb costs nothing to make."""
    import struct
    import zlib

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (7, 7, 7)).save(out, "PNG")
    data = bytearray(out.getvalue())
    if (width, height) == (8, 8):
        return bytes(data)
    ihdr = bytes(data[12:16]) + struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(ihdr))
    return bytes(data)


def write_shard(path: Path, samples: list[tuple[bytes, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for n, (image, cls) in enumerate(samples):
            for name, data in ((f"{n:06d}.png", image), (f"{n:06d}.cls", cls)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def index(tmp_path: Path, shardlist: list, **fields) -> Path:
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"shardlist": shardlist, "classes": ["a", "b"], **fields}))
    return path


def good_shard(tmp_path: Path, n: int = 4) -> str:
    write_shard(tmp_path / "good-000000.tar", [(png(8, 8), str(i % 2).encode()) for i in range(n)])
    return "good-000000.tar"


# Hostile or broken indexes (issue 25, items 2 and 9): one message naming the file and the field,
# nothing run, nothing opened but local files. The marker file would exist if a shell had run.
HOSTILE_URLS = [
    "pipe:touch {marker}",
    "pipe:touch {marker} && cat good-000000.tar",
    "http://example.invalid/'; touch {marker}; echo '",
    "https://example.invalid/x.tar",
    "s3://bucket/'; touch {marker}; echo '.tar",
    "gs://bucket/x.tar",
    "file://{tmp}/good-000000.tar",
    "ftp://example.invalid/x.tar",
]


@pytest.mark.parametrize("url", HOSTILE_URLS)
def test_a_shard_url_with_a_scheme_is_refused_and_nothing_runs(make_cfg, tmp_path, url):
    marker = tmp_path / "pwned"
    good_shard(tmp_path)
    given = url.format(marker=marker, tmp=tmp_path)
    path = index(tmp_path, [{"url": given, "nsamples": 4}])
    with pytest.raises(CompactHydraException) as e:
        saturate.train(make_cfg("data=shards", f"data.train={path}", "data.val=null", "data.image_size=8"))
    message = str(e.value)
    assert (
        message.startswith(f"data.train='{path}': shardlist[0].url=") and "saturate opens local files only" in message
    )
    assert "\n" not in message and not marker.exists()


BAD_INDEXES = [
    (None, "no such file; expected a shard index (saturate make-shards writes one)"),
    ("{ not json", "not a readable shard index (JSONDecodeError"),
    ("[" * 100_000 + "]" * 100_000, "not a readable shard index (RecursionError"),
    ('{"shardlist": []}', "expected a JSON object whose 'shardlist' lists"),
    (
        '{"shardlist": [{"url": "good-000000.tar"}], "classes": ["a", "b"]}',
        "shardlist[0].nsamples=None: expected an integer >= 1",
    ),
    (
        '{"shardlist": [{"url": "good-000000.tar", "nsamples": -4}], "classes": ["a", "b"]}',
        "shardlist[0].nsamples=-4: expected an integer",
    ),
    (
        '{"shardlist": [{"url": "good-000000.tar", "nsamples": "4"}], "classes": ["a", "b"]}',
        "shardlist[0].nsamples='4': expected",
    ),
    (
        '{"shardlist": [{"url": "good-000000.tar", "nsamples": true}], "classes": ["a", "b"]}',
        "shardlist[0].nsamples=True: expected",
    ),
    (
        '{"shardlist": [{"url": "missing.tar", "nsamples": 4}], "classes": ["a", "b"]}',
        "shardlist[0].url='missing.tar': expected an",
    ),
    (
        '{"shardlist": [{"url": 7, "nsamples": 4}], "classes": ["a", "b"]}',
        "shardlist[0].url=7: expected the path of a shard file",
    ),
    ('{"shardlist": ["good-000000.tar"], "classes": ["a", "b"]}', "shardlist[0]='good-000000.tar': expected {'url'"),
    ('{"shardlist": [{"url": "good-000000.tar", "nsamples": 4}]}', "classes=None: expected the list of class names"),
    (
        '{"shardlist": [{"url": "good-000000.tar", "nsamples": 4}], "classes": ["a", "b"], "mean": "grey", "std": '
        "[0.2, 0.2, 0.2]}",
        "mean='grey': expected a list of 3 finite numbers",
    ),
    (
        '{"shardlist": [{"url": "good-000000.tar", "nsamples": 4}], "classes": ["a", "b"], "mean": 0.5, "std": '
        "[0.2, 0.2, 0.2]}",
        "mean=0.5: expected a list of 3 finite numbers",
    ),
    (
        '{"shardlist": [{"url": "good-000000.tar", "nsamples": 4}], "classes": ["a", "b"], "mean": [0.5, 0.5, 0.5], '
        '"std": [0, 0, 0]}',
        "std=[0, 0, 0]: expected standard deviations > 0",
    ),
    (
        '{"shardlist": [{"url": "good-000000.tar", "nsamples": 4}], "classes": ["a", "b"], "mean": [0.5, 0.5], '
        '"std": [0.2, 0.2]}',
        "mean=[0.5, 0.5]: expected a list of 3 finite numbers",
    ),
    (
        '{"shardlist": [{"url": "good-000000.tar", "nsamples": 4}], "classes": ["a", "b"], "mean": [0.5, 0.5, 0.5]}',
        "std=None: expected both mean and std, or neither",
    ),
]


@pytest.mark.parametrize(("write", "says"), BAD_INDEXES, ids=[b[1][:40] for b in BAD_INDEXES])
def test_a_bad_index_is_one_line_naming_the_file_and_field(make_cfg, tmp_path, write, says):
    good_shard(tmp_path)
    path = tmp_path / "train.json"
    if write is not None:
        path.write_text(write)
    with pytest.raises(CompactHydraException) as e:
        saturate.train(make_cfg("data=shards", f"data.train={path}", "data.val=null", "data.image_size=8"))
    assert f"data.train='{path}': {says}" in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 400


def test_an_index_that_counts_more_samples_than_its_shard_holds_names_the_field(tmp_path):
    from saturate.errors import DataError

    path = index(tmp_path, [{"url": good_shard(tmp_path, n=4), "nsamples": 9}])
    train, _ = load_shards(train=str(path), val=None, image_size=8, channels=3)
    with pytest.raises(DataError, match=r"shardlist\[0\].nsamples=9, but .*good-000000.tar holds 4 samples"):
        train.__getitems__([0])


def test_a_class_outside_the_index_is_one_message_naming_the_sample(tmp_path):
    from saturate.errors import DataError

    write_shard(tmp_path / "s-000000.tar", [(png(8, 8), b"0"), (png(8, 8), b"7")])
    train, _ = load_shards(
        train=str(index(tmp_path, [{"url": "s-000000.tar", "nsamples": 2}])), val=None, image_size=8, channels=3
    )
    with pytest.raises(DataError, match=r"sample s-000000.tar#1: class 7, outside the index's 2 classes"):
        train.__getitems__([0, 1])


def test_a_sample_that_does_not_decode_is_skipped_named_and_left_out_next_time(make_cfg, tmp_path, caplog):
    """Issue 25, item 6: a decompression bomb (what PIL refuses) and random bytes in a shard
    skip their samples, as an image folder's broken files are: the run trains to the end
    with its checkpoints, names them, counts them, and the next start leaves them out."""
    samples = [(png(8, 8), str(i % 2).encode()) for i in range(40)]
    samples[5] = (png(20000, 20000), b"1")  # 400 M pixels: PIL's DecompressionBombError
    samples[33] = (b"\x89PNG not really", b"0")
    write_shard(tmp_path / "t-000000.tar", samples)
    write_shard(tmp_path / "v-000000.tar", [(png(8, 8), str(i % 2).encode()) for i in range(16)])
    path, val = index(tmp_path, [{"url": "t-000000.tar", "nsamples": 40}]), tmp_path / "val.json"
    val.write_text(json.dumps({"shardlist": [{"url": "v-000000.tar", "nsamples": 16}], "classes": ["a", "b"]}))
    overrides = [
        "data=shards",
        f"data.train={path}",
        f"data.val={val}",
        "data.image_size=8",
        "model.width=8",
        "loader.batch_size=8",
        "trainer.limit_train_batches=-1",
        "trainer.limit_val_batches=-1",
    ]
    cfg = make_cfg(*overrides, "loader.num_workers=2")
    metrics = saturate.train(cfg)
    assert metrics["data/skipped_files"] == 2 and (Path(cfg.run_dir) / "checkpoints" / "best.pt").is_file()
    assert (
        "t-000000.tar#5: not a readable image (DecompressionBombError" in caplog.text
        and "t-000000.tar#33" in caplog.text
    )
    caplog.clear()
    again, _ = load_shards(train=str(path), val=None, image_size=8, channels=3)
    assert again.notes["data/skipped_files"] == 2 and again.skipped.files == {5, 33}  # from the start
    x, y = again.__getitems__(list(range(40)))
    assert int(x[5].max()) == 7 and "skipping" not in caplog.text  # slot 5 took sample 6, named nowhere again


def test_make_shards_refuses_what_the_reader_would(tmp_path):
    """A decompression bomb passes a check of its first and last bytes; the check now reads the
    PNG's size too, so make_shards skips and names it rather than writing it into a shard."""
    write_digits(tmp_path / "folder", size=8, fmt="png")
    (tmp_path / "folder" / "3" / "bomb.png").write_bytes(png(20000, 20000))
    done = python("-m", "saturate", "make-shards", tmp_path / "folder", tmp_path / "shards", timeout=300)
    assert done.returncode == 0, done.stderr
    assert (
        "1 broken files skipped" in done.stdout
        and "bomb.png" in done.stderr
        and "DecompressionBombError" in done.stderr
    )


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
    (tmp_path / "evil.json").write_text(
        json.dumps({"shardlist": [{"url": "evil-000000.tar", "nsamples": 1}], "classes": ["a", "b"]})
    )
    train, _ = load_shards(train=str(tmp_path / "evil.json"), val=None, image_size=8, channels=3)
    x, y = train.__getitems__([0])
    assert y.tolist() == [1] and int(x.max()) == 9 and not (tmp_path / "pwned").exists()


def test_shards_are_shuffled_a_few_at_a_time_the_same_way_on_every_rank():
    """A permutation that is a function of (seed, epoch); its first 4 shards' worth of samples
    come from 4 shards (a worker keeps few open); the ranks' shares are disjoint and cover it."""
    from saturate.data.loader import ResumableSampler

    class Sharded(torch.utils.data.Dataset):
        sample_groups = [100] * 12 + [37]

        def __len__(self):
            return sum(self.sample_groups)

    def share(rank, epoch=0):
        sampler = ResumableSampler(Sharded(), batch_size=10, seed=5, rank=rank, world_size=2, keyed=False)
        sampler.set_epoch(epoch)
        return list(sampler)

    first, second = share(0), share(1)
    # padded by one to equal shares, as DistributedSampler
    assert sorted(first + second) == sorted([*range(1237), first[0]])
    assert share(0) == first and share(0, epoch=1) != first
    # the order before the ranks took their shares
    together = [i for pair in zip(first, second, strict=True) for i in pair]
    assert len({i // 100 for i in together[:400]}) <= 4
