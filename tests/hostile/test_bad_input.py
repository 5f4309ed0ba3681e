"""Bad input gets a clear answer: each of these ends with a short message naming the
problem (a UserError, which train.py prints as one message without a traceback), and nothing
is lost."""

from __future__ import annotations

import errno
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchmetrics
from hydra.errors import CompactHydraException

import saturate
from saturate.commands.make_image_folder import write_digits
from saturate.errors import DataError
from saturate.tasks.classification import Classification
from saturate.tasks.regression import Regression
from tests.conftest import ROOT, TINY, compose_config, python, read_metrics, run_cli


def one_class_folder(tmp: Path) -> list[str]:
    write_digits(tmp / "all", size=8)
    for d in (tmp / "all").iterdir():
        if d.name != "3":
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
    return ["data=image_folder", f"data.root={tmp / 'all'}"]


def broken_folder(tmp: Path) -> list[str]:
    write_digits(tmp / "broken", size=8, corrupt=1)
    return ["data=image_folder", f"data.root={tmp / 'broken'}", "data.strict=true"]


def garbage_checkpoint(tmp: Path) -> list[str]:
    (tmp / "garbage.pt").write_bytes(b"\x00not a checkpoint" * 100)
    return [f"trainer.resume={tmp / 'garbage.pt'}"]


def foreign_checkpoint(tmp: Path) -> list[str]:
    torch.save({"weights": torch.zeros(3)}, tmp / "foreign.pt")
    return [f"trainer.resume={tmp / 'foreign.pt'}"]


def empty_run_dir(tmp: Path) -> list[str]:
    (tmp / "empty_run" / "checkpoints").mkdir(parents=True)
    return [f"trainer.resume={tmp / 'empty_run'}"]


def incompatible_checkpoint(tmp: Path) -> list[str]:
    from tests.conftest import compose_config

    saturate.train(compose_config([*TINY, f"run_dir={tmp / 'small'}", "model.width=8"]))
    return [f"trainer.resume={tmp / 'small'}", "model.width=16"]


def empty_class_folder(tmp: Path) -> list[str]:
    write_digits(tmp / "gap", size=8)
    (tmp / "gap" / "zz_empty").mkdir()
    return ["data=image_folder", f"data.root={tmp / 'gap'}"]


def cache_under_a_file(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("not a folder")
    return ["loader.batch_size=auto", f"batch_search.cache={tmp / 'afile' / 'cache.json'}"]


def run_dir_under_a_file(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("not a folder")
    return [f"run_dir={tmp / 'afile' / 'run'}"]


class HalfHeight(torch.nn.Module):
    """A user's augmentation that changes the image size (c79, c84)."""

    def forward(self, x):
        return x[:, :, : x.shape[2] // 2]


class ToLong(torch.nn.Module):
    """... that changes the dtype (c80)."""

    def forward(self, x):
        return (x * 255).long()


class Poisons(torch.nn.Module):
    """... that produces NaN (c83)."""

    def forward(self, x):
        return x * float("nan")


def transform(name: str, placement: str = "gpu") -> list[str]:
    target = f"tests.hostile.test_bad_input.{name}"
    return [
        "augmentation=kornia",
        f"augmentation.placement={placement}",
        f"augmentation.transforms=[{{_target_: {target}}}]",
    ]


# (name, overrides or a function of tmp_path giving them, what the message must say)
BAD_INPUTS = [
    (
        "an augmentation that changes the image size, on the device",
        transform("HalfHeight"),
        "augmentation.transforms[0]: HalfHeight turns images (2, 1, 8, 8) into (2, 1, 4, 8); a transform must keep "
        "their size",
    ),
    (
        "an augmentation that changes the image size, in the workers",
        transform("HalfHeight", "cpu"),
        "augmentation.transforms[0]: HalfHeight turns images (2, 1, 8, 8) into (2, 1, 4, 8)",
    ),
    (
        "an augmentation that changes the dtype",
        transform("ToLong"),
        "augmentation.transforms[0]: ToLong turns float32 images into int64; a transform must return floats in [0, 1]",
    ),
    (
        "an augmentation that makes NaN",
        transform("Poisons"),
        "augmentation.transforms[0]: Poisons turns finite images into NaN or inf",
    ),
    ("negative seed", ["trainer.seed=-1"], "trainer.seed=-1: expected an integer in [0, 4294967295]"),
    (
        "seed above 2**32 - 1",
        ["trainer.seed=4294967296"],
        "trainer.seed=4294967296: expected an integer in [0, 4294967295]",
    ),
    ("negative split seed", ["data.split_seed=-1"], "data.split_seed=-1: expected an integer in [0, 4294967295]"),
    (
        "unresolvable interpolation",
        ["trainer.max_epochs=${oops}"],
        "trainer.max_epochs='${oops}': expected a value that resolves",
    ),
    ("a removed group node", ["~trainer"], "trainer='(removed)': expected the trainer node: it cannot be removed"),
    (
        "an optimizer that is a module",
        ["optim.optimizer._target_=torch.nn.Identity"],
        "builds a Identity, not a torch.optim.Optimizer",
    ),
    (
        "a model that is a dict",
        ["model._target_=builtins.dict", "~model.width", "~model.norm"],
        "model: dict is not a torch.nn.Module",
    ),
    (
        "rotation 400 on the device",
        ["augmentation=gpu", "augmentation.rotation=400"],
        "augmentation.rotation=400.0: expected a number",
    ),
    (
        "rotation 400 in the workers",
        ["augmentation=cpu", "augmentation.rotation=400"],
        "augmentation.rotation=400.0: expected a number",
    ),
    (
        "rotation NaN",
        ["augmentation=gpu", "augmentation.rotation=nan"],
        "augmentation.rotation=nan: expected a finite number",
    ),
    ("monitor interval NaN", ["monitor.interval_s=nan"], "monitor.interval_s=nan: expected a finite number"),
    ("gradient clip NaN", ["trainer.grad_clip=nan"], "trainer.grad_clip=nan: expected a finite number"),
    ("loader timeout NaN", ["loader.timeout_s=nan"], "loader.timeout_s=nan: expected a finite number"),
    ("learning rate NaN", ["optim.optimizer.lr=nan"], "optim.optimizer.lr=nan: expected a finite number"),
    ("a new top-level key", ["+new.key=1"], "new={'key': 1}: expected one of the top-level keys"),
    (
        "accumulate more than the batch",
        ["trainer.accumulate=64"],
        "trainer.accumulate=64: expected at most loader.batch_size (32)",
    ),
    (
        "a synthetic set too large for memory",
        ["data=synthetic", "data.num_train=2000000000"],
        "GiB in memory, more than the",
    ),
    (
        "a last batch of one with BatchNorm",
        ["loader.drop_last=false", "loader.batch_size=359", "trainer.limit_train_batches=-1"],
        "loader.drop_last=False: expected true: the last training batch would hold 1 sample",
    ),
    ("an empty class folder", empty_class_folder, "zz_empty holds no files"),
    ("an empty data.root", ["data=image_folder", "data.root="], "data.root='': expected a folder of class sub-folders"),
    ("a cache path under a file", cache_under_a_file, "batch_search.cache: cannot write to"),
    ("a run dir under a file", run_dir_under_a_file, "run_dir: cannot write to"),
    ("negative workers", ["loader.num_workers=-1"], "loader.num_workers=-1: expected an integer >= 0 or 'auto'"),
    ("zero batch size", ["loader.batch_size=0"], "loader.batch_size=0: expected an integer >= 1"),
    (
        "batch larger than the data",
        ["loader.batch_size=5000"],
        "loader.batch_size=5000: larger than the training set (1437 samples)",
    ),
    ("negative loader timeout", ["loader.timeout_s=-1"], "loader.timeout_s=-1.0"),
    ("eval interval 0", ["trainer.eval_interval=0"], "trainer.eval_interval=0: expected an integer >= 1"),
    (
        "memory fraction over 1",
        ["device.memory_fraction=1.5"],
        "device.memory_fraction=1.5: expected a number in (0, 1]",
    ),
    ("unknown precision", ["precision.mode=fp8"], "precision.mode='fp8': expected one of auto, amp, bf16, fp16, fp32"),
    (
        "fp16 loss scale below one",
        ["precision.init_scale=0.5"],
        "precision.init_scale=0.5: expected a finite number >= 1",
    ),
    (
        "flip probability over 1",
        ["augmentation=gpu", "augmentation.hflip=1.5"],
        "augmentation.hflip=1.5: expected a probability in [0, 1]",
    ),
    (
        "unordered schedule",
        ["augmentation=progressive", "augmentation.schedule=[{from_epoch:0,preset:minimal},{from_epoch:0,preset:b}]"],
        "strictly increasing",
    ),
    ("unknown schedule", ["optim.schedule=linear"], "optim.schedule='linear': expected one of cosine, constant"),
    (
        "impossible optimizer value",
        ["optim.optimizer.lr=-1"],
        "optim.optimizer.lr=-1: expected a value torch.optim.SGD takes (Invalid learning rate: -1",
    ),
    (
        "misspelt model argument",
        ["+model.widht=3"],
        "model.widht=3: expected an argument of saturate.models.SmallCNN: width, norm",
    ),
    (
        "bad model value",
        ["model.norm=layer"],
        "model: cannot build saturate.models.SmallCNN: model.norm='layer': expected batch, group",
    ),
    ("validation share of 1.5", ["data.val_fraction=1.5"], "data.val_fraction=1.5: expected a number in (0, 1)"),
    (
        "CIFAR-10 not there",
        ["data=cifar10", "data.root=/nonexistent/cifar"],
        "data.root='/nonexistent/cifar': no CIFAR-10 python",
    ),
    (
        "image folder not there",
        ["data=image_folder", "data.root=/nonexistent/images"],
        "data.root='/nonexistent/images': no such folder",
    ),
    ("image folder with one class", one_class_folder, "found 1 class sub-folder(s)"),
    ("broken file in strict mode", broken_folder, "data.strict=true: "),
    (
        "resident loader with per-sample augmentation",
        ["loader=resident", "augmentation=cpu"],
        "augmentation.placement='cpu'",
    ),
    (
        "early stopping against its metric's direction",
        [
            "callbacks=[early_stopping]",
            "callbacks.early_stopping.monitor=val/loss",
            "callbacks.early_stopping.mode=max",
        ],
        "callbacks.early_stopping.mode='max': expected min or auto for callbacks.early_stopping.monitor=val/loss "
        "(lower is better)",
    ),
    (
        "plateau against its metric's direction",
        ["callbacks=[plateau]", "callbacks.plateau.monitor=val/acc", "callbacks.plateau.mode=min"],
        "callbacks.plateau.mode='min': expected max or auto for callbacks.plateau.monitor=val/acc (higher is better)",
    ),
    (
        "the monitored metric removed",
        ["+task.metrics.acc=null"],
        "checkpoint.monitor='val/acc': expected a metric the run logs (train/loss, val/loss): "
        "task.metrics.acc=null removed it",
    ),
    (
        "predictions of a test split the data lacks",
        ["trainer.predict=test"],
        "trainer.predict='test': expected val: the data has no test split",
    ),
    (
        "unknown monitored metric",
        ["checkpoint.monitor=val/f1"],
        "checkpoint.monitor='val/f1': expected auto or a metric the run logs: train/loss, val/loss, val/acc",
    ),
    (
        "resume from a missing file",
        ["trainer.resume=/nonexistent/last.pt"],
        "trainer.resume: no checkpoint at /nonexistent/last.pt",
    ),
    ("resume from an unreadable file", garbage_checkpoint, "cannot read"),
    ("resume from a file that is not a checkpoint", foreign_checkpoint, "is not a saturate checkpoint"),
    ("resume from a run dir without checkpoints", empty_run_dir, "no checkpoint in"),
    (
        "resume with an incompatible model",
        incompatible_checkpoint,
        "does not fit this run's model: Error(s) in loading state_dict",
    ),
]


@pytest.mark.parametrize(("name", "given", "says"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_one_short_message(make_cfg, tmp_path, name, given, says):
    overrides = given(tmp_path) if callable(given) else given
    with pytest.raises(CompactHydraException) as err:  # Hydra prints these as the message alone
        saturate.train(make_cfg(*overrides))
    message = str(err.value)
    assert says in message
    assert len(message) < 600 and "Traceback" not in message


def test_an_unreadable_class_folder_is_an_error_naming_it(make_cfg, tmp_path, monkeypatch):
    """As root (CI) permissions do not stop reads, so the refusal is injected where the
    listing meets it."""
    import saturate.data.image_index as image_index

    write_digits(tmp_path / "locked", size=8)
    real_scandir = os.scandir

    def scandir(path):
        if str(path).endswith("/5"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(image_index.os, "scandir", scandir)
    with pytest.raises(
        CompactHydraException,
        match=r"cannot read the folder .*locked/5 \(Permission denied\); its images would be lost",
    ):
        saturate.train(make_cfg("data=image_folder", f"data.root={tmp_path / 'locked'}"))


def test_a_damaged_batch_size_cache_is_rebuilt_not_fatal(make_cfg, tmp_path):
    cache = tmp_path / "cache.json"
    cache.write_text("{ not json")
    metrics = saturate.train(make_cfg("loader.batch_size=auto", f"batch_search.cache={cache}", "batch_search.max=64"))
    assert metrics["progress/step"] == 3 and json.loads(cache.read_text())  # searched, and the cache is whole again


def test_a_failed_run_records_every_problem(make_cfg):
    cfg = make_cfg("loader.num_workers=-1", "trainer.eval_interval=0")
    with pytest.raises(CompactHydraException):
        saturate.train(cfg)
    error = json.loads((Path(cfg.run_dir) / "metrics.json").read_text())["error"]
    assert "loader.num_workers=-1: expected an integer >= 0 or 'auto'" in error and "trainer.eval_interval=0" in error


def test_a_run_dir_hydra_cannot_create_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    result = run_cli(*TINY, f"hydra.run.dir={tmp_path / 'afile' / 'run'}", cwd=tmp_path, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"error: cannot write {tmp_path / 'afile'}" in result.stderr


def test_there_are_at_least_twenty():
    assert len(BAD_INPUTS) >= 20


def test_cuda_requested_without_cuda(make_cfg):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(CompactHydraException, match="device.type='cuda': no CUDA device is available"):
        saturate.train(make_cfg("device=cuda"))


def test_a_folder_in_a_checkpoints_place_is_named_and_nothing_said_intact(tmp_path):
    """Red team round 4, c108: best.pt a folder said "the previous one is intact"."""
    from saturate.checkpoint.files import CheckpointError, atomic_save

    (tmp_path / "best.pt").mkdir()
    with pytest.raises(CheckpointError) as err:
        atomic_save({"step": 1}, tmp_path / "best.pt")
    assert str(err.value).endswith("best.pt: Is a directory; a folder is in its place: move it away")
    assert not list(tmp_path.glob(".*.tmp"))


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(make_cfg, monkeypatch):
    cfg = make_cfg("trainer.max_epochs=2", "trainer.checkpoint_interval=1")  # a save at each epoch's end
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) > 4:  # the first epoch's last.pt and best.pt go through (a file and a directory fsync each)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CompactHydraException) as err:
        saturate.train(cfg)
    last = Path(cfg.run_dir) / "checkpoints" / "last.pt"
    assert str(err.value) == f"cannot write checkpoint {last}: No space left on device; the previous one is intact"
    monkeypatch.undo()
    assert torch.load(last, weights_only=False)["step"] == 3
    assert not list(last.parent.glob(".*.tmp"))


FILE_SIZE_LIMIT = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_real_write_limit_during_a_save_is_a_clean_error(tmp_path):
    """The kernel refuses the write (RLIMIT_FSIZE), as a full disk would: one message, no traceback."""
    run = ["-c", FILE_SIZE_LIMIT, ROOT / "train.py", *TINY, "model.width=64", f"hydra.run.dir={tmp_path / 'run'}"]
    result = python(*run, cwd=tmp_path, timeout=240)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert (
        f"cannot write checkpoint {tmp_path / 'run' / 'checkpoints' / 'last.pt'}: File too large; no earlier one "
        "was written" in result.stderr  # the first save: nothing to call intact
    )


def test_an_image_with_no_direct_conversion_is_read_through_rgb(make_cfg, tmp_path):
    """PIL converts LAB to RGB but not to greyscale: the check and the decoder go through RGB,
    so the file is used, not skipped (strict: not an error)."""
    from PIL import Image

    write_digits(tmp_path / "lab", size=8)
    Image.new("LAB", (8, 8), (50, 0, 0)).save(tmp_path / "lab" / "3" / "lab.tif")
    metrics = saturate.train(
        make_cfg(
            "data=image_folder",
            f"data.root={tmp_path / 'lab'}",
            "data.channels=1",
            "data.strict=true",
            "data.image_size=8",
        )
    )
    assert metrics["data/skipped_files"] == 0


# -- files saturate wrote itself, tampered (issue 25, item 9): a damaged cache or log is rebuilt
# or passed over with a warning naming the file; never a traceback, never a run that cannot start


def image_folder_cache(root: Path):
    from saturate.data.image_index import IndexCache, default_cache

    return IndexCache(default_cache(), root, 3)


SKIP_LOG_LINES = [
    b"[" * 200_000 + b"]" * 200_000,  # nested past the parser's recursion limit
    b'[1e999, "3/000.png", "why"]',  # an index of inf
    b'[true, "3/000.png", "why"]',
    b'[0, 7, "why"]',
    b'{"a": 1}',
    b"\xff\xfe not utf-8",
    b'[0, "3/not-there.png", "a file the folder does not hold"]',
    b"x" * 200_000,
]


def test_a_tampered_skip_log_is_passed_over_line_by_line(make_cfg, tmp_path):
    write_digits(tmp_path / "folder", size=8)
    overrides = ["data=image_folder", f"data.root={tmp_path / 'folder'}", "data.image_size=8"]
    saturate.train(make_cfg(*overrides))
    log = Path(image_folder_cache(tmp_path / "folder").skip_log.path)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"\n".join(SKIP_LOG_LINES) + b"\n")
    for _ in range(2):  # and every later run of that folder
        metrics = saturate.train(make_cfg(*overrides))
        assert metrics["progress/step"] == 3 and metrics["data/skipped_files"] == 0


@pytest.mark.parametrize(
    "tamper",
    [
        lambda a: a.update(labels=a["labels"][:-5]),  # arrays of another length
        lambda a: a.update(good=a["good"].astype("int64")),
        lambda a: a.update(offsets=a["offsets"][::-1].copy()),
        lambda a: a.update(labels=a["labels"] + 50),  # class indices past the folder's classes
        lambda a: a.update(meta=np.frombuffer(b'{"bad": [], "directories": {}, "stats": {}}', dtype=np.uint8)),
        lambda a: a.update(
            meta=np.frombuffer(b'{"bad": {}, "directories": {}, "stats": {"8 0.2 0": [[0.5], [0.0]]}}', dtype=np.uint8)
        ),
    ],
    ids=["short-labels", "int-good", "reversed-offsets", "labels-out-of-range", "bad-list", "zero-std"],
)
def test_a_tampered_image_index_cache_is_rebuilt_with_a_warning(make_cfg, tmp_path, caplog, tamper):
    write_digits(tmp_path / "folder", size=8)
    overrides = ["data=image_folder", f"data.root={tmp_path / 'folder'}", "data.image_size=8"]
    first = saturate.train(make_cfg(*overrides))
    path = image_folder_cache(tmp_path / "folder").path
    with np.load(path, allow_pickle=False) as saved:
        arrays = {k: saved[k] for k in saved.files}
    tamper(arrays)
    np.savez(path.with_suffix(""), **arrays)  # np.savez adds .npz
    again = saturate.train(make_cfg(*overrides))
    assert f"image index cache {path} is damaged" in caplog.text
    assert again["progress/step"] == 3 and again["val/acc"] == pytest.approx(first["val/acc"])


# -- mistakes found at start-up, not mid-run (issue 25, items 8, 10 and 11): one message each


class Samples(torch.utils.data.Dataset):
    """(input, target) pairs made by `make(i)`, with optional attributes."""

    def __init__(self, n: int, make, **attributes):
        self.n, self.make = n, make
        self.__dict__.update(attributes)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.make(i)


def windows(i):
    return torch.full((6, 3), float(i % 5)), float(i % 5) / 5


def fit(*args, **kwargs):
    kwargs.setdefault("overrides", TINY)
    return saturate.fit(*args, **kwargs)


def mlp(out: int = 1):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(18, out))


def frozen():
    model = mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class Backwards(Regression):
    """A task whose better() gives no direction (c37): best.pt would be the worst."""

    def better(self, name: str) -> str:
        return "higher" if name == "mae" else super().better(name)


class MainMissing(Regression):
    """A task whose main metric is not among its metrics (c38)."""

    main = "nonexistent"


class Threes(Regression):
    """A task whose forward returns three things (c35)."""

    def forward(self, model, batch):
        loss, outputs = super().forward(model, batch)
        return loss, outputs, "extra"


class Narrow(Classification):
    """A task whose outputs do not fit its own metrics (c39): one column for 3 classes."""

    def own_metrics(self):
        return {"acc": torchmetrics.classification.MulticlassAccuracy(self.num_classes)}  # validating its arguments

    def forward(self, model, batch):
        loss, outputs = super().forward(model, batch)
        return loss, outputs[:, :1]


class ListedMetrics(Regression):
    """A task whose metrics() is a list (c36)."""

    def metrics(self):
        return list(super().metrics().values())


# (name, a function of the run dir that makes the mistake, what the message must say)
HOSTILE = [
    (
        "a task whose better() is neither max nor min",
        lambda d: fit(mlp(), Samples(64, windows), Samples(32, windows), task=Backwards(num_outputs=1), run_dir=d),
        "task: Backwards.better('mae') returned 'higher'; expected 'max' or 'min' (which way mae improves)",
    ),
    (
        "a task whose main metric it does not log",
        lambda d: fit(mlp(), Samples(64, windows), Samples(32, windows), task=MainMissing(num_outputs=1), run_dir=d),
        "task: MainMissing's main metric 'nonexistent' is not among its metrics (mae, rmse, r2)",
    ),
    (
        "a task whose forward returns three things",
        lambda d: fit(mlp(), Samples(64, windows), Samples(32, windows), task=Threes(num_outputs=1), run_dir=d),
        "task: Threes.forward() returns a tuple of 3; expected (loss, outputs)",
    ),
    (
        "a task whose outputs its metrics cannot take",
        lambda d: fit(
            mlp(3),
            Samples(64, lambda i: (windows(i)[0], i % 3), classes=["a", "b", "c"]),
            Samples(32, lambda i: (windows(i)[0], i % 3), classes=["a", "b", "c"]),
            task=Narrow(num_classes=3),
            run_dir=d,
        ),
        "task: Narrow's metrics cannot take its outputs (float32 (2, 1) for targets int64 (2,)): "
        "acc (MulticlassAccuracy) raised ValueError",
    ),
    (
        "a task whose metrics() is a list",
        lambda d: fit(mlp(), Samples(64, windows), Samples(32, windows), task=ListedMetrics(num_outputs=1), run_dir=d),
        "task: ListedMetrics.metrics() returned a list; expected a dict {name: torchmetrics metric}",
    ),
    (
        "validation targets of another shape",
        lambda d: fit(
            mlp(),
            Samples(64, windows),
            Samples(32, lambda i: (windows(i)[0], torch.zeros(2))),
            task="regression",
            run_dir=d,
        ),
        "data: validation targets are float32 (2,), training targets float32 (); they must match (the task and the "
        "metrics compare them alike): samples must match, not batches (the loader makes the batches: "
        "loader.eval_batch_size for evaluation)",
    ),
    (
        "a class index past the data's classes",
        lambda d: fit(
            mlp(2),
            Samples(64, lambda i: (windows(i)[0], i % 3), classes=["a", "b"], targets=[i % 3 for i in range(64)]),
            run_dir=d,
        ),
        "data: the training set's target 2 (sample 2; 21 such) is not a class index in [0, 1]: the data's "
        "`classes`/`num_classes` give 2",
    ),
    (
        "a validation class index past the training classes",
        lambda d: fit(
            mlp(2),
            Samples(64, lambda i: (windows(i)[0], i % 2)),
            Samples(16, lambda i: (windows(i)[0], 5), targets=[5] * 16),
            run_dir=d,
        ),
        "data: the validation set's target 5 (sample 0; 16 such) is not a class index in [0, 1]",
    ),
    (
        "a loss that returns one value per sample",
        lambda d: fit(mlp(), Samples(64, windows), task="regression", loss=lambda o, t: (o - t).abs(), run_dir=d),
        "task.loss: <lambda> returns a float32 tensor of shape (2,) for a batch of 2; a loss is one number: reduce it",
    ),
    (
        "a loss that returns a Python float",
        lambda d: fit(mlp(), Samples(64, windows), task="regression", loss=lambda o, t: 0.5, run_dir=d),
        "task.loss: <lambda> returns a float, not a tensor",
    ),
    (
        "a loss with no gradient",
        lambda d: fit(
            mlp(), Samples(64, windows), task="regression", loss=lambda o, t: ((o.detach() - t) ** 2).mean(), run_dir=d
        ),
        "task.loss: <lambda> returns a value with no gradient",
    ),
    (
        "a model with no parameters",
        lambda d: fit(
            torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Identity()),
            Samples(64, windows),
            task="regression",
            run_dir=d,
        ),
        "model: Sequential cannot be trained: it has no parameters",
    ),
    (
        "a model with every parameter frozen",
        lambda d: fit(frozen(), Samples(64, windows), task="regression", run_dir=d),
        "model: Sequential cannot be trained: none of its 19 parameters requires a gradient (all frozen)",
    ),
    (
        "samples that do not stack",
        lambda d: fit(mlp(), Samples(64, lambda i: (torch.zeros(6 + i % 3, 3), 0.0)), task="regression", run_dir=d),
        "data: training samples do not stack into a batch: the input of sample 0 has shape (6, 3), of sample 1 (7, 3); "
        "pad them to one shape in the data set, give the data a collate function that pads a batch (return {'train': "
        "..., 'collate': saturate.data.pad_collate}), or batch them in the data set (returns_batches = True, its "
        "__getitems__(indices) returning the batch)",
    ),
    (
        "NaN targets in memory",
        lambda d: fit(
            mlp(),
            saturate.data.InMemory(torch.zeros(64, 6, 3), torch.tensor([float("nan")] * 3 + [0.0] * 61)),
            task="regression",
            run_dir=d,
        ),
        "data: 3 training sample(s) hold NaN or inf targets (the first: sample 0); remove or fill them",
    ),
    (
        "NaN targets in the first batch",
        lambda d: fit(mlp(), Samples(64, lambda i: (windows(i)[0], float("nan"))), task="regression", run_dir=d),
        "data: the first batch holds NaN or inf in its target: the loss is nan before any training; remove or fill "
        "those values",
    ),
    (
        "NaN targets read as the run goes: no learning-rate advice",
        lambda d: fit(
            mlp(),
            Samples(64, lambda i: (windows(i)[0], float("nan") if i >= 8 else 0.0)),
            task="regression",
            run_dir=d,
            overrides=[*TINY, "trainer.max_nonfinite_steps=2"],
        ),
        "The last batch holds NaN or inf targets: the data makes the loss non-finite, whatever the learning rate",
    ),
    (
        "fit's overrides as one string",
        lambda d: fit(mlp(), Samples(64, windows), task="regression", overrides="precision=amp", run_dir=d),
        "saturate.fit: overrides='precision=amp': expected a list of 'key=value' strings",
    ),
    (
        "a regression loss's name for classification",
        lambda d: fit(mlp(2), Samples(64, lambda i: (windows(i)[0], i % 2)), loss="mse", run_dir=d),
        "saturate.fit: loss='mse': task=classification takes a callable loss(outputs, targets)",
    ),
    (
        "fit asked for two processes",
        lambda d: fit(
            mlp(), Samples(64, windows), task="regression", overrides=[*TINY, "trainer.devices=2"], run_dir=d
        ),
        "trainer.devices=2: saturate.fit trains in the process that calls it; for 2 processes start your script "
        "with torchrun",
    ),
    (
        "a model argument of the wrong type",
        lambda d: saturate.train(compose_config([*TINY, f"run_dir={d}", "model.width=abc"])),
        "model.width='abc': expected an integer (SmallCNN's width)",
    ),
]


@pytest.mark.parametrize(("name", "make", "says"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_mistake_is_found_at_start_up_in_one_message(tmp_path, name, make, says):
    with pytest.raises(CompactHydraException) as err:
        make(tmp_path / "run")
    message = str(err.value)
    assert says in message, message
    assert len(message) < 600 and "Traceback" not in message


def test_a_regression_loss_by_name_through_fit_works(tmp_path):
    metrics = fit(mlp(), Samples(64, windows), Samples(32, windows), task="regression", loss="l1", run_dir=tmp_path)
    assert metrics["progress/step"] == 2 and read_metrics(tmp_path)["task"] == "regression"


def test_a_class_index_past_the_outputs_mid_run_is_one_message(tmp_path):
    """Classes counted from a `classes` attribute, targets read only as the run goes (no
    `targets` attribute): the CPU's IndexError at the step becomes one message."""
    bad = Samples(64, lambda i: (windows(i)[0], 7 if i == 40 else i % 2), classes=["a", "b"])
    with pytest.raises(DataError, match=r"data: a target is not a class index in \[0, 1\] \(Target 7 is out of bounds"):
        fit(mlp(2), bad, run_dir=tmp_path, overrides=[*TINY, "loader.batch_size=64"])


def test_a_hung_callback_cannot_keep_a_run_alive_through_sigterm(tmp_path, caplog):
    """The callback hangs after a SIGTERM arrived: HANG_S later it is abandoned, named, and the
    run saves and stops as any preempted run."""
    import signal
    import time

    from saturate.callbacks.dispatch import HANG_S
    from saturate.loop.faults import Preempted

    class Hangs:
        def on_log(self, run, metrics, step):
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # a scheduler preempting the job ...
                time.sleep(600)  # ... while the callback waits on a server that never answers

    start = time.monotonic()
    with pytest.raises(Preempted) as stopped:
        fit(mlp(), Samples(64, windows), task="regression", callbacks=[Hangs()], run_dir=tmp_path)
    assert stopped.value.code == 143 and time.monotonic() - start < HANG_S + 30
    assert f"Hangs.on_log did not return within {HANG_S:.0f} s of the stop signal: abandoned" in caplog.text
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["step"] == 2


FIT_INSIDE_HYDRA = """
import hydra, torch, saturate
from torch.utils.data import TensorDataset

@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg):
    data = TensorDataset(torch.randn(64, 6), torch.randn(64))
    metrics = saturate.fit(torch.nn.Linear(6, 1), data, data, task="regression", run_dir="fitted",
                           overrides=["trainer.max_epochs=1", "trainer.progress=false", "loader.batch_size=16"])
    print("FITTED", metrics["progress/step"])

main()
"""


def test_fit_inside_a_users_hydra_app_trains(tmp_path):
    (tmp_path / "app.py").write_text(FIT_INSIDE_HYDRA)
    done = python("app.py", "hydra.run.dir=outer", cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FITTED 4" in done.stdout
    recorded = read_metrics(tmp_path / "fitted")
    # its own run, not the app's
    assert recorded["overrides"][0] == "trainer.max_epochs=1" and "outer" not in json.dumps(recorded)


FULL = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
from pathlib import Path
from saturate.record import write_json
try:
    write_json(Path(sys.argv[1]) / "metrics.json", {"status": "completed", "val/acc": 0.5, "pad": "x" * 200})
except Exception as e:
    print(type(e).__name__, e)
"""


def test_a_full_disk_names_the_file_and_leaves_no_temporary(tmp_path):
    done = python("-c", FULL, tmp_path, timeout=60)
    assert done.stdout.strip() == f"UserError cannot write {tmp_path / 'metrics.json'}: File too large", (
        done.stdout + done.stderr
    )
    assert list(tmp_path.iterdir()) == []


def test_a_run_dir_name_over_the_file_systems_limit_is_one_line(tmp_path):
    done = run_cli(*TINY, f"hydra.run.dir={tmp_path / ('x' * 300)}", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        "a name in it is over the file system's limit (255 bytes); give a shorter hydra.run.dir or name=" in done.stderr
    )


def test_a_file_name_that_is_not_utf8_is_logged_escaped(tmp_path):
    write_digits(tmp_path / "folder", size=8)
    with open(os.path.join(os.fsencode(tmp_path / "folder" / "3"), b"\xff\xfe.jpg"), "wb") as f:
        f.write(b"\xff\xd8\xff not a jpeg")
    folder = ["data=image_folder", f"data.root={tmp_path / 'folder'}", "data.image_size=8", "data.check=true"]
    done = run_cli(*TINY, *folder, "hydra.run.dir=r", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Logging error" not in done.stderr + done.stdout
    assert "3/\\xff\\xfe.jpg: not a readable image" in (tmp_path / "r" / "train.log").read_text()


# Every hostile case of the reliability round three (issue 25), by item, with the tests that
# answer it: this list is the index, and the test below keeps it from naming a test that is gone.
HOSTILE_CASES = {
    "1 a skipped first step (fused SGD, AdamW, Adam; fp16's first overflow; deterministic and not)": [
        "loop/test_faults.py::test_a_skipped_first_step_leaves_the_optimizer_as_new",
        "loop/test_faults.py::test_a_run_whose_first_step_is_skipped_trains_on",
        "loop/test_faults.py::test_an_fp16_overflow_at_the_first_step_leaves_fused_sgd_momentum_clean",
    ],
    "2 a shard index that would run shell commands; nothing read runs code": [
        "data/test_shards.py::test_a_shard_url_with_a_scheme_is_refused_and_nothing_runs",
        "data/test_shards.py::test_nothing_in_a_shard_is_unpickled",
        "hostile/test_never_lose_a_run.py::test_a_checkpoint_that_would_run_code_is_refused_and_others_are_never_opened",
        "hostile/test_never_lose_a_run.py::test_a_cifar_batch_that_would_run_code_is_refused",
    ],
    "3 hydra.searchpath carried by tune trials, trainer.devices ranks and the resume command": [
        "config/test_invocation.py::test_the_command_line_holds_hydras_overrides_but_not_where_the_run_went",
        "config/test_invocation.py::test_the_printed_resume_command_runs_verbatim_with_a_users_config_dir",
        "config/test_invocation.py::test_trainer_devices_ranks_compose_with_the_users_config_dir",
        "config/test_invocation.py::test_tune_trials_compose_with_the_users_config_dir",
    ],
    "4 a fresh run into a finished run's dir; a mistake while resuming": [
        "checkpoint/test_rundir.py::test_a_fresh_run_into_a_finished_runs_dir_is_refused_and_changes_nothing",
        "checkpoint/test_rundir.py::test_trainer_restart_starts_the_run_over",
        "checkpoint/test_rundir.py::test_a_mistake_while_resuming_keeps_the_finished_runs_record",
        "checkpoint/test_rundir.py::test_the_cli_refuses_in_one_line",
    ],
    "5 two runs in one dir": ["checkpoint/test_rundir.py::test_a_second_run_into_a_dir_in_use_is_refused"],
    "6 a broken image in a shard; make_shards' check": [
        "data/test_shards.py::test_a_sample_that_does_not_decode_is_skipped_named_and_left_out_next_time",
        "data/test_shards.py::test_make_shards_refuses_what_the_reader_would",
    ],
    "7 tune.preset over another file; a tampered tune cache; SIGINT in the confirmation; unconfirmed speed-ups": [
        "test_tune.py::test_a_preset_never_overwrites_a_file_tune_did_not_write",
        "test_tune.py::test_tune_refuses_a_preset_path_that_is_not_its_own_before_any_trial",
        "test_tune.py::test_a_tune_cache_entry_is_checked_before_it_is_used",
        "test_tune.py::test_an_interrupt_during_the_confirmation_stops_at_once_and_claims_nothing",
    ],
    "8 mistakes found at start-up": [
        "hostile/test_bad_input.py::test_a_mistake_is_found_at_start_up_in_one_message",
        "hostile/test_bad_input.py::test_a_class_index_past_the_outputs_mid_run_is_one_message",
        "data/test_shards.py::test_a_class_outside_the_index_is_one_message_naming_the_sample",
    ],
    "9 files saturate wrote, tampered": [
        "test_tune.py::test_a_cache_file_of_any_shape_is_measured_again_with_a_warning",
        "hostile/test_bad_input.py::test_a_tampered_skip_log_is_passed_over_line_by_line",
        "hostile/test_bad_input.py::test_a_tampered_image_index_cache_is_rebuilt_with_a_warning",
        "data/test_shards.py::test_a_bad_index_is_one_line_naming_the_file_and_field",
        "data/test_shards.py::test_an_index_that_counts_more_samples_than_its_shard_holds_names_the_field",
    ],
    "10 processes and signals": [
        "scale/test_distributed.py::test_sigterm_to_the_trainer_devices_launcher_saves_and_exits_143",
        "scale/test_distributed.py::test_when_one_rank_fails_the_others_say_one_line_and_the_launcher_names_its_log",
        "hostile/test_bad_input.py::test_a_hung_callback_cannot_keep_a_run_alive_through_sigterm",
        "hostile/test_bad_input.py::test_fit_inside_a_users_hydra_app_trains",
        # fit's string overrides, loss name, devices
        "hostile/test_bad_input.py::test_a_mistake_is_found_at_start_up_in_one_message",
        "hostile/test_bad_input.py::test_a_regression_loss_by_name_through_fit_works",
    ],
    "11 messages": [
        "hostile/test_bad_input.py::test_a_full_disk_names_the_file_and_leaves_no_temporary",
        "hostile/test_bad_input.py::test_a_run_dir_name_over_the_file_systems_limit_is_one_line",
        "hostile/test_bad_input.py::test_a_file_name_that_is_not_utf8_is_logged_escaped",
        "hostile/test_bad_input.py::test_a_mistake_is_found_at_start_up_in_one_message",  # NaN targets, model.width=abc
    ],
    # round four (issue 36): the new surface under hostile input (../shared/redteam-round4, case ids c01..c137)
    "r4 a report script writes where the data tells it; malformed run files (c127-c130, c132)": [
        "hostile/test_never_lose_a_run.py::test_a_report_never_writes_through_a_symlink_nor_copies_lines_from_a_run",
        "hostile/test_never_lose_a_run.py::test_a_report_does_not_follow_a_job_dir_or_file_out_of_the_sweep",
        "hostile/test_bad_input.py::test_a_malformed_file_in_a_sweep_is_one_line_naming_it",
    ],
    "r4 trainer.restart deletes before the config is checked, and leaves the old run's outputs (c100, c101)": [
        "hostile/test_never_lose_a_run.py::test_trainer_restart_with_a_mistake_deletes_nothing",
        "hostile/test_never_lose_a_run.py::test_trainer_restart_deletes_everything_of_the_earlier_run_and_lists_it",
    ],
    "r4 a user's hook that exits, interrupts or swallows the interrupt (c04, c05, c07, c124)": [
        "hostile/test_never_lose_a_run.py::test_a_hook_that_exits_is_the_hooks_failure_saved_and_recorded",
        "hostile/test_never_lose_a_run.py::test_a_sweep_whose_hook_exits_fails_that_job_runs_the_others_and_says_so",
        "hostile/test_never_lose_a_run.py::test_a_hook_that_swallows_the_interrupt_is_abandoned_at_sigterm",
    ],
    "r4 a direction that contradicts itself; a task's metrics that cannot be monitored (c26, c36-c38, c72b)": [
        "hostile/test_bad_input.py::test_bad_input_is_one_short_message",  # early stopping, plateau, acc=null
        "hostile/test_bad_input.py::test_a_mistake_is_found_at_start_up_in_one_message",  # better(), metrics(), main
    ],
    "r4 sequences that cannot train (c44-c47, c49)": [
        "hostile/test_bad_input.py::test_a_ctc_target_that_cannot_train_is_named_at_start_up",
        "hostile/test_bad_input.py::test_per_step_targets_of_another_length_than_the_outputs_blame_the_data",
    ],
    "r4 outputs that do not match (c40, c64, c68, c69)": [
        "hostile/test_bad_input.py::test_predictions_that_do_not_match_the_samples_are_refused_and_the_run_kept",
        "hostile/test_bad_input.py::test_bad_input_is_one_short_message",  # trainer.predict=test without a test split
        "hostile/test_bad_input.py::test_a_metric_whose_compute_raises_is_named_and_the_step_saved",
        "hostile/test_bad_input.py::test_a_monitored_metric_that_is_nan_says_why_there_is_no_best_pt",
    ],
    "r4 the user's augmentation changes the size, the dtype or makes NaN (c79, c80, c83, c84)": [
        "hostile/test_bad_input.py::test_bad_input_is_one_short_message",  # on the device and in the workers
    ],
    "r4 callback state that cannot be saved or loaded safely (c09-c12)": [
        "hostile/test_bad_input.py::test_callback_state_that_cannot_round_trip_is_refused_before_training",
    ],
    "r4 SIGINT at odd moments; a log that cannot open; a late failure (c02, c111, c112, c119b, c121, c122b)": [
        "hostile/test_never_lose_a_run.py::test_ctrl_c_twice_while_a_checkpoint_is_written_leaves_it_whole",
        "hostile/test_never_lose_a_run.py::test_ctrl_c_twice_during_an_evaluation_is_recorded_not_a_hooks_failure",
        "hostile/test_never_lose_a_run.py::test_an_interrupt_the_run_did_not_catch_is_one_line_and_exit_130",
        "hostile/test_bad_input.py::test_a_log_file_hydra_cannot_open_is_one_line",
        "hostile/test_never_lose_a_run.py::test_a_resume_that_trained_and_then_failed_records_its_failure",
        "hostile/test_never_lose_a_run.py::test_a_hook_failing_after_the_run_completed_says_so",
    ],
    "r4 a task's forward that does not return (loss, outputs), outputs its metrics cannot take (c35, c39)": [
        "hostile/test_bad_input.py::test_a_mistake_is_found_at_start_up_in_one_message",
    ],
    "r4 the self-test's --checks as a path; tune.extra a trial would not take (c89, c95, c99)": [
        "selftest/test_selftest.py::test_checks_given_as_a_file_path_are_imported_and_a_broken_one_is_one_line",
        "test_tune.py::test_a_tune_extra_a_trial_would_not_take_is_named",
        "selftest/test_selftest.py::test_checks_that_misbehave_with_the_os_leave_a_table_and_no_process",  # c91b
    ],
    "r4 a callback's request out of range (c19, c20)": [
        "hostile/test_bad_input.py::test_a_callbacks_request_out_of_range_is_its_failure",
    ],
    "r4 a sample entry the default collate cannot batch (c58)": [
        "hostile/test_bad_input.py::test_a_sample_entry_the_default_collate_cannot_batch_is_named",
    ],
    "r4 hooks that change the metrics they are given (c08)": [
        "hostile/test_never_lose_a_run.py::test_a_hook_that_changes_its_metrics_changes_nothing_recorded",
    ],
    "r4 a list where the config has a mapping (c67)": [
        "test_cli.py::test_compose_errors_are_one_line_naming_key_value_and_what_is_allowed",
    ],
}


def test_every_hostile_case_names_tests_that_exist():
    import importlib

    for item, tests in HOSTILE_CASES.items():
        assert tests, item
        for test in tests:
            module, _, name = test.partition("::")
            assert callable(
                getattr(importlib.import_module("tests." + module.removesuffix(".py").replace("/", ".")), name, None)
            ), f"{item}: {test}"


# -- round four (issue 36): files the report scripts read, malformed


def deep(path: Path) -> None:
    path.write_text("[" * 200_000 + "]" * 200_000)


MALFORMED = [
    ("metrics.json", lambda p: p.write_text("[1, 2, 3]"), "not a JSON object"),
    ("metrics.json", deep, "not valid JSON (nested too deep)"),
    ("metrics.json", lambda p: p.write_bytes(b"\xff\xfe\x00bad"), "not valid JSON (not UTF-8)"),
    ("metrics.json", lambda p: p.write_text('{"status": "completed", "perf/samples_per_s": "fast"}'), None),
    ("metrics.json", lambda p: p.write_text('{"status": 3, "monitor": 7, "error": ["x"]}'), None),
    (".hydra/overrides.yaml", lambda p: p.write_text("{a: [unclosed"), "not a YAML list of overrides"),
    (".hydra/overrides.yaml", lambda p: p.write_text("a: 1"), "not a YAML list of overrides"),
    (".hydra/overrides.yaml", lambda p: p.write_bytes(b"- \xff\xfe"), "not a YAML list of overrides"),
]


@pytest.mark.parametrize(("name", "spoil", "says"), MALFORMED, ids=[f"{m[0]}-{i}" for i, m in enumerate(MALFORMED)])
def test_a_malformed_file_in_a_sweep_is_one_line_naming_it(tmp_path, name, spoil, says):
    from tests.hostile.test_never_lose_a_run import a_sweep, sweep_report

    sweep = a_sweep(tmp_path / "sweep")
    path = next(sweep.glob("0_*")) / name
    spoil(path)
    done = sweep_report(sweep)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    if says:
        assert f"sweep_report: passing over {path}: {says}" in done.stderr
        assert len([line for line in done.stderr.splitlines() if line]) == 1
    assert "3 jobs" in (sweep / "sweep.md").read_text()


# -- sequences that cannot train (round four: c44-c47, c49)


class Clips(torch.utils.data.Dataset):
    """Clips of 6 features; `make(i, g)` -> (frames, labels) for sample i."""

    num_classes = 5  # CTC: labels 1..4 and the blank

    def __init__(self, n: int, make):
        g = torch.Generator().manual_seed(n)
        self.items = []
        for i in range(n):
            frames, labels = make(i, g)
            self.items.append({"input": torch.randn(frames, 6, generator=g), "target": labels})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class PerFrame(torch.nn.Module):
    def __init__(self, num_classes: int = 5):
        super().__init__()
        self.fc = torch.nn.Linear(6, num_classes)

    def forward(self, x):
        return self.fc(x)


def labels(n: int, g, low: int = 1, high: int = 5):
    return torch.randint(low, high, (n,), generator=g)


def clips(kind: str):
    """A CTC data set of 64 clips (8 to 15 frames, 1 to 3 labels in 1..4), spoiled by `kind`."""

    def make(i, g):
        frames, count = 8 + i % 8, 1 + i % 3
        if kind == "long targets":
            frames, count = 3, 12
        if kind == "zero frames" and i % 5 == 0:
            frames = 0
        target = labels(count, g)
        if kind == "blank" and i % 4 == 1:
            target[0] = 0
        if kind == "over" and i % 4 == 1:
            target[0] = 8
        if kind == "repeats" and i % 4 == 0:
            frames, target = 3, torch.tensor([2, 2, 2])  # three frames cannot hold 2, 2, 2: a blank goes between
        if kind == "per_step short":
            target = labels(max(1, frames - 3), g, 0)
        return frames, target

    return Clips(64, make)


def seq_fit(kind: str, d: Path, mode: str = "ctc"):
    from saturate.data import pad_collate

    overrides = [*TINY, "loader.batch_size=8", f"task.mode={mode}"]
    data = clips(kind)
    return fit(PerFrame(), data, data, task="sequence", collate=pad_collate, overrides=overrides, run_dir=d)


SEQUENCES = [
    ("long targets", r"data: sample \d+ of a batch has 3 output frames for 12 labels; CTC needs at least one frame"),
    ("zero frames", r"data: sample \d+ of a batch has 0 output frames for [1-3] labels; CTC needs at least one frame"),
    ("repeats", r"data: sample \d+ of a batch has 3 output frames for 3 labels \(2 of them repeats"),
    ("blank", r"data: a CTC target holds label 0, the blank; labels are 1 to 4 \(task.num_classes=5 counts the blank"),
    ("over", r"data: a CTC target holds label 8; labels are 1 to 4 \(task.num_classes=5 counts the blank"),
]


@pytest.mark.parametrize(("kind", "says"), SEQUENCES, ids=[s[0] for s in SEQUENCES])
def test_a_ctc_target_that_cannot_train_is_named_at_start_up(tmp_path, kind, says):
    with pytest.raises(DataError) as err:
        seq_fit(kind, tmp_path)
    assert re.search(says, str(err.value)), err.value
    assert "\n" not in str(err.value) and len(str(err.value)) < 400
    assert not (tmp_path / "checkpoints" / "last.pt").exists()  # found before the first step


def test_per_step_targets_of_another_length_than_the_outputs_blame_the_data(tmp_path):
    says = r"data: per_step targets have \d+ steps, the model's outputs \d+; task.mode=per_step"
    with pytest.raises(DataError, match=says):
        seq_fit("per_step short", tmp_path, mode="per_step")


# -- outputs that do not match (round four: c40, c64, c68, c69)


class Rows(Regression):
    """A task whose predictions() keep one row of each batch (c40), or are not a dict."""

    def __init__(self, *, listed: bool = False):
        super().__init__(num_outputs=1)
        self.listed = listed

    def predictions(self, outputs, batch):
        return [outputs] if self.listed else {"output": outputs[:1]}


class Exploding(torchmetrics.MeanMetric):
    """A user's metric whose compute() raises (c68), or is always NaN (c69)."""

    def __init__(self, nan: bool = False):
        super().__init__()
        self.nan = nan

    def compute(self):
        if self.nan:
            return torch.tensor(float("nan"))
        raise ValueError("metric compute exploded")


class WithMetric(Regression):
    def __init__(self, metric):
        super().__init__(num_outputs=1)
        self.metric = metric

    def own_metrics(self):
        return {**super().own_metrics(), "boom": self.metric.clone()}


@pytest.mark.parametrize(
    ("listed", "says"),
    [
        (False, "task: Rows.predictions() gave 'output' with 1 row(s) for a batch of 32; expected one per sample"),
        (True, "task: Rows.predictions() returned a list; expected a dict {name: tensor with one row per sample}"),
    ],
    ids=["rows dropped", "a list"],
)
def test_predictions_that_do_not_match_the_samples_are_refused_and_the_run_kept(tmp_path, listed, says):
    overrides = [*TINY, "trainer.predict=val"]
    with pytest.raises(saturate.errors.UserError) as err:
        fit(
            mlp(),
            Samples(64, windows),
            Samples(64, windows),
            task=Rows(listed=listed),
            overrides=overrides,
            run_dir=tmp_path,
        )
    assert says in str(err.value), err.value
    assert not (tmp_path / "predictions" / "val.npz").exists()
    assert (tmp_path / "checkpoints" / "best.pt").is_file() and read_metrics(tmp_path)["status"] == "failed"


def test_a_metric_whose_compute_raises_is_named_and_the_step_saved(tmp_path):
    with pytest.raises(saturate.errors.UserError) as err:
        fit(mlp(), Samples(64, windows), Samples(64, windows), task=WithMetric(Exploding()), run_dir=tmp_path)
    assert "task: metric boom (Exploding) raised ValueError in compute(): metric compute exploded" in str(err.value)
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["step"] == 2
    assert read_metrics(tmp_path)["status"] == "failed"


def test_a_monitored_metric_that_is_nan_says_why_there_is_no_best_pt(tmp_path, caplog):
    overrides = [*TINY, "checkpoint.monitor=val/boom"]
    fit(
        mlp(),
        Samples(64, windows),
        Samples(64, windows),
        task=WithMetric(Exploding(nan=True)),
        overrides=overrides,
        run_dir=tmp_path,
    )
    assert "checkpoint.monitor: val/boom is nan at step 2; no best.pt from this evaluation" in caplog.text
    assert not (tmp_path / "checkpoints" / "best.pt").exists() and read_metrics(tmp_path)["best"]["value"] is None


# -- callback state that cannot be saved (round four: c09-c12)


class Kept:
    """A callback whose state_dict() holds `kind` of thing."""

    def __init__(self, kind: str):
        self.kind = kind

    def on_eval_end(self, run, metrics):
        pass

    def state_dict(self):
        if self.kind == "raises":
            raise RuntimeError("state_dict exploded")
        return {"lambda": {"f": lambda x: x}, "file": {"fh": sys.stdout}, "object": {"obj": Kept("object")}}[self.kind]

    def load_state_dict(self, state):
        pass


STATES = [
    (
        "lambda",
        "callbacks: kept.state_dict() cannot be saved in a checkpoint (AttributeError: Can't pickle local object",
    ),
    ("file", "callbacks: kept.state_dict() cannot be saved in a checkpoint (TypeError: cannot pickle"),
    ("raises", "callbacks: kept.state_dict() raised RuntimeError: state_dict exploded"),
    (
        "object",
        "callbacks: kept.state_dict() holds what a checkpoint cannot load safely (torch.load(weights_only=True)",
    ),
]


@pytest.mark.parametrize(("kind", "says"), STATES, ids=[s[0] for s in STATES])
def test_callback_state_that_cannot_round_trip_is_refused_before_training(tmp_path, kind, says):
    with pytest.raises(saturate.errors.UserError) as err:
        fit(
            mlp(),
            Samples(64, windows),
            Samples(32, windows),
            task="regression",
            callbacks={"kept": Kept(kind)},
            run_dir=tmp_path,
        )
    assert says in str(err.value), err.value
    assert "\n" not in str(err.value) and len(str(err.value)) < 600
    assert not list((tmp_path / "checkpoints").glob("*.pt")) if (tmp_path / "checkpoints").exists() else True


def test_a_log_file_hydra_cannot_open_is_one_line(tmp_path):
    """The run dir's train.log cannot be opened (here a folder stands there; a read-only mount
    gives the same): one line naming it, not logging's 'Unable to configure handler' (c112)."""
    (tmp_path / "r" / "train.log").mkdir(parents=True)
    done = run_cli(*TINY, "hydra.run.dir=r", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"error: cannot write {tmp_path / 'r' / 'train.log'} (Is a directory); run from a writable" in done.stderr


# -- a callback's requests out of range (round four: c19, c20)


class Requests:
    def __init__(self, what):
        self.what = what

    def on_run_start(self, run):
        if self.what == "lr":
            run.scale_lr(-1)
        else:
            run.eval_model = "not a model"


@pytest.mark.parametrize(
    ("what", "says"),
    [
        ("lr", "requests.on_run_start raised ValueError: run.scale_lr(-1): expected a finite factor >= 0"),
        ("model", "requests.on_run_start raised TypeError: run.eval_model='not a model': expected a torch.nn.Module"),
    ],
    ids=["negative lr scale", "eval_model a string"],
)
def test_a_callbacks_request_out_of_range_is_its_failure(tmp_path, what, says):
    from saturate.callbacks import CallbackError

    with pytest.raises(CallbackError) as err:
        fit(
            mlp(),
            Samples(64, windows),
            Samples(32, windows),
            task="regression",
            callbacks={"requests": Requests(what)},
            run_dir=tmp_path,
        )
    assert str(err.value).startswith(says), err.value


def test_a_sample_entry_the_default_collate_cannot_batch_is_named(tmp_path):
    """A dict sample with None beside its input and target (c58)."""
    data = Samples(64, lambda i: {"input": windows(i)[0], "target": windows(i)[1], "path": None if i % 2 else "/x"})
    with pytest.raises(DataError, match=r"data: samples do not batch \(the sample's path is a NoneType\)") as err:
        fit(mlp(), data, data, task="regression", run_dir=tmp_path)
    assert "give the data a collate function (return {'train': ..., 'collate': fn})" in str(err.value)


def _both_commands(overrides: list[str], run_dir) -> list:
    """`python train.py` and `saturate train` (as `python -m saturate train`) with the same
    overrides, from the checkout's root (the table's own classes import from there)."""
    args = [*TINY, *overrides, f"hydra.run.dir={run_dir}"]
    return [python(ROOT / "train.py", *args, cwd=ROOT), python("-m", "saturate", "train", *args, cwd=ROOT)]


COMMAND_LINE = [b for b in BAD_INPUTS if not callable(b[1])]


def _answered_alike(tmp_path, given, says) -> None:
    checkout, installed = _both_commands(given, tmp_path / "run")
    assert checkout.returncode == installed.returncode == 1, installed.stderr[-2000:]
    assert says in checkout.stderr and "Traceback" not in checkout.stderr + installed.stderr
    assert installed.stderr == checkout.stderr


@pytest.mark.parametrize(("name", "given", "says"), COMMAND_LINE[:3], ids=[b[0] for b in COMMAND_LINE[:3]])
def test_saturate_train_answers_a_mistake_as_train_py_does(tmp_path, name, given, says):
    _answered_alike(tmp_path, given, says)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "given", "says"), COMMAND_LINE[3:], ids=[b[0] for b in COMMAND_LINE[3:]])
def test_the_whole_table_through_both_commands(tmp_path, name, given, says):
    _answered_alike(tmp_path, given, says)
