"""Recipes of ported training scripts: a model that computes its own loss (nanoGPT's
`logits, loss = model(x, y)`), a loss summed over the batch (the VAE's), evaluation on batches
drawn at random and a training-loss estimate (nanoGPT's estimate_loss); and their mistakes, each
one line naming its key."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import saturate
from saturate.data.samplers import DrawnShard
from saturate.errors import ConfigError
from saturate.tasks.classification import Classification
from saturate.tasks.regression import Regression
from tests.conftest import TINY, read_metrics, run_cli
from tests.trainer.test_run import events

QUIET = ["trainer.progress=false", "monitor.costs=false", "optim.warmup_epochs=0"]


class OwnLoss(nn.Module):
    """nanoGPT's calling convention: forward(idx, targets=None) -> (logits, loss), logits per
    position (B, T, V)."""

    def __init__(self, vocab: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, vocab)
        self.given: list = []

    def forward(self, idx, targets=None):
        self.given.append(targets)
        logits = self.embed(idx)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def tokens(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 5, (n, 6), generator=g)
    return TensorDataset(x, (x + 1) % 5)  # the next token: one more


@pytest.mark.parametrize("target_arg", [None, "targets"])
def test_a_model_that_returns_its_own_loss_trains_on_it(tmp_path, target_arg):
    model = OwnLoss()
    metrics = saturate.fit(
        model,
        tokens(256, 0),
        tokens(64, 1),
        task=Classification(5, model_loss=1, output_key=0, target_arg=target_arg),
        overrides=["trainer.max_epochs=4", "loader.batch_size=32", "optim=adam", "optim.optimizer.lr=0.3", *QUIET]
        + ["trainer.predict=val"],
        run_dir=tmp_path,
    )
    predicted = np.load(tmp_path / "predictions" / "val.npz")
    assert predicted["output"].shape == (64, 6, 5) and predicted["target"].shape == (64, 6)  # per sample, per position
    assert all(t is not None for t in model.given)  # the targets reached the model at every call
    assert metrics["val/acc"] > 0.9  # per position: the metrics read the logits, (B, T, V) against (B, T)
    # val/loss is the model's own loss, averaged per sample
    x, y = tokens(64, 1).tensors
    with torch.no_grad():
        own = F.cross_entropy(model.embed(x).view(-1, 5), y.view(-1)).item()
    assert metrics["val/loss"] == pytest.approx(own, rel=1e-5)


def test_a_model_loss_key_that_is_not_among_the_outputs_is_one_message(tmp_path):
    with pytest.raises(ConfigError, match=r"task.model_loss=2: expected an index or key of the model's outputs"):
        saturate.fit(
            OwnLoss(), tokens(64, 0), None, task=Classification(5, model_loss=2, output_key=0), run_dir=tmp_path
        )


class Summed:
    """A loss summed over the batch's samples (reduction='sum', as pytorch/examples' VAE)."""

    def __call__(self, outputs, targets):
        return F.mse_loss(outputs, targets, reduction="sum")


def _regression_run(tmp_path, name, task, lr, *extra):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    metrics = saturate.fit(
        lambda: nn.Linear(4, 1),
        TensorDataset(x, y),
        TensorDataset(x[:64], y[:64]),
        task=task,
        overrides=["trainer.max_epochs=2", "loader.batch_size=32", "optim=sgd", f"optim.optimizer.lr={lr}", *QUIET]
        + [
            "optim.optimizer.momentum=0",
            "optim.optimizer.nesterov=false",
            "optim.optimizer.weight_decay=0",
            "trainer.deterministic=true",
            *extra,
        ],
        run_dir=tmp_path / name,
    )
    weights = torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)["model"]
    return metrics, weights


def test_a_loss_summed_over_the_batch_logs_per_sample_and_keeps_the_sums_gradient(tmp_path):
    """With loss_reduction=sum the gradient is the sum's (32 x the mean's: the same weights at
    1/32 of the LR) and train/loss, val/loss are per sample, as with the mean; accumulation adds
    the micro-batches' sums."""
    mean, mean_weights = _regression_run(tmp_path, "mean", Regression(1), 0.05)
    summed, summed_weights = _regression_run(
        tmp_path, "sum", Regression(1, loss=Summed(), loss_reduction="sum"), 0.05 / 32
    )
    pieces, pieces_weights = _regression_run(
        tmp_path, "pieces", Regression(1, loss=Summed(), loss_reduction="sum"), 0.05 / 32, "trainer.accumulate=2"
    )
    for key in ("val/loss", "train/loss"):
        assert summed[key] == pytest.approx(mean[key], rel=1e-4) == pieces[key]
    for key, value in mean_weights.items():
        assert torch.allclose(value, summed_weights[key], atol=1e-5) and torch.allclose(
            value, pieces_weights[key], atol=1e-5
        )


class Recorded(Dataset):
    """Which samples each pass over the set reads (a plain map-style set: streamed, not held)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
        self.read: list[int] = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.read.append(int(i))
        return self.x[i], self.y[i]


def test_random_validation_batches_and_a_training_loss_estimate_are_drawn_at_each_evaluation(tmp_path):
    train, val = Recorded(200, 0), Recorded(100, 1)

    class Evaluations:
        def on_run_start(self, run):  # from here on, only the evaluations read the validation set
            val.read.clear()

    saturate.fit(
        lambda: nn.Linear(4, 3),
        train,
        val,
        task=Classification(3),
        callbacks=[Evaluations()],
        overrides=[
            "trainer.max_epochs=1",
            "loader.batch_size=10",
            "loader.num_workers=0",
            "loader.resident=false",
            "trainer.eval_every=5",
            "trainer.limit_val_batches=2",
            "trainer.limit_val_random=true",
            "trainer.train_est_batches=3",
            "logger=[tensorboard,csv]",
            *QUIET,
        ],
        run_dir=tmp_path,
    )
    # four evaluations (steps 5, 10, 15, 20), each 2 batches of 10 drawn from val by the step it is made at
    assert len(val.read) == 4 * 20
    drawn = [val.read[k : k + 20] for k in range(0, 80, 20)]
    for step, seen in zip((5, 10, 15, 20), drawn, strict=True):
        expected = DrawnShard(100, 20, seed=0, rank=0, world_size=1)
        expected.set_epoch(step)
        assert seen == expected.indices
    assert len({tuple(s) for s in drawn}) == 4  # a new draw each time
    scalars = events(tmp_path)
    logged = {e.step: e.value for e in scalars.Scalars("train_est/loss")}
    assert sorted(logged) == [5, 10, 15, 20] and all(v > 0 for v in logged.values())
    assert "train_est/acc" in scalars.Tags()["scalars"]
    record = read_metrics(tmp_path)
    assert record["train_est/loss"] == logged[20]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["trainer.limit_val_random=true", "trainer.limit_val_batches=-1"],
            "trainer.limit_val_random=True: expected false, or true with trainer.limit_val_batches=N",
        ),
        (["trainer.train_est_batches=-1"], "trainer.train_est_batches=-1: expected an integer >= 0"),
        (["loader.eval_batch_size=0"], "loader.eval_batch_size=0: expected an integer >= 1 or null"),
        (["loader.order=shuffled"], "loader.order='shuffled': expected one of seeded, global, sequential"),
        (
            ["loader.order=sequential", "trainer.limit_val_random=true", "trainer.limit_val_batches=2"],
            "trainer.limit_val_random=True: expected false with loader.order=sequential",
        ),
        (["trainer.train_est_batches=100"], "trainer.train_est_batches=100: 100 batches of 32 drawn at random need"),
        (
            ["trainer.limit_val_random=true", "trainer.limit_val_batches=50"],
            "trainer.limit_val_batches=50: 50 batches of 32 drawn at random need 1600 samples, the val set has 360",
        ),
        (["loader.order=sequential"], "loader.order=sequential: the train set (InMemory) is not a stream"),
        (["task.loss_reduction=avg"], "task.loss_reduction='avg': expected mean or sum"),
        (["task.carry=maybe"], "task.carry='maybe'"),
        (["task.target_arg=2x"], "task.target_arg='2x': expected null, or the name of the model's targets argument"),
    ],
)
def test_a_bad_recipe_value_is_one_line_naming_its_key(tmp_path, overrides, says):
    result = run_cli(*TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert says in result.stderr, result.stderr[-2000:]


def test_a_training_loss_estimate_from_the_command_line_lands_in_metrics_json(tmp_path):
    result = run_cli(*TINY, "trainer.train_est_batches=1", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["train_est/loss"] > 0
