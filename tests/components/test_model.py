"""Advice that never breaks a model: before the report or tune proposes channels_last (or, on
a GPU in fp32, precision=amp), the model is run that way on two real samples; a model that
fails gets no such advice, and a user who asks for it is told which key fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import saturate
from saturate.components.model import accepts
from saturate.diagnostics.report import RunFacts, diagnose
from saturate.errors import UserError
from saturate.tasks import Classification
from saturate.tune import candidates
from tests.conftest import read_metrics
from tests.data.test_pipeline import facts, perf


class Flattened(nn.Module):
    """A LeNet-style classifier (kuangliu/pytorch-cifar's LeNet flattens so): its features
    flattened with `.view`, which a channels-last tensor does not allow; `view=False`:
    `.flatten`, which works in any layout."""

    def __init__(self, in_channels: int, num_classes: int, view: bool = True):
        super().__init__()
        self.conv, self.fc, self.view = nn.Conv2d(in_channels, 6, 3), nn.Linear(6 * 6 * 6, num_classes), view

    def forward(self, x):
        out = F.relu(self.conv(x))
        return self.fc(out.view(out.size(0), -1) if self.view else out.flatten(1))


class Lerped(nn.Module):
    """A model mixing dtypes: `torch.lerp` of a layer's output (bf16 under autocast) and a
    float32 tensor fails under autocast, and runs in fp32."""

    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.fc = nn.Linear(in_channels * 8 * 8, num_classes)

    def forward(self, x):
        out = self.fc(x.flatten(1))
        return torch.lerp(out, torch.zeros(out.shape), 0.5)


def two_images() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(2, 1, 8, 8), torch.tensor([0, 1])


@pytest.mark.parametrize("view", [True, False], ids=["view", "flatten"])
def test_the_probe_runs_the_model_in_channels_last_and_puts_it_back(view):
    model, task = Flattened(1, 10, view=view), Classification(10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert accepts(model, two_images(), task, channels_last=True, convert=True) is (not view)
    assert model.conv.weight.is_contiguous() and model.training  # back in its layout and mode
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_probe_runs_the_model_under_autocast():
    task, cpu_bf16 = Classification(10), lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    assert accepts(Lerped(1, 10), two_images(), task) is True
    assert accepts(Lerped(1, 10), two_images(), task, autocast=cpu_bf16()) is False
    assert accepts(Flattened(1, 10), two_images(), task, autocast=cpu_bf16()) is True


def model_node(name: str) -> list[str]:
    """The default config's model replaced by one of this file's (digits: 1x8x8, 10 classes)."""
    return [f"model._target_=tests.components.test_model.{name}", "~model.width", "~model.norm"]


def test_a_model_that_cannot_take_channels_last_is_not_advised_it(make_cfg):
    """The default run's report advises channels_last on a CPU; not for a model with `.view`."""
    cfg = make_cfg(*model_node("Flattened"), "device=cpu")
    saturate.train(cfg)
    fine = make_cfg(*model_node("Flattened"), "+model.view=false", "device=cpu")
    saturate.train(fine)
    judged = {}  # the verdict on these facts for a compute-bound step (3 steps are too few to judge)
    for name, run_dir in (("view", cfg.run_dir), ("flatten", fine.run_dir)):
        run_facts = read_metrics(run_dir)["facts"]
        steps_only = RunFacts(**{**run_facts, "loop_shares": {}})  # no time outside the steps
        judged[name] = [o for o, _ in diagnose(perf(0.01), steps_only).suggestions]
        judged[name + "-tune"] = candidates("channels_last", run_facts, allow=[], cuda=False)
    assert "trainer.channels_last=true" not in judged["view"] and judged["view-tune"] == []
    assert "trainer.channels_last=true" in judged["flatten"] and judged["flatten-tune"] == [
        ["trainer.channels_last=true"]
    ]


def test_asking_for_channels_last_on_such_a_model_names_the_key(make_cfg):
    with pytest.raises(UserError) as err:
        saturate.train(make_cfg(*model_node("Flattened"), "trainer.channels_last=true"))
    assert str(err.value).startswith("trainer.channels_last=true: Flattened does not take channels-last inputs")


def test_asking_for_autocast_on_a_model_that_fails_in_it_names_the_key(make_cfg):
    with pytest.raises(UserError) as err:
        saturate.train(make_cfg(*model_node("Lerped"), "precision=amp", "device=cpu"))
    assert str(err.value).startswith("precision.mode: Lerped fails under autocast to bfloat16 and runs in fp32")


def test_amp_is_not_advised_on_a_gpu_for_a_model_that_fails_under_autocast():
    advised = [o for o, _ in diagnose(perf(0.01), facts(placement="gpu", in_memory=True)).suggestions]
    assert "precision=amp" in advised
    refused = [o for o, _ in diagnose(perf(0.01), facts(placement="gpu", in_memory=True, amp_ok=False)).suggestions]
    assert "precision=amp" not in refused and refused
    f = {**facts(amp_ok=False).__dict__, "placement": "gpu"}
    assert candidates("precision", f, allow=["precision"], cuda=True) == []
    assert candidates("precision", {**f, "amp_ok": True}, allow=["precision"], cuda=True) == [["precision.mode=amp"]]
