"""Several inputs: a sample's input may be a tensor, a tuple or list of tensors, or a dict of
them (or, for dict samples, several keys named by task.input_key); the model gets them by one
rule (`model(x)`, `model(*inputs)`, `model(**inputs)`), through fit and the config path, in
memory and resident, and a sample the rule cannot take is refused naming the entry."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import saturate
from saturate.errors import UserError
from tests.conftest import TINY, read_metrics


def windows(n: int, seed: int = 0):
    """A past window (8, 3), calendar features (4,), and the next value: the sum of the
    window's last row plus the calendar's first feature (learnable from both inputs)."""
    g = torch.Generator().manual_seed(seed)
    past, calendar = torch.randn(n, 8, 3, generator=g), torch.randn(n, 4, generator=g)
    return past, calendar, past[:, -1].sum(1, keepdim=True) + calendar[:, :1]


class Pairs(Dataset):
    """((past, calendar), target) pairs, or ({"past", "calendar"}, target) with `as_dict`."""

    def __init__(self, n: int, seed: int = 0, as_dict: bool = False):
        self.past, self.calendar, self.y = windows(n, seed)
        self.as_dict = as_dict

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        inputs = (
            {"past": self.past[i], "calendar": self.calendar[i]} if self.as_dict else (self.past[i], self.calendar[i])
        )
        return inputs, self.y[i]


class Records(Pairs):
    """Dict samples holding each input under its own key, beside the target."""

    def __getitem__(self, i):
        return {"x": self.past[i], "x_mark": self.calendar[i], "y": self.y[i], "id": i}


class TwoInputs(nn.Module):
    """forward(past, calendar): the past window and the calendar features as two arguments."""

    def __init__(self):
        super().__init__()
        self.past, self.calendar = nn.Linear(24, 16), nn.Linear(4, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, past, calendar):
        return self.head(torch.relu(self.past(past.flatten(1)) + self.calendar(calendar)))


LONGER = [*TINY, "trainer.limit_train_batches=-1", "trainer.max_epochs=8", "optim=adamw", "optim.optimizer.lr=0.01"]


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_a_tuple_or_a_dict_of_inputs_reaches_the_model_as_its_arguments(tmp_path, as_dict):
    metrics = saturate.fit(
        TwoInputs,
        Pairs(256, as_dict=as_dict),
        Pairs(64, 1, as_dict=as_dict),
        task="regression",
        run_dir=tmp_path,
        overrides=LONGER,
    )
    first = read_metrics(tmp_path)
    assert first["status"] == "completed" and metrics["val/rmse"] < 0.5 * torch.std(windows(64, 1)[2]).item()


def test_several_keys_of_a_dict_sample_are_the_models_inputs_in_order(tmp_path):
    overrides = [*LONGER, "task.input_key=[x,x_mark]", "task.target_key=y"]
    metrics = saturate.fit(
        TwoInputs, Records(256), Records(64, 1), task="regression", run_dir=tmp_path, overrides=overrides
    )
    assert metrics["val/rmse"] < 0.5 * torch.std(windows(64, 1)[2]).item()


def test_several_inputs_held_resident_train_the_same_as_streamed(tmp_path):
    runs = {}
    for loader in ("default", "resident"):
        runs[loader] = saturate.fit(
            TwoInputs,
            Pairs(128),
            Pairs(32, 1),
            task="regression",
            run_dir=tmp_path / loader,
            overrides=[*TINY, f"loader={loader}", "loader.batch_size=32", "loader.num_workers=0"],
        )
    assert runs["default"]["val/loss"] == pytest.approx(runs["resident"]["val/loss"], rel=1e-5)


class Broken(Pairs):
    def __getitem__(self, i):
        return (self.past[i], "monday"), self.y[i]


def test_an_input_the_rule_cannot_take_is_named_in_one_message(tmp_path):
    with pytest.raises(UserError) as err:
        saturate.fit(TwoInputs, Broken(64), Broken(16, 1), task="regression", run_dir=tmp_path)
    message = str(err.value)
    assert "input[1] is a str" in message and "tuple, list or dict" in message


class TwoHeads(nn.Module):
    """A classifier with an auxiliary head (as GoogLeNet's, or a deep-supervision U-Net's):
    {"main": logits, "aux": logits}."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU())
        self.main, self.aux = nn.Linear(32, num_classes), nn.Linear(32, num_classes)

    def forward(self, x):
        h = self.body(x)
        return {"main": self.main(h), "aux": self.aux(h)}


def main_and_aux(outputs, targets):
    """The author's combined loss: the main head's cross-entropy plus 0.4 of the auxiliary's."""
    ce = nn.functional.cross_entropy
    return ce(outputs["main"], targets) + 0.4 * ce(outputs["aux"], targets)


class Blobs(Dataset):
    """Two Gaussian blobs in 6 dimensions, one per class."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 2, (n,), generator=g)
        self.x = torch.randn(n, 6, generator=g) + 2.0 * self.y[:, None].float()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_a_model_with_two_heads_trains_on_a_combined_loss_and_its_metrics_read_one_head(tmp_path):
    seen = []

    def loss(outputs, targets):
        seen.append(sorted(outputs))
        return main_and_aux(outputs, targets)

    metrics = saturate.fit(
        TwoHeads, Blobs(256), Blobs(64, 1), loss=loss, run_dir=tmp_path, overrides=[*LONGER, "task.output_key=main"]
    )
    assert seen and all(keys == ["aux", "main"] for keys in seen)  # the loss gets every head
    assert metrics["val/acc"] > 0.9  # read from the main head: (B, 2) logits


def test_a_model_with_two_heads_and_no_output_key_is_told_how_to_name_one(tmp_path):
    with pytest.raises(UserError) as err:
        saturate.fit(TwoHeads, Blobs(64), Blobs(16, 1), run_dir=tmp_path, overrides=TINY)
    assert "returns several outputs (dict of 2)" in str(err.value) and "task.output_key" in str(err.value)
