"""Any optimizer, any LR scheduler, parameter groups: the presets switch cleanly, a class
named on the command line builds with nothing of another preset, every kind of torch
scheduler steps when it should (per step, per epoch, at each evaluation fed the monitored
metric) under the warm-up, and the LR it sets is the one logged."""

from __future__ import annotations

import pytest
import torch

import saturate
from saturate.errors import ConfigError, UserError
from tests.conftest import TINY, read_metrics, run_cli
from tests.trainer.test_run import events

# digits, 3 steps per epoch, the LR logged at every step
EPOCHS = [*TINY, "trainer.max_epochs=3", "optim.warmup_epochs=0", "device=cpu"]


def logged_lr(run_dir) -> list[float]:
    """train/lr at each step (float32 in TensorBoard: compared with approx)."""
    by_step = {e.step: e.value for e in events(run_dir).Scalars("train/lr")}
    return [by_step[s] for s in sorted(by_step)]


def scheduler(target: str, **arguments) -> str:
    args = "".join(f",{k}:{v}" for k, v in arguments.items())
    return f"optim.scheduler={{_target_:torch.optim.lr_scheduler.{target},_partial_:true{args}}}"


def test_a_step_lr_halves_the_lr_after_every_epoch(make_cfg):
    """StepLR(1, 0.5) stepped per epoch: epoch 1 at 0.1, then 0.05, 0.025."""
    cfg = make_cfg(*EPOCHS, scheduler("StepLR", step_size=1, gamma=0.5))
    saturate.train(cfg)
    assert logged_lr(cfg.run_dir) == pytest.approx([0.1] * 3 + [0.05] * 3 + [0.025] * 3)


def test_a_multi_step_lr_drops_at_its_milestones(make_cfg):
    cfg = make_cfg(*EPOCHS, scheduler("MultiStepLR", milestones="[2]", gamma=0.1))
    saturate.train(cfg)
    assert logged_lr(cfg.run_dir) == pytest.approx([0.1] * 6 + [0.01] * 3)


def test_a_one_cycle_lr_steps_with_the_optimizer_as_torch_computes_it(make_cfg):
    cfg = make_cfg(*EPOCHS, scheduler("OneCycleLR", max_lr=0.5, total_steps=9), "optim.scheduler_interval=step")
    saturate.train(cfg)
    reference = torch.optim.lr_scheduler.OneCycleLR(torch.optim.SGD([torch.zeros(1)], lr=0.1), 0.5, total_steps=9)
    expected = []
    for _ in range(9):  # the LR each step trains with, as logged after it: the next step's
        reference.optimizer.step()
        reference.step() if len(expected) < 8 else None
        expected.append(reference.get_last_lr()[0])
    assert logged_lr(cfg.run_dir)[:8] == pytest.approx(expected[:8])


def test_the_warm_up_multiplies_the_schedulers_lr(make_cfg):
    """One warm-up epoch (3 steps: from 0.1x, linear) on top of a constant scheduler's 0.1."""
    cfg = make_cfg(*EPOCHS, "optim.warmup_epochs=1", scheduler("ConstantLR", factor=1.0, total_iters=0))
    saturate.train(cfg)
    lrs = logged_lr(cfg.run_dir)
    assert lrs[:3] == pytest.approx([0.1 * (0.1 + 0.9 * k / 3) for k in (1, 2)] + [0.1], abs=1e-7)
    assert lrs[3:] == pytest.approx([0.1] * 6)


def test_reduce_lr_on_plateau_is_fed_the_monitored_metric_at_each_evaluation(make_cfg):
    """val/acc (checkpoint.monitor=auto) does not improve at lr 1e-9 (0.078, then 0.0625 twice):
    ReduceLROnPlateau, in mode max from the monitor, halves the LR after the third evaluation,
    past its patience of 1 (eps 0: torch ignores changes under its eps, 1e-8 by default)."""
    cfg = make_cfg(
        *EPOCHS,
        "trainer.max_epochs=5",
        "optim.optimizer.lr=1e-9",
        scheduler("ReduceLROnPlateau", patience=1, factor=0.5, eps=0),
    )
    saturate.train(cfg)
    per_epoch = logged_lr(cfg.run_dir)[::3]
    assert per_epoch == pytest.approx([1e-9, 1e-9, 1e-9, 5e-10, 5e-10], rel=1e-4)


def test_reduce_lr_on_plateau_and_the_plateau_callback_are_refused_together(tmp_path):
    result = run_cli(*TINY, scheduler("ReduceLROnPlateau"), "callbacks=[plateau]", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "callbacks.plateau='plateau': expected one plateau rule" in result.stderr


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ("optim.scheduler={_target_:torch.optim.SGD,_partial_:true}", "optim.scheduler"),
        ("optim.scheduler={_target_:torch.nn.Linear,_partial_:true,in_features:2,out_features:2}", "optim.scheduler"),
    ],
    ids=["an-optimizer", "a-module"],
)
def test_a_scheduler_node_that_is_not_a_scheduler_is_named(make_cfg, node, message):
    with pytest.raises((ConfigError, UserError)) as err:
        saturate.train(make_cfg(node))
    assert str(err.value).startswith(message) or f"  {message}" in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("overrides", "kind"),
    [
        (["optim=adam"], "Adam"),
        (["optim=rmsprop"], "RMSprop"),
        (["optim=custom", "optim.optimizer._target_=torch.optim.Adagrad", "optim.optimizer.lr=0.05"], "Adagrad"),
    ],
    ids=["adam", "rmsprop", "custom-adagrad"],
)
def test_an_optimizer_named_on_the_command_line_trains(tmp_path, overrides, kind):
    run_dir = tmp_path / "run"
    result = run_cli(*TINY, *overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)
    assert saved["optimizer_class"] == kind and read_metrics(run_dir)["status"] == "completed"


def test_a_preset_key_left_in_another_optimizers_node_says_the_fix(tmp_path):
    result = run_cli(*TINY, "optim.optimizer._target_=torch.optim.RMSprop", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "optim.optimizer.nesterov=True" in result.stderr and "optim=custom" in result.stderr


def test_parameter_groups_take_their_own_hyperparameters(make_cfg):
    """A lower LR for the first stage, no weight decay for the head; the rest as the node says
    (its biases and norms without decay)."""
    groups = "optim.param_groups=[{params: 'features.0.*', lr: 0.01},{params: ['head.*'], weight_decay: 0.0}]"
    cfg = make_cfg(groups, "optim.warmup_epochs=0")
    saturate.train(cfg)
    saved = torch.load(cfg.run_dir + "/checkpoints/last.pt", weights_only=False)["optimizer"]["param_groups"]
    summary = [(g["initial_lr"], g["weight_decay"], len(g["params"])) for g in saved]
    assert summary == [
        (0.01, 5e-4, 1),  # the first stage's kernel
        (0.01, 0.0, 2),  # its norm's weight and bias
        (0.1, 0.0, 2),  # the head, its decay off as asked
        (0.1, 5e-4, 4),  # the other kernels
        (0.1, 0.0, 8),  # their norms
    ]


def test_a_parameter_group_pattern_that_matches_nothing_is_named(make_cfg):
    with pytest.raises(ConfigError) as err:
        saturate.train(make_cfg("optim.param_groups=[{params: 'backbone.*', lr: 0.01}]"))
    assert "optim.param_groups[0].params='backbone.*': expected a pattern matching some of" in str(err.value)
