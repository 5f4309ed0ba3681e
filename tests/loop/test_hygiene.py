"""Hot-loop hygiene: between log steps the loop never reads a tensor back to the host (on a
GPU every such read is a synchronisation). Counted on the CPU by wrapping torch.Tensor's
host-reading methods while the loop runs, outside logging, evaluation and checkpointing."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

import saturate
from saturate.checkpoint.checkpointer import Checkpointer
from saturate.data import augment
from saturate.data.augment import Preview
from saturate.data.loader import ResidentLoader, ResumableSampler
from saturate.loop.engine import Engine
from saturate.loop.evaluate import Evaluator
from saturate.tasks.sequence import Sequence
from tests.conftest import ROOT

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """Records which host reads happen while the training loop runs, outside the places
    allowed to read (log steps, evaluation, checkpoints, the stop check)."""
    reads: list[str] = []
    counting = [False]

    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name, **kwargs):
            if counting[0]:
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)

    def quiet(cls, method):
        original = getattr(cls, method)

        def wrapper(*args, **kwargs):
            before, counting[0] = counting[0], False
            try:
                return original(*args, **kwargs)
            finally:
                counting[0] = before

        monkeypatch.setattr(cls, method, wrapper)

    # allowed to read: log steps, stopping, evaluation, checkpoints, the image grid shown when
    # an augmentation policy starts, and the DataLoader starting an epoch (its seed and sample
    # order: CPU tensors, once per epoch)
    allowed = [
        (Engine, "log_train"),
        (Engine, "halt"),
        (Engine, "evaluate"),  # the evaluation, its logging (previews, confusion matrices) and the test split's
        (Checkpointer, "save"),
        (Preview, "__call__"),
        (DataLoader, "__iter__"),
        (ResumableSampler, "__iter__"),
        (ResidentLoader, "order"),  # the same for the resident loader (loader.order=global: the seed it draws)
        (augment, "kornia_pipeline"),  # built once per policy
        # CTC's frame counts against its target lengths: both live on the host (Sequence.host_keys,
        # the model's output lengths where it computes them there): no synchronisation on a GPU
        (Sequence, "_too_few_frames"),
        (Sequence, "_check_labels"),  # CTC's labels, in the run's first CHECK_LABELS (3) batches only
    ]
    for cls, method in allowed:
        quiet(cls, method)
    original_fit = Engine.fit

    def fit(self, state):
        counting[0] = True
        try:
            return original_fit(self, state)
        finally:
            counting[0] = False

    monkeypatch.setattr(Engine, "fit", fit)
    return reads


def example(name: str) -> list[str]:
    """An example's experiment from its own config dir (tests/e2e/test_examples.py runs them)."""
    return [
        f"hydra.searchpath=[file://{ROOT / 'examples' / name / 'conf'}]",
        f"experiment={name}",
        "trainer.max_epochs=1",
    ]


SETTINGS = {
    "resident": ["loader=resident"],
    "default-loader": ["loader=default"],
    "resident-gpu-augmentation": ["loader=resident", "augmentation=gpu"],
    "ema": ["callbacks=[ema]"],
    "early-stopping-plateau": ["callbacks=[early_stopping,plateau]"],
    # fused: the example's own Adam (not fused, as its author's) reads its step count each step, in torch
    "regression-pm25": [*example("pm25"), "optim.optimizer.fused=true"],
    "sequence-ctc-dict-batches": example("sign"),
    "classification-user-metrics-har": example("har"),
    "kornia-float-images": [*example("gray128"), "loader.batch_size=8"],
    # masks moved with their images, evaluations inside the epoch, ReduceLROnPlateau
    "segmentation": [*example("segmentation"), "loader.batch_size=4", "data.size=32"],
    "mixup": example("mixup"),
    "cutmix-and-mixup": [*example("mixup"), "mix.cutmix=1.0"],
    "two-inputs-epoch-lambda-lr": example("forecast"),
    "one-cycle-per-step": [
        "optim.scheduler={_target_:torch.optim.lr_scheduler.OneCycleLR,_partial_:true,max_lr:0.1,total_steps:20}",
        "optim.scheduler_interval=step",
    ],
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_no_host_reads_between_log_steps(make_cfg, host_reads, setting):
    """Every built-in task (classification, regression, sequence with CTC over dict batches),
    the built-in callbacks and the user's Kornia transforms: nothing read per step."""
    cfg = make_cfg(
        *SETTINGS[setting], "trainer.skip_nonfinite=false", "trainer.log_interval=5", "trainer.limit_train_batches=10"
    )
    assert saturate.train(cfg)["progress/step"] == 10
    assert host_reads == []


def test_the_default_non_finite_guard_decides_on_the_device(make_cfg, host_reads):
    cfg = make_cfg(
        "loader=resident", "trainer.skip_nonfinite=true", "trainer.log_interval=5", "trainer.limit_train_batches=10"
    )
    assert saturate.train(cfg)["progress/step"] == 10
    assert host_reads == []  # the presets' fused optimizer skips a bad step itself


def test_the_non_finite_guard_reads_one_scalar_per_step_without_a_fused_optimizer(make_cfg, host_reads):
    cfg = make_cfg(
        "loader=resident",
        "trainer.skip_nonfinite=true",
        "optim.optimizer.fused=false",
        "trainer.log_interval=5",
        "trainer.limit_train_batches=10",
    )
    saturate.train(cfg)
    assert host_reads == ["item"] * 10  # the documented price of skipping a bad step before the optimizer takes it


# ops that synchronise with a CUDA device whatever calls them: their output's size, or a count,
# depends on the data (a Python-level read is counted by HOST_READS)
SYNCING_OPS = {
    "nonzero",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "masked_select",
    "bincount",
    "repeat_interleave",
}


class DeviceSyncs(TorchDispatchMode):
    """Counts the ops in SYNCING_OPS (and indexing by a boolean mask) while active."""

    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masked = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        )
        if name in SYNCING_OPS or masked:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def evaluation_reads(make_cfg, monkeypatch, overrides: list[str], batches: int) -> collections.Counter:
    """Host reads and syncing ops inside evaluations, for a run evaluating `batches` batches."""
    counts: collections.Counter = collections.Counter()
    counting = [False]
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name, **kwargs):
            if counting[0]:
                counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    original_run = Evaluator.run

    def run(self, *args, **kwargs):
        counting[0] = True
        try:
            with DeviceSyncs(counts):
                return original_run(self, *args, **kwargs)
        finally:
            counting[0] = False

    monkeypatch.setattr(Evaluator, "run", run)
    saturate.train(make_cfg(*overrides, "trainer.limit_train_batches=2", f"trainer.limit_val_batches={batches}"))
    monkeypatch.undo()
    return counts


EVALUATIONS = {  # the reads each further evaluation batch costs
    "classification": ([], {}),
    "classification-top5-confusion": (["task.top_k=5", "task.confusion_matrix=true"], {"bincount": 1}),
    "regression-pm25-mape": (example("pm25"), {}),
    "user-per-class-f1-har": (example("har"), {"bincount": 2}),  # per-class F1 and the confusion matrix: torch.bincount
    # greedy decoding on the host: the lengths are there already; on a GPU the decoded outputs
    # and targets come over in one copy (here they are host tensors: no copy)
    # and CTC's frame counts against the target lengths, both on the host (a `nonzero` there: no copy)
    "sequence-ctc": (example("sign"), {"tolist": 4, "nonzero": 1}),
    "segmentation": ([*example("segmentation"), "data.size=32"], {}),
}


@pytest.mark.parametrize("setting", list(EVALUATIONS))
def test_an_evaluation_batch_reads_the_device_only_where_documented(make_cfg, monkeypatch, setting):
    """The built-in metrics skip torchmetrics' argument validation and NaN checks (2-3 reads per
    batch on CUDA); what is left per batch is named here and in saturate.loop.evaluate."""
    overrides, per_batch = EVALUATIONS[setting]
    few, more = (evaluation_reads(make_cfg, monkeypatch, overrides, n) for n in (2, 4))
    extra = {k: (more[k] - few[k]) / 2 for k in set(few) | set(more) if more[k] != few[k]}
    assert extra == per_batch
