"""Image folders at scale: the cheap check and its cache, the O(files) split, the decoder's
pixels against PIL's, statistics without copies. Real files on disk throughout."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from saturate.data import decode, image_folder, image_index
from saturate.data.base import channel_stats
from saturate.data.decode import decode_file
from saturate.data.image_folder import _split, load_image_folder
from saturate.data.image_index import PathTable
from saturate.errors import ConfigError, DataError

SETTINGS = {"image_size": 16, "channels": 3, "val_fraction": 0.25, "split_seed": 0}


def photo(size=(40, 30), seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    smooth = rng.integers(0, 256, (size[1] // 5 + 1, size[0] // 5 + 1, 3), dtype=np.uint8)
    return Image.fromarray(smooth).resize(size, Image.BILINEAR)


def make_folder(root, per_class=6, classes=("cat", "dog"), fmt="jpg"):
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            photo(seed=c * 100 + i).save(root / name / f"{i:02d}.{fmt}")
    return root


def load(root, cache, **kw):
    return load_image_folder(
        root=str(root), strict=kw.pop("strict", False), index_cache=str(cache), **{**SETTINGS, **kw}
    )


def broken_folder(root):
    """12 readable images in two classes, and four broken files of four kinds."""
    root = make_folder(root)
    good = (root / "cat" / "00.jpg").read_bytes()
    (root / "cat" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "cat" / "noise.jpg").write_bytes(os.urandom(3000))
    (root / "dog" / "notes.txt").write_text("not an image\n")
    png = root / "dog" / "cut.png"
    photo().save(png)
    png.write_bytes(png.read_bytes()[:-30])
    return root, {str(root / "cat/truncated.jpg"), str(root / "cat/noise.jpg"), str(root / "dog/notes.txt"), str(png)}


def named_in(caplog) -> set[str]:
    return {r.getMessage().split(" ")[1].rstrip(":") for r in caplog.records if r.getMessage().startswith("skipping ")}


def every_batch(dataset, workers: int) -> list:
    """One pass over `dataset` through a real DataLoader (worker processes when workers > 0),
    polled after each batch as saturate's loader does."""
    from torch.utils.data import DataLoader

    from saturate.data.loader import already_collated

    batches = []
    for batch in DataLoader(dataset, batch_size=3, num_workers=workers, collate_fn=already_collated):
        dataset.poll()
        batches.append(batch)
    return batches


def test_files_are_not_opened_at_start_up_and_broken_ones_are_skipped_when_met(tmp_path, caplog, monkeypatch):
    """Workers meet each broken file once: it is skipped (its slot takes the next readable
    image: full batches), named and counted by the main process, and the next start leaves it
    out without opening it; the split of the readable files does not move."""
    root, broken = broken_folder(tmp_path / "imgs")
    monkeypatch.setattr(image_folder, "STATS_SAMPLES", 1)  # the statistics read one image: the workers meet the rest
    train, val = load(root, tmp_path / "cache")
    assert len(train) + len(val) == 16  # listed, not opened
    for dataset in (train, val):
        for x, y in every_batch(dataset, workers=2):
            assert x.shape[1:] == (3, 16, 16) and len(x) == len(y) and len(x) in (3, len(dataset) % 3)
    assert named_in(caplog) == broken and train.notes["data/skipped_files"] == 4 and val.notes is train.notes

    caplog.clear()
    again, again_val = load(root, tmp_path / "cache")
    assert named_in(caplog) == broken and again.notes["data/skipped_files"] == 4  # named at start-up this time
    assert len(again) + len(again_val) == 12
    assert [again.path(i) for i in range(len(again))] == [
        p for p in map(train.path, range(len(train))) if p not in broken
    ]
    # known: no check needed
    with pytest.raises(DataError, match=r"data.strict=true: .*noise.jpg is not a readable image"):
        load(root, tmp_path / "cache", strict=True)


def test_check_names_every_broken_file_at_start_up_and_goes_on(tmp_path, caplog):
    root, broken = broken_folder(tmp_path / "imgs")
    train, val = load(root, tmp_path / "cache", check=True)
    assert named_in(caplog) == broken and train.notes["data/skipped_files"] == 4 and len(train) + len(val) == 12
    with pytest.raises(ConfigError, match="data.check"):
        load(root, tmp_path / "cache", check="yes")


def test_a_broken_slot_takes_the_next_readable_image(tmp_path):
    root = make_folder(tmp_path / "imgs")
    train, _ = load(root, tmp_path / "cache")
    Path(train.path(1)).write_bytes(b"\xff\xd8\xff" + os.urandom(500))  # damaged after start-up
    expected, expected_y = train.__getitems__([2])
    x, y = train.__getitems__([0, 1, 3])
    assert torch.equal(x[1], expected[0]) and y[1] == expected_y[0] and train.skipped.files == {int(train.chosen[1])}
    train.chosen = train.chosen[1:2]  # a data set of that one file
    with pytest.raises(DataError, match="none of the 1 images .* can be read"):
        train.__getitems__([0])


def test_strict_checks_every_file_at_start_up_once(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "imgs")
    calls = []
    real = image_index._looks_whole
    monkeypatch.setattr(image_index, "_looks_whole", lambda path: calls.append(path) or real(path))
    load(root, tmp_path / "cache")
    assert calls == []  # not strict: nothing checked
    first, _ = load(root, tmp_path / "cache", strict=True)
    assert len(calls) == 12
    calls.clear()
    load(root, tmp_path / "cache", strict=True)
    assert calls == []  # checked files are known checked
    good = (root / "dog" / "03.jpg").read_bytes()
    (root / "dog" / "new.jpg").write_bytes(good[:200])  # a file added: its directory changed
    with pytest.raises(DataError, match=r"data.strict=true: .*new.jpg is not a readable image"):
        load(root, tmp_path / "cache", strict=True)
    assert calls == [str(root / "dog" / "new.jpg")]
    third, _ = load(root, tmp_path / "cache")  # not strict: the new file is known broken, left out
    assert third.notes["data/skipped_files"] == 1 and len(third) == len(first)


def test_a_second_start_reads_the_cache(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "imgs")
    first, _ = load(root, tmp_path / "cache")
    assert list((tmp_path / "cache").glob("*.npz"))
    with monkeypatch.context() as m:  # no directory is listed again and no image decoded: the cache answers
        m.setattr(image_index.os, "scandir", None)
        m.setattr(decode, "decode_into", None)
        second, _ = load(root, tmp_path / "cache")
    assert second.mean == first.mean  # statistics from the cache
    assert [second.path(i) for i in range(len(second))] == [first.path(i) for i in range(len(first))]


def test_a_file_damaged_in_place_fails_a_strict_run_when_read(tmp_path):
    root = make_folder(tmp_path / "imgs")
    train, _ = load(root, tmp_path / "cache", strict=True)
    victim = train.path(0)
    Path(victim).write_bytes(b"\xff\xd8\xff" + os.urandom(500))  # rewritten in place: the cache cannot know
    with pytest.raises(DataError, match=f"cannot read {victim} .*whole at start-up.*remove or replace it"):
        train.__getitems__([0, 1])


def test_a_skip_that_cannot_be_recorded_stops_the_run(tmp_path):
    root = make_folder(tmp_path / "imgs")
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    train, _ = load(root, tmp_path / "cache")  # the index cannot be kept: a warning
    victim = train.path(0)
    Path(victim).write_bytes(os.urandom(500))
    with pytest.raises(DataError, match=f"cannot read {victim} .*cannot record it as skipped"):
        train.__getitems__([0])


def test_the_resident_copy_leaves_broken_files_out(tmp_path, monkeypatch):
    root, broken = broken_folder(tmp_path / "imgs")
    monkeypatch.setattr(image_folder, "STATS_SAMPLES", 1)
    train, _ = load(root, tmp_path / "cache")
    in_train = [i for i in range(len(train)) if train.path(i) in broken]
    resident = train.materialize()
    assert len(resident) == len(train) - len(in_train) > 0 and train.notes["data/skipped_files"] == len(in_train)
    kept = [i for i in range(len(train)) if i not in in_train]
    assert torch.equal(resident.inputs[0], train[kept[0]][0]) and torch.equal(resident.targets, train.labels[kept])


def test_a_damaged_cache_is_rebuilt_not_fatal(tmp_path, caplog):
    root = make_folder(tmp_path / "imgs")
    load(root, tmp_path / "cache")
    (cached,) = (tmp_path / "cache").glob("*.npz")
    cached.write_bytes(b"PK\x03\x04 not a zip")
    train, _ = load(root, tmp_path / "cache")
    assert len(train) == 8 and "is damaged (BadZipFile" in caplog.text
    assert np.load(cached, allow_pickle=False)["version"] == image_index.VERSION  # written again


def test_the_split_is_the_earlier_stratified_split_in_linear_time():
    labels = np.repeat(np.arange(7), [5, 9, 13, 2, 40, 1, 8])
    train_idx, val_idx = _split(labels, 7, 0.2, split_seed=3)
    order = list(range(len(labels)))  # the per-class rescan this replaces
    random.Random(3).shuffle(order)
    expected = set()
    for label in range(7):
        members = [i for i in order if labels[i] == label]
        expected.update(members[: round(len(members) * 0.2)])
    assert set(val_idx.tolist()) == expected and sorted([*train_idx, *val_idx]) == list(range(len(labels)))


@pytest.mark.parametrize(("fmt", "side", "tolerance"), [("jpg", 300, 0.01), ("png", 300, 0.01), ("jpg", 64, 5.0)])
def test_decoded_pixels_match_pil_bilinear(tmp_path, fmt, side, tolerance):
    """The same pixels as PIL's decode + bilinear resize (a real photo, 640x427); within 5
    levels on average where the JPEG is at least twice the size asked for and is scaled
    down in the DCT domain first (measured: 1.4 at 64 px, 3.3 at 32, 4.8 at 150)."""
    from sklearn.datasets import load_sample_image

    path = tmp_path / f"x.{fmt}"
    Image.fromarray(load_sample_image("china.jpg")).save(path)
    ours = decode_file(str(path), side, 3)
    reference = np.asarray(Image.open(path).convert("RGB").resize((side, side), Image.BILINEAR))
    assert ours.shape == (3, side, side) and ours.dtype == torch.uint8
    assert (ours.permute(1, 2, 0).int() - torch.from_numpy(reference.copy()).int()).abs().float().mean() <= tolerance
    grey = decode_file(str(path), 8, 1)
    assert grey.shape == (1, 8, 8)


def test_a_batch_is_decoded_into_one_tensor(tmp_path):
    train, _ = load(make_folder(tmp_path / "imgs"), tmp_path / "cache")
    x, y = train.__getitems__([0, 3, 5])
    assert (
        x.shape == (3, 3, 16, 16)
        and x.dtype == torch.uint8
        and torch.equal(x[1], train[3][0])
        and y.tolist() == train.labels[[0, 3, 5]].tolist()
    )


def test_channel_stats_stream_in_bounded_pieces():
    images = torch.randint(0, 256, (11, 3, 9, 7), dtype=torch.uint8)
    x = images.double().div(255).transpose(0, 1).flatten(1)
    expected_mean, expected_std = x.mean(1), x.std(1)
    for given in (images, iter(list(images))):
        mean, std = channel_stats(given, chunk_elements=50)  # far smaller than one image
        assert torch.allclose(torch.tensor(mean, dtype=torch.float64), expected_mean)
        assert torch.allclose(torch.tensor(std, dtype=torch.float64), expected_std)


def test_path_table_holds_any_file_name():
    names = ["a/b.jpg", "ü/ß.png", "raw\udcff.jpg", ""]
    table = PathTable.of(names)
    assert [table[i] for i in range(len(table))] == names and len(table) == 4


@pytest.mark.slow
def test_the_benchmark_prints_start_up_memory_and_images_per_second():
    from tests.conftest import ROOT, python

    args = [
        "--files",
        "300",
        "--classes",
        "4",
        "--rounds",
        "1",
        "--batches",
        "1",
        "--batch",
        "16",
        "--workers",
        "0",
        "--cold",
    ]
    script = str(ROOT / "scripts/bench_image_folder.py")
    result = python(script, *args, timeout=300, fresh=True)  # its start-up figures are a fresh process's
    assert result.returncode == 0, result.stderr[-2000:]
    for line in (
        "saturate first",
        "saturate cached",
        "projected to 1,281,167 files",
        "images/s, 0 workers, batch 16, uint8 64x64, files out of the page cache",
    ):
        assert line in result.stdout, result.stdout


def test_cached_statistics_belong_to_the_split_that_chose_the_training_images(tmp_path):
    root = make_folder(tmp_path / "imgs", per_class=10)
    first, _ = load(root, tmp_path / "cache", split_seed=0)
    other, _ = load(root, tmp_path / "cache", split_seed=1)
    fresh, _ = load(root, tmp_path / "none", split_seed=1)
    assert other.mean == fresh.mean and other.mean != first.mean  # not the other split's figures from the cache


def test_a_file_that_cannot_be_opened_is_skipped_and_named(tmp_path, caplog, monkeypatch):
    """As root (CI) permissions do not stop reads, so the refusal is injected where files
    are opened (os.open: a batch's reads and the strict check; PIL's open: the full decode)."""
    root = make_folder(tmp_path / "imgs")
    locked = str(root / "dog" / "02.jpg")
    real_read, real_open, real_pil = image_folder.read, os.open, Image.open

    def guarded(real):
        def opener(path, *args, **kw):
            if str(path) == locked:
                raise PermissionError(13, "Permission denied", locked)
            return real(path, *args, **kw)

        return opener

    monkeypatch.setattr(image_folder, "read", guarded(real_read))
    monkeypatch.setattr(image_index.os, "open", guarded(real_open))
    monkeypatch.setattr(image_index.Image, "open", guarded(real_pil))
    train, val = load(root, tmp_path / "cache")
    for dataset in (train, val):
        every_batch(dataset, workers=0)
    assert (
        train.notes["data/skipped_files"] == 1
        and f"skipping {locked}: not a readable image (PermissionError" in caplog.text
    )
    with pytest.raises(DataError, match=f"data.strict=true: {locked} is not a readable image .PermissionError"):
        load(root, tmp_path / "fresh", strict=True)


@pytest.mark.parametrize(("stored", "channels_last"), [(16, True), (40, False)])
def test_the_batch_layout_follows_what_the_decoder_writes(tmp_path, stored, channels_last):
    """Files already at image_size: decoded straight into a channels-last batch; files that
    are resized: a contiguous batch (the resize writes channels first). Same pixels either way."""
    root = tmp_path / "imgs"
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(4):
            photo(size=(stored, stored), seed=i).save(root / c / f"{i}.jpg")
    train, _ = load(root, tmp_path / "cache")
    x, _ = train.__getitems__([0, 1, 2])
    assert x.shape == (3, 3, 16, 16) and x.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert x.is_contiguous() != channels_last and all(torch.equal(x[k], train[k][0]) for k in range(3))


def test_read_many_returns_each_files_bytes_or_its_error_in_order(tmp_path):
    from saturate.data.decode import read_many

    paths = []
    for i in range(5):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i]) * (i + 1))
        paths.append(str(tmp_path / f"{i}.bin"))
    paths.insert(2, str(tmp_path / "missing.bin"))
    open_before = len(os.listdir("/proc/self/fd"))
    out = read_many(paths, window=2)  # more files than one window holds open
    assert isinstance(out[2], FileNotFoundError) and out[:2] + out[3:] == [bytes([i]) * (i + 1) for i in range(5)]
    assert len(os.listdir("/proc/self/fd")) == open_before  # every descriptor closed
