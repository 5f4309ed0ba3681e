"""The values of optim.param_groups, optim.scheduler, mix.transform, segmentation masks and
target.metric: each mistake is one line naming the key (or the data), the bad value and what
is allowed, before any work where the config can tell; a scheduler that fails in the middle
of a run stops it at its last finished step, saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra.errors import CompactHydraException

import saturate
from saturate.config.groups import TargetConfig
from saturate.errors import ConfigError, DataError, UserError
from saturate.tasks import Segmentation
from tests.conftest import read_metrics
from tests.tasks.test_segmentation import SEGMENT, Squares, tiny_segmenter


def refused(make_cfg, *overrides: str) -> str:
    with pytest.raises(CompactHydraException) as err:
        saturate.train(make_cfg(*overrides))
    message = str(err.value)
    assert "Traceback" not in message and len(message) < 600, message
    return message


# -- optim.param_groups: each value checked as optim.optimizer's, before any work


@pytest.mark.parametrize(
    ("group", "says"),
    [
        ("{params: '*', lr: -1}", "optim.param_groups[0].lr=-1: expected a value torch.optim.SGD takes (Invalid"),
        ("{params: '*', lr: fast}", "optim.param_groups[0].lr='fast': expected a number (SGD's lr)"),
        ("{params: '*', weight_decay: -5}", "optim.param_groups[0].weight_decay=-5: expected a value torch.optim.SGD"),
        ("{params: '*', momentum: -0.5}", "optim.param_groups[0].momentum=-0.5: expected a value torch.optim.SGD"),
        ("{params: '*', lrr: 0.5}", "optim.param_groups[0].lrr=0.5: expected an argument of torch.optim.SGD (did you"),
    ],
)
def test_a_parameter_groups_values_are_checked_before_any_work(make_cfg, group, says):
    cfg = make_cfg(f"optim.param_groups=[{group}]")
    with pytest.raises(ConfigError) as err:
        saturate.train(cfg)
    assert says in str(err.value), str(err.value)
    assert not (Path(cfg.run_dir) / "checkpoints").exists()  # refused with the config, before the data and model


def test_a_parameter_groups_lr_is_judged_with_the_optimizers_words(make_cfg):
    group = refused(make_cfg, "optim.param_groups=[{params: '*', lr: -1}]")
    own = refused(make_cfg, "optim.optimizer.lr=-1")
    assert own.split("optim.optimizer.lr=-1: ")[1] == group.split("optim.param_groups[0].lr=-1: ")[1]


def test_a_misspelt_group_key_is_answered_with_the_key_meant(make_cfg):
    assert "did you mean lr?" in refused(make_cfg, "optim.param_groups=[{params: '*', lrr: 0.5}]")


def test_a_key_of_the_users_own_stays_in_its_group(make_cfg):
    """torch keeps any key in a parameter group (a `name` a user's code reads): one that is no
    misspelling of the optimizer's arguments is not refused."""
    cfg = make_cfg("optim.param_groups=[{params: '*', name: head, lr: 0.05}]")
    saturate.train(cfg)
    assert json.loads((Path(cfg.run_dir) / "metrics.json").read_text())["status"] == "completed"


def test_a_group_whose_parameters_an_earlier_group_took_is_told_so(make_cfg):
    message = refused(make_cfg, "optim.param_groups=[{params: '*'}, {params: 'features.*', lr: 0.5}]")
    assert "optim.param_groups[1].params='features.*'" in message
    assert "optim.param_groups[0] took them" in message and "matching some of" not in message


# -- optim.scheduler: values torch would divide by, a cycle shorter than the run, a failure mid-run


SCHEDULER = ["+optim.scheduler._partial_=true"]


@pytest.mark.parametrize(
    ("node", "says"),
    [
        (["+optim.scheduler._target_=torch.optim.lr_scheduler.StepLR", "+optim.scheduler.step_size=0"], "step_size=0"),
        (
            ["+optim.scheduler._target_=torch.optim.lr_scheduler.CosineAnnealingLR", "+optim.scheduler.T_max=0"],
            "T_max=0",
        ),
    ],
)
def test_a_scheduler_period_of_zero_is_refused_with_the_config(make_cfg, node, says):
    message = refused(make_cfg, *SCHEDULER, *node)
    assert f"optim.scheduler.{says}: expected an integer >= 1" in message


def test_a_scheduler_period_of_another_type_is_one_problem(make_cfg):
    node = ["+optim.scheduler._target_=torch.optim.lr_scheduler.StepLR", "+optim.scheduler.step_size=2.0"]
    message = refused(make_cfg, *SCHEDULER, *node)
    assert "(1 problem)" in message and "optim.scheduler.step_size=2.0: expected an integer" in message, message


def test_a_one_cycle_shorter_than_the_run_is_refused_before_training(make_cfg):
    node = ["+optim.scheduler._target_=torch.optim.lr_scheduler.OneCycleLR", "+optim.scheduler.max_lr=0.1"]
    cfg = make_cfg(*SCHEDULER, *node, "+optim.scheduler.total_steps=2", "optim.scheduler_interval=step")
    with pytest.raises(ConfigError) as err:
        saturate.train(cfg)
    assert "optim.scheduler.total_steps=2: expected at least the run's 3 scheduler steps" in str(err.value)
    assert not (Path(cfg.run_dir) / "checkpoints" / "last.pt").exists()


def fails_after_the_first_epoch(epoch: int) -> float:
    """A LambdaLR factor that raises once the schedule moves past its start."""
    if epoch:
        raise ArithmeticError("no factor past the start")
    return 1.0


@pytest.mark.parametrize(
    ("node", "says"),
    [
        (
            ["+optim.scheduler._target_=torch.optim.lr_scheduler.ExponentialLR", "+optim.scheduler.gamma=-1"],
            "optim.scheduler: ExponentialLR set a negative learning rate (-0.1) at step 3",
        ),
        (
            [
                "+optim.scheduler._target_=torch.optim.lr_scheduler.LambdaLR",
                f"+optim.scheduler.lr_lambda._target_={__name__}.fails_after_the_first_epoch",
                "+optim.scheduler.lr_lambda._partial_=true",
            ],
            "optim.scheduler: LambdaLR failed at step 3: ArithmeticError: no factor past the start",
        ),
    ],
)
def test_a_scheduler_that_fails_mid_run_stops_it_with_the_epoch_saved(make_cfg, node, says):
    cfg = make_cfg(*SCHEDULER, *node, "trainer.max_epochs=2", "optim.warmup_epochs=0", "optim.optimizer.lr=0.1")
    with pytest.raises(UserError) as err:
        saturate.train(cfg)
    message = str(err.value)
    assert says in message and "\n" not in message, message
    assert "the last finished step (3) is saved" in message
    saved = torch.load(Path(cfg.run_dir) / "checkpoints" / "last.pt", weights_only=True)
    assert saved["step"] == 3 and saved["epoch"] == 1
    record = read_metrics(cfg.run_dir)
    assert record["status"] == "failed" and says in record["error"]


# -- mix.transform: a node that builds to nothing callable


def test_a_mix_transform_that_builds_to_no_callable_is_refused(make_cfg):
    message = refused(make_cfg, "+mix.transform._target_=builtins.print")
    assert "mix.transform._target_='builtins.print'" in message and "_partial_: true" in message


# -- segmentation masks, checked on the first batch


class Masks(Squares):
    """Squares whose masks a test spoils."""

    def __init__(self, n: int, spoil, seed: int = 0):
        super().__init__(n, seed)
        self.masks = spoil(self.masks)


@pytest.mark.parametrize(
    ("spoil", "overrides", "says"),
    [
        (lambda m: m.float() * 0.75, [], "non-integer values (0.75)"),
        (lambda m: (m * 255).to(torch.uint8), [], "255 (values found: 0, 255); task=segmentation with 2 classes"),
        (lambda m: (m * 255).to(torch.uint8), [], "0 to 1: looks like a 0/255 mask; divide by 255 or map it"),
        (lambda m: m * 7, [], "7 (values found: 0, 7)"),
        (
            lambda m: m - 1,
            [],
            "-1 (values found: -1, 0); task=segmentation with 2 classes takes class indices 0 to 1: set "
            "task.ignore_index=-1",
        ),
    ],
)
def test_masks_that_do_not_hold_the_tasks_classes_are_refused_in_one_line(tmp_path, spoil, overrides, says):
    with pytest.raises(DataError) as err:
        saturate.fit(
            tiny_segmenter,
            Masks(32, spoil),
            Masks(8, spoil, 1),
            task="segmentation",
            run_dir=tmp_path,
            overrides=[*SEGMENT, *overrides],
        )
    message = str(err.value)
    assert message.startswith("data: the first batch's masks") and says in message and "\n" not in message, message


def test_masks_of_the_tasks_classes_with_ignored_pixels_pass_the_check(caplog):
    task = Segmentation(3, ignore_index=255)
    task.check_masks(torch.tensor([[[0, 1], [2, 255]]]))  # nothing raised, nothing said
    assert not caplog.records
    # only background and ignored pixels: a batch of empty slices, or a 0/255 mask read with ignore_index=255
    task.check_masks(torch.tensor([[[0, 0], [0, 255]]]))
    assert "every foreground pixel is left out" in caplog.text


# -- target.metric: a per-class metric is met through its elements


def test_a_per_class_vector_is_no_target_and_its_elements_are():
    task = Segmentation(3)
    with pytest.raises(ConfigError) as err:
        TargetConfig(metric="val/dice_class", value=0.1).resolved(task, True)
    assert "val/dice_class/0, val/dice_class/1, val/dice_class/2" in str(err.value)
    assert TargetConfig(metric="val/dice_class/1", value=0.1).resolved(task, True) == ("val/dice_class/1", "max")


def test_a_target_on_a_per_class_element_is_met(tmp_path):
    def three(masks: torch.Tensor) -> torch.Tensor:  # classes 0 and 2 of 3
        return masks * 2

    class Three(Masks):
        num_classes = 3

    def model(in_channels: int) -> torch.nn.Module:
        return torch.nn.Conv2d(in_channels, 3, 3, padding=1)

    overrides = [*SEGMENT, "target.metric=val/dice_class/1", "target.value=0.0"]
    saturate.fit(
        model, Three(32, three), Three(8, three, 1), task="segmentation", run_dir=tmp_path, overrides=overrides
    )
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert "val/dice_class/1" in record and record["time/to_target_s"] > 0


def test_an_optimizer_that_refuses_the_stand_in_itself_has_no_value_blamed():
    """torch.optim.Muon takes only 2-D parameters: the one-element stand-in says nothing of
    its values, so none is blamed (the run's build tries it on the model's own)."""
    from saturate.config.optim_values import optimizer_problems

    assert list(optimizer_problems({"_target_": "torch.optim.Muon", "lr": 0.02}, [])) == []
    assert list(optimizer_problems({"_target_": "torch.optim.SGD", "lr": -1}, []))  # a class that takes it: judged
