"""Input pipeline: loader presets x data options on the CPU, broken image files, missing
data, the resident loader's order, and the bottleneck verdict on constructed timings."""

from __future__ import annotations

import logging
import pickle
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import saturate
from saturate.commands.make_image_folder import write_digits
from saturate.config.schema import LoaderConfig
from saturate.data.base import ImageTensors, materialize, stack
from saturate.data.loader import (
    DevicePipeline,
    ResidentLoader,
    ResumableSampler,
    Shard,
    read_in_place,
    resident_for,
)
from saturate.diagnostics.report import RunFacts, diagnose, render
from saturate.errors import ConfigError, DataError
from tests.conftest import read_metrics, run_cli
from tests.trainer.test_run import events

LOADERS = ["default", "fast", "debug", "resident"]


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """14 digits of each class as 16x16 PNGs in class folders, plus 2 truncated PNGs and 2
    text files: few enough that every file is read in a tiny run (the colour statistics read
    up to 256 training images, evaluation 2 batches of 32), so each broken one is met."""
    root = tmp_path_factory.mktemp("digits_png")
    write_digits(root, size=16, fmt="png", corrupt=4, per_class=14)
    return root


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory) -> Path:
    """CIFAR-10's python-pickle format (the real layout and keys), 60 random images."""
    root = tmp_path_factory.mktemp("cifar") / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (10, 3072), dtype=np.uint8), "labels": rng.integers(0, 10, 10).tolist()}
        with open(root / name, "wb") as f:
            pickle.dump(batch, f)
    return root.parent  # the parent works too: the loader looks for cifar-10-batches-py inside


IMAGES = ["data=image_folder", "data.image_size=16", "model.width=8"]


# every pair but resident + cpu, which is rejected (test_resident_loader_rejects_per_sample_augmentation)
PAIRS = [
    (loader, placement)
    for loader in LOADERS
    for placement in ("cpu", "gpu")
    if (loader, placement) != ("resident", "cpu")
]


@pytest.mark.parametrize(("loader", "placement"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_image_folder_with_every_loader_and_placement(make_cfg, image_folder, loader, placement):
    workers = {"default": "auto", "fast": "2", "debug": "0", "resident": "0"}[loader]
    cfg = make_cfg(
        *IMAGES,
        f"data.root={image_folder}",
        f"loader={loader}",
        f"loader.num_workers={workers}",
        f"augmentation={placement}",
    )
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 3
    assert metrics["data/skipped_files"] == 4
    assert read_metrics(cfg.run_dir)["data"] == "image_folder"


@pytest.mark.parametrize("loader", LOADERS)
def test_cifar10_with_every_loader(make_cfg, cifar_root, loader):
    cfg = make_cfg(
        "data=cifar10", f"data.root={cifar_root}", f"loader={loader}", "loader.batch_size=16", "model.width=8"
    )
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 3  # 50 training images, batch 16, drop_last


def test_broken_files_are_skipped_and_each_is_named(make_cfg, image_folder, caplog):
    with caplog.at_level(logging.WARNING, logger="saturate"):
        saturate.train(make_cfg(*IMAGES, f"data.root={image_folder}"))
    named = {r.getMessage().split()[1].rstrip(":") for r in caplog.records if r.getMessage().startswith("skipping")}
    assert named == {
        str(image_folder / "0/broken_0.png"),
        str(image_folder / "1/notes_1.png"),
        str(image_folder / "2/broken_2.png"),
        str(image_folder / "3/notes_3.png"),
    }


def test_strict_mode_names_the_first_broken_file(make_cfg, image_folder):
    with pytest.raises(DataError, match=r"data.strict=true: .*/0/broken_0.png is not a readable image"):
        saturate.train(make_cfg(*IMAGES, f"data.root={image_folder}", "data.strict=true"))


def test_train_and_val_sub_folders_are_the_split(make_cfg, tmp_path):
    for part in ("train", "val"):
        write_digits(tmp_path / "split" / part, size=8)
    metrics = saturate.train(
        make_cfg("data=image_folder", f"data.root={tmp_path / 'split'}", "data.image_size=8", "data.channels=1")
    )
    assert metrics["data/skipped_files"] == 0


@pytest.mark.parametrize("data", ["cifar10", "image_folder"])
def test_missing_data_root_is_a_clean_error(tmp_path, data):
    result = run_cli(f"data={data}", f"data.root={tmp_path / 'nowhere'}", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"data.root='{tmp_path / 'nowhere'}'" in result.stderr
    if data == "cifar10":
        assert "https://www.cs.toronto.edu/~kriz/cifar.html" in result.stderr and "downloads nothing" in result.stderr


def test_resident_loader_rejects_per_sample_augmentation(make_cfg):
    with pytest.raises(
        ConfigError, match="augmentation.placement='cpu': expected gpu or none with loader.resident=true"
    ):
        saturate.train(make_cfg("loader=resident", "augmentation=cpu"))


@pytest.mark.parametrize(("n", "world"), [(100, 1), (103, 2), (7, 3)])
def test_resident_order_is_the_distributed_samplers(n, world):
    data = ImageTensors(torch.zeros((n, 1, 2, 2), dtype=torch.uint8), torch.zeros(n, dtype=torch.long))
    cfg = LoaderConfig(batch_size=2, resident=True)
    shards = []
    for rank in range(world):
        pipeline = DevicePipeline(torch.device("cpu"), [0.5], [0.25], non_blocking=True, channels_last=False)
        loader = ResidentLoader(data, cfg, pipeline, train=True, shard=Shard(5, rank, world))
        sampler = ResumableSampler(data, batch_size=2, seed=5, rank=rank, world_size=world, keyed=False)
        sampler.set_epoch(3)
        assert loader.order(3).tolist() == list(sampler)
        shards += ResidentLoader(data, cfg, pipeline, train=False, shard=Shard(5, rank, world)).order(0).tolist()
    assert sorted(shards) == list(range(n))  # evaluation: every sample once, no padding


class Drawn(torch.utils.data.Dataset):
    """Samples computed when read: a flip drawn from torch's generator, as a random augmentation does."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        image = torch.arange(4.0).view(1, 2, 2)
        return (image.flip(-1) if torch.rand(()) < 0.5 else image), i


class FloatTargets(torch.utils.data.Dataset):
    """Python float targets: the default collate batches them as float64, and so does the resident loader."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.zeros(1, 2, 2), float(i)


def test_the_resident_loader_holds_each_entry_as_the_default_collate_batches_it():
    """A Python float as float64 (torch.tensor would make it float32), an int as int64, a bool as
    bool, numpy's scalars and arrays in their own dtypes: loader.resident=true trains on what
    the DataLoader would give."""
    samples = [
        {"x": torch.full((2,), i / 3), "scale": i / 7, "n": i, "flag": i % 2 == 0, "np": np.float32(i) / 3}
        | {"array": np.full(3, i, dtype=np.int16), "pair": [i / 5, i]}
        for i in range(10)
    ]
    held, collated = materialize(samples).tree, stack(samples)
    assert held["scale"].dtype == torch.float64 and held["pair"][0].dtype == torch.float64
    from torch.utils._pytree import tree_leaves

    for a, b in zip(tree_leaves(held), tree_leaves(collated), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


class Ragged(torch.utils.data.Dataset):
    """2,500 samples (more than materialize batches at once): one of another shape where `odd`
    says, and a target that turns from int to float past sample 1,999."""

    def __init__(self, odd: int | None = None):
        self.odd = odd

    def __len__(self):
        return 2500

    def __getitem__(self, i):
        return torch.full((4 if i == self.odd else 3,), i / 3), (i if i < 2000 else float(i))


def test_the_resident_loader_reads_in_chunks_and_names_a_sample_of_another_shape():
    """Held chunk by chunk: every sample where the DataLoader would put it, in sample 0's
    dtypes (a chunk that batches otherwise is read entry by entry); a sample of another shape,
    past the first chunk, is named."""
    x, y = materialize(Ragged()).tree
    assert torch.equal(x, torch.stack([torch.full((3,), i / 3) for i in range(2500)]))
    assert y.dtype == torch.int64 and torch.equal(y, torch.arange(2500))
    with pytest.raises(DataError, match=r"sample 2222 has an entry of shape \(4,\), sample 0 \(3,\)"):
        materialize(Ragged(odd=2222))


def test_a_tensor_dataset_and_its_random_split_are_held_by_a_gather_not_read_sample_by_sample():
    """The README's Python example: a TensorDataset split by random_split. Held, each split is
    what the default collate makes of its samples; no time per sample, so a set far too large
    to read sample by sample within READ_ONCE_S is held resident too."""
    x, y = torch.randn(100, 3), torch.arange(100)
    digits = torch.utils.data.TensorDataset(x, y)
    train, val = torch.utils.data.random_split(digits, [70, 30], torch.Generator().manual_seed(0))
    for split in (digits, train, val):
        held = materialize(split).tree
        collated = stack([split[i] for i in range(len(split))])
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(held, collated, strict=True))
        assert held[0].data_ptr() != x.data_ptr()  # a copy: the user's tensors are theirs
        assert read_in_place(split) == (3 * 4 + 8, 0.0)
    outside = torch.utils.data.Subset(digits, [0, 100])  # an index past the set: read as the DataLoader would, and fail
    assert read_in_place(outside) is None
    big = torch.utils.data.TensorDataset(torch.zeros(5_000_000, 1), torch.zeros(5_000_000, dtype=torch.long))
    auto, cpu = LoaderConfig(), torch.device("cpu")
    data = SimpleNamespace(train=big, val=None, test=None, collate=None)
    assert resident_for(auto, data, SimpleNamespace(fixed=True), cpu, workers=0, placement="none")


def test_resident_auto_holds_data_that_is_read_not_computed_on_a_cpu_run_only():
    """loader.resident=auto: resident on the CPU, no worker asked for, every split tensors in
    memory or samples read in micro-seconds that come back the same and batch the same way;
    an explicit true or false is kept."""
    tensors = ImageTensors(torch.zeros((10, 1, 2, 2), dtype=torch.uint8), torch.zeros(10, dtype=torch.long))
    samples = [(torch.full((1, 2, 2), float(i)), i) for i in range(10)]  # a list of (tensor, int): read, not computed
    data = lambda val, collate=None: SimpleNamespace(train=tensors, val=val, test=None, collate=collate)
    fixed, auto, cpu = SimpleNamespace(fixed=True), LoaderConfig(), torch.device("cpu")
    assert auto.resident == "auto"
    assert resident_for(auto, data(tensors), fixed, cpu, workers=0, placement="gpu")
    assert resident_for(auto, data(samples), fixed, cpu, workers=0, placement="none")
    assert resident_for(auto, data(FloatTargets()), fixed, cpu, workers=0, placement="none")  # held as float64
    no = [
        (auto, data(samples), fixed, torch.device("cuda"), 0, "none"),  # CUDA: loader=resident's choice
        (auto, data(samples), fixed, cpu, 1, "none"),  # a worker asked for
        (auto, data(samples), fixed, cpu, 0, "cpu"),  # augmented per sample, in workers
        (auto, data(samples, collate=list), fixed, cpu, 0, "none"),  # the data's own collate
        (auto, data(samples), SimpleNamespace(fixed=False), cpu, 0, "none"),
        (auto, data(Drawn()), fixed, cpu, 0, "none"),  # reading draws: computed, not read
        (LoaderConfig(resident_memory_fraction=1e-12), data(samples), fixed, cpu, 0, "none"),
        (LoaderConfig(resident=False), data(tensors), fixed, cpu, 0, "none"),
    ]
    for cfg, split, spec, device, workers, placement in no:
        assert not resident_for(cfg, split, spec, device, workers=workers, placement=placement)
    state = torch.get_rng_state()
    assert read_in_place(Drawn()) is None and torch.equal(torch.get_rng_state(), state)  # its draws put back
    assert resident_for(LoaderConfig(resident=True), data(Drawn()), fixed, torch.device("cuda"), 0, "none")


def test_reading_a_slow_data_set_is_not_in_place():
    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            time.sleep(0.001)  # a file to decode: milliseconds
            return torch.zeros(3), i

    assert read_in_place(Slow()) is None

    class Broken(Slow):
        def __getitem__(self, i):
            if i:
                raise ValueError("a sample that fails")
            return torch.zeros(3), i

    assert read_in_place(Broken()) is None  # left to the DataLoader, which says so in its words
    assert read_in_place([(torch.zeros(3), i) for i in range(4)]) == (3 * 4 + 8, pytest.approx(0, abs=1e-4))


def test_the_default_run_holds_digits_resident_and_a_worker_keeps_the_dataloader(make_cfg, caplog):
    with caplog.at_level(logging.INFO, logger="saturate"):
        saturate.train(cfg := make_cfg())
    assert read_metrics(cfg.run_dir)["facts"]["resident"] is True
    assert any("resident on cpu" in r.getMessage() for r in caplog.records)
    assert "loader.resident=auto: the data is read, not computed" in (Path(cfg.run_dir) / "report.md").read_text()
    saturate.train(cfg := make_cfg("loader.num_workers=1"))
    assert read_metrics(cfg.run_dir)["facts"]["resident"] is False


def test_resident_falls_back_to_host_memory_with_a_warning(make_cfg, caplog):
    with caplog.at_level(logging.WARNING, logger="saturate"):
        metrics = saturate.train(make_cfg("loader=resident", "loader.resident_memory_fraction=1e-9"))
    assert metrics["progress/step"] == 3
    assert any("keeping it in host memory" in r.getMessage() for r in caplog.records)


def test_every_run_writes_a_report(make_cfg):
    cfg = make_cfg("loader=resident", "augmentation=gpu")
    saturate.train(cfg)
    report = (Path(cfg.run_dir) / "report.md").read_text()
    verdict = read_metrics(cfg.run_dir)["verdict"]
    assert f"**Verdict: {verdict}**" in report and "samples/s" in report and "data wait" in report
    assert any("report" in tag for tag in events(cfg.run_dir).Tags()["tensors"])


def facts(**changes) -> RunFacts:
    base = dict(device="cuda", batch_size=128, num_workers=1, cpus=8, resident=False, in_memory=False, placement="cpu")
    base.update(
        persistent_workers=False,
        pin_memory=False,
        precision="fp32",
        compile=False,
        channels_last=False,
        memory_headroom=True,
    )
    base.update(emulated_precision=False)
    return RunFacts(**{**base, **changes})


def perf(wait: float) -> dict[str, float]:
    step = 10.0
    return {
        "perf/data_wait_frac": wait,
        "perf/step_ms": step,
        "perf/data_wait_ms": wait * step,
        "perf/copy_ms": 0.5,
        "perf/compute_ms": step * (1 - wait) - 0.5,
        "perf/samples_per_s": 12800,
    }


def test_verdict_input_bound_suggests_the_input_fixes():
    verdict = diagnose(perf(0.35), facts())
    assert verdict.kind == "input-bound" and "35.0%" in verdict.reason
    overrides = [o for o, _ in verdict.suggestions]
    assert overrides[0] == "augmentation=gpu"
    assert (
        "loader.num_workers=7" in overrides
        and "loader.persistent_workers=true" in overrides
        and "loader.pin_memory=true" in overrides
    )
    assert not any(o.startswith("precision") for o in overrides)


def test_verdict_input_bound_in_memory_data_suggests_resident():
    overrides = [o for o, _ in diagnose(perf(0.25), facts(placement="gpu", in_memory=True, num_workers=0)).suggestions]
    assert overrides[0] == "loader=resident"


def test_verdict_compute_bound_suggests_the_compute_fixes():
    verdict = diagnose(perf(0.01), facts(placement="gpu"))
    assert verdict.kind == "compute-bound"
    assert [o for o, _ in verdict.suggestions] == [
        "precision=amp",
        "trainer.compile=true",
        "trainer.channels_last=true",
        "loader.batch_size=256",
    ]
    done = diagnose(
        perf(0.01), facts(placement="gpu", precision="bf16", compile=True, channels_last=True, memory_headroom=False)
    )
    assert done.suggestions == []


def test_verdict_on_a_cpu_suggests_only_what_helps_there():
    cpu = facts(device="cpu", placement="gpu", cpus=2)
    # no compile, no larger batch from RSS; NHWC for image convolutions (measured 1.1-1.3x on the 2-core CPU)
    assert [o for o, _ in diagnose(perf(0.01), cpu).suggestions] == ["trainer.channels_last=true", "device=cuda"]
    done = facts(device="cpu", placement="gpu", cpus=2, channels_last=True)
    assert [o for o, _ in diagnose(perf(0.01), done).suggestions] == ["device=cuda"]
    sequences = facts(device="cpu", placement="none", cpus=2, image=False)
    assert [o for o, _ in diagnose(perf(0.01), sequences).suggestions] == ["device=cuda"]


def test_verdict_emulated_cpu_precision_suggests_fp32_first():
    # precision=amp on a CPU without bf16 kernels: the slowest part is the emulated arithmetic
    slow = facts(device="cpu", placement="gpu", precision="bf16", emulated_precision=True, cpus=2)
    assert [o for o, _ in diagnose(perf(0.01), slow).suggestions][0] == "precision=fp32"
    assert [o for o, _ in diagnose(perf(0.10), slow).suggestions][-1] == "precision=fp32"
    native = facts(device="cpu", placement="gpu", precision="bf16", emulated_precision=False, cpus=2)
    assert not any(o.startswith("precision") for o, _ in diagnose(perf(0.01), native).suggestions)


def test_verdict_balanced_names_one_of_each():
    verdict = diagnose(perf(0.10), facts())
    assert verdict.kind == "balanced"
    assert [o for o, _ in verdict.suggestions] == ["augmentation=gpu", "precision=amp"]


def test_report_renders_the_split_and_gpu_figures():
    gpu = {"gpu/util_mean": 41.0, "gpu/util_std": 22.0, "gpu/util_min": 3.0, "gpu/util_under_50_frac": 0.6}
    text = render(perf(0.35), diagnose(perf(0.35), facts()), steps=90, gpu=gpu)
    assert "12,800 samples/s" in text and "over 90 steps" in text and "data wait 3.50 ms (35%)" in text
    assert "): mean 41%" in text and "60% of samples under 50%" in text
    assert "`augmentation=gpu`" in text


def test_no_verdict_from_a_handful_of_steps():
    verdict = diagnose(perf(0.35), facts(), steps=3)
    assert (
        verdict.kind == "not judged"
        and "3 steady-state steps are too few" in verdict.reason
        and verdict.suggestions == []
    )
    assert diagnose(perf(0.35), facts(), steps=40).kind == "input-bound"


def test_workers_that_saturate_the_cpu_are_the_verdict_not_compute():
    """The issue's sweep job: augmentation=cpu with 2 workers on a 2-core CPU device looked
    compute-bound (315 ms against 21 ms with augmentation=gpu) because the workers took the
    cores: with the CPU load sampled, the verdict says so."""
    busy = facts(device="cpu", cpus=2, num_workers=2, placement="cpu", cpu_util=97.0)
    verdict = diagnose(perf(0.02), busy, steps=100)
    assert verdict.kind == "CPU-saturated"
    assert "this run's processes kept 97% of its 2 CPU(s) busy with 2 worker process(es)" in verdict.reason
    assert [o for o, _ in verdict.suggestions] == ["augmentation=gpu", "loader.num_workers=0"]
    assert (
        diagnose(perf(0.02), facts(device="cpu", cpus=2, num_workers=2, placement="cpu", cpu_util=60.0)).kind
        == "compute-bound"
    )
    # the GPU is busy
    assert diagnose(perf(0.02), facts(device="cuda", cpus=8, num_workers=7, cpu_util=97.0)).kind == "compute-bound"
    gpu_starved = diagnose(perf(0.40), facts(device="cuda", cpus=8, num_workers=7, placement="cpu", cpu_util=97.0))
    assert gpu_starved.kind == "CPU-saturated" and "loader.num_workers=6" in [o for o, _ in gpu_starved.suggestions]
    line = render(perf(0.02), verdict, steps=100, facts=busy)
    assert "- CPU: this run 97% of its 2 CPU(s) (main process and 2 worker(s))" in line
