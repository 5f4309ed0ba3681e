"""Refusals of samples that do not batch, or do not match the training samples, name what
lifts them as a user writes it (the data callable's `collate` entry, a data set's
`returns_batches = True`, `loader.eval_batch_size`), and what they name does lift them."""

from __future__ import annotations

import pytest
import torch

from saturate.data import pad_collate
from saturate.errors import DataError
from tests.conftest import TINY
from tests.hostile.test_bad_input import Samples, fit, mlp, windows
from tests.tasks.test_tasks import LengthAware, MaskedMean


class Sequences(torch.utils.data.Dataset):
    """Dict samples (T, 4) of one length T, whose target is the sum of the first feature."""

    def __init__(self, n: int, length: int):
        g = torch.Generator().manual_seed(length)
        self.items = [torch.randn(length, 4, generator=g) for _ in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        x = self.items[i]
        return {"input": x, "target": x[:, 0].sum(), "weight": torch.tensor(1.0)}


def test_validation_samples_given_as_batches_are_told_samples_not_batches_must_match(tmp_path):
    """A validation set whose items are whole evaluation batches (4 windows each): its layout is
    the loader's, loader.eval_batch_size; no collate would lift it, so none is offered."""
    batches = Samples(32, lambda i: (torch.stack([windows(i)[0]] * 4), 0.0))
    with pytest.raises(DataError) as err:
        fit(mlp(), Samples(64, windows), batches, task="regression", run_dir=tmp_path)
    message = str(err.value)
    assert message.startswith("data: validation input is float32 (4, 6, 3), the training input float32 (6, 3); ")
    assert "samples must match, not batches" in message and "loader.eval_batch_size" in message
    assert "collate" not in message and "\n" not in message


def test_validation_sequences_of_another_length_name_the_collate_that_lifts_it(tmp_path):
    run = {"task": LengthAware(), "run_dir": tmp_path, "overrides": ["trainer.max_epochs=1", "loader.batch_size=8"]}
    with pytest.raises(DataError) as err:
        fit(MaskedMean, Sequences(32, 5), Sequences(16, 8), **run)
    message = str(err.value)
    assert message.startswith("data: validation input is float32 (8, 4), the training input float32 (5, 4); ")
    assert "'collate': saturate.data.pad_collate" in message and "\n" not in message
    metrics = fit(MaskedMean, Sequences(32, 5), Sequences(16, 8), collate=pad_collate, **run)
    assert metrics["progress/step"] == 4 and "val/mse" in metrics


class OwnBatches(torch.utils.data.Dataset):
    """Samples of 5 to 7 rows, batched by the data set itself: each cut or padded to 6."""

    returns_batches = True

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((5 + i % 3, 3), float(i % 5)), float(i % 5) / 5

    def __getitems__(self, indices):
        x = torch.zeros(len(indices), 6, 3)
        for row, i in enumerate(indices):
            x[row, : min(6, 5 + i % 3)] = float(i % 5)
        return x, torch.tensor([float(i % 5) / 5 for i in indices])


def test_samples_that_do_not_stack_name_returns_batches_and_it_lifts_the_refusal(tmp_path):
    plain = Samples(64, OwnBatches().__getitem__)
    with pytest.raises(DataError) as err:
        fit(mlp(), plain, task="regression", run_dir=tmp_path / "plain")
    message = str(err.value)
    assert "returns_batches = True" in message and "'collate': saturate.data.pad_collate" in message
    metrics = fit(mlp(), OwnBatches(), task="regression", run_dir=tmp_path / "own")
    assert metrics["progress/step"] == 2


def test_samples_that_do_not_stack_at_a_batch_name_the_collate_and_returns_batches(tmp_path):
    """Sample 5 alone is longer: the look at a few samples at the start misses it, the batch meets it."""
    odd = Samples(64, lambda i: (torch.zeros(7 if i == 5 else 6, 3), 0.0))
    with pytest.raises(DataError) as err:  # through the DataLoader's collate (a resident set is read otherwise)
        fit(mlp(), odd, task="regression", run_dir=tmp_path, overrides=[*TINY, "loader.resident=false"])
    message = str(err.value)
    assert "samples do not stack into a batch: the input of one sample has shape" in message
    assert "returns_batches = True" in message and "'collate': saturate.data.pad_collate" in message
