"""Settings that measure or feed a run never change what it learns: with the same seed, in
fp32 on the CPU with trainer.deterministic=true, a run with or without the start-up cost
probes, the resource monitor, the resident loader or a loader worker ends with bit-identical
metrics. The cost probes run the user's task and model (dropout, a task's own draws): run
on the global generators, they moved the random streams training then saw (issue 35: a mixup
port ended at val/acc 0.917 instead of 0.969 with monitor.costs=false)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

import saturate
from saturate.tasks.classification import Classification

BASE = [
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=4",
    "trainer.limit_val_batches=3",
    "trainer.deterministic=true",
    "trainer.progress=false",
    "precision=fp32",
    "loader.batch_size=32",
    "loader.num_workers=0",
]
# what each setting changes: nothing the model learns
SETTINGS = {
    "costs-off": ["monitor.costs=false"],
    "monitor-off": ["monitor.enabled=false"],
    "resident": ["loader.resident=true"],
    "resident-off": ["loader.resident=false"],  # the CLI's digits are resident by default (loader.resident=auto)
}


class Noisy(nn.Module):
    """A small classifier with dropout: its training forward passes draw from torch's generator."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


class MixupTask(Classification):
    """A task that draws random numbers, as the mixup port's did (facebookresearch/mixup-cifar10's
    `mixup_data` inside the loss): a weight from Beta(1, 1) and a permutation of the batch, from
    NumPy's and torch's global generators, in training only."""

    def forward(self, model, batch):
        x, y = batch
        if not model.training:
            return super().forward(model, batch)
        lam = float(np.random.beta(1.0, 1.0))
        partners = torch.randperm(len(y))
        outputs = model(lam * x + (1 - lam) * x[partners])
        loss = lam * nn.functional.cross_entropy(outputs, y) + (1 - lam) * nn.functional.cross_entropy(
            outputs, y[partners]
        )
        return loss, outputs


def _digits(dict_samples: bool = False):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16
    y = torch.tensor(digits.target)
    samples = [({"input": a, "target": b} if dict_samples else (a, b)) for a, b in zip(x, y, strict=True)]
    return samples[:1400], samples[1400:]


def _metrics(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith(("val/", "train/loss", "train/grad_norm"))}


def _fit(tmp_path, name, *, task, dict_samples=False, extra=()):
    train, val = _digits(dict_samples)
    run_task = MixupTask(10) if task == "mixup" else "classification"
    return saturate.fit(Noisy, train, val, task=run_task, overrides=[*BASE, *extra], run_dir=tmp_path / name)


@pytest.mark.parametrize(
    "case",
    ["digits-cli", "task-draws-random-numbers", "dict-batch", "augmented-images", "global-order"],
)
def test_a_measurement_or_loader_setting_leaves_the_result_bit_identical(tmp_path, make_cfg, case):
    """Each setting against the run without it: the same final metrics, bit for bit."""

    def run(name, extra):
        if case == "digits-cli":
            return saturate.train(make_cfg(*BASE, *extra, tiny=False))
        if case == "augmented-images":
            augmented = ["augmentation=gpu", "augmentation.preset=minimal"]
            return saturate.train(make_cfg(*BASE, *augmented, *extra, tiny=False))
        if case == "task-draws-random-numbers":
            return _fit(tmp_path, name, task="mixup", extra=extra)
        if case == "global-order":  # each epoch's order drawn from torch's generator, between the task's draws
            return _fit(tmp_path, name, task="mixup", extra=["loader.order=global", *extra])
        return _fit(tmp_path, name, task="classification", dict_samples=True, extra=extra)

    reference = _metrics(run("reference", []))
    assert reference and all(np.isfinite(v) for v in reference.values())
    for name, extra in SETTINGS.items():
        assert _metrics(run(name, extra)) == reference, name


@pytest.mark.parametrize("order", ["seeded", "global"])
def test_a_loader_worker_leaves_the_result_bit_identical(tmp_path, order):
    """num_workers and persistent_workers draw nothing more from the training's generators
    (seeded: the loader seeds its own; global: the iterator's one draw per pass, with or
    without workers, kept or not, as a plain DataLoader without persistent workers makes)."""
    reference = _metrics(
        _fit(tmp_path, "reference", task="mixup", extra=["trainer.max_epochs=3", f"loader.order={order}"])
    )
    for name, extra in {"worker": [], "persistent": ["loader.persistent_workers=true"]}.items():
        run = _fit(
            tmp_path,
            name,
            task="mixup",
            extra=["trainer.max_epochs=3", f"loader.order={order}", "loader.num_workers=1", *extra],
        )
        assert _metrics(run) == reference, name
