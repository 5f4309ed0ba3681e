"""Iteration recipes for the learning rate: a warm-up counted in optimizer steps
(optim.warmup_steps) from a chosen factor (optim.warmup_start_factor), and a cosine whose
length is its own (optim.decay_steps), read back from real runs' metrics.csv; the resumed run
continues the same curve; each mistake is one line naming the key."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from hydra.errors import CompactHydraException

import saturate
from saturate.components.optim import lr_factor, setup_optimizer
from saturate.config.schema import OptimConfig
from tests.conftest import TINY, run_cli

LR = 0.1  # optim=sgd's
# nanoGPT's recipe, scaled down: 5 warm-up iterations, the cosine down to a tenth at 20, 30 in all
WARMUP, DECAY, MIN_RATIO, STEPS = 5, 20, 0.1, 30
NANO = [
    f"optim.warmup_steps={WARMUP}",
    f"optim.warmup_start_factor={1 / (WARMUP + 1)!r}",
    f"optim.decay_steps={DECAY}",
    f"optim.min_lr_ratio={MIN_RATIO}",
    f"trainer.max_steps={STEPS}",
]
# one epoch of STEPS optimizer steps, each logged (metrics.csv: the values as Python prints them)
LOGGED = ["logger=[csv]", "monitor.costs=false", "loader.batch_size=8", "trainer.limit_val_batches=1"]
ONE_EPOCH = [f"trainer.limit_train_batches={STEPS}", "trainer.max_epochs=1", *LOGGED]


def get_lr(it: int) -> float:
    """nanoGPT's train.py, as its author wrote it (learning_rate, min_lr, warmup_iters,
    lr_decay_iters from the recipe above)."""
    learning_rate, min_lr, warmup_iters, lr_decay_iters = LR, LR * MIN_RATIO, WARMUP, DECAY
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


def logged_lr(run_dir) -> dict[int, float]:
    """train/lr by step, from metrics.csv: after step s it is the LR step s+1 trains with,
    nanoGPT's get_lr(s)."""
    with open(Path(run_dir) / "metrics.csv", newline="") as f:
        return {int(row["step"]): float(row["value"]) for row in csv.DictReader(f) if row["name"] == "train/lr"}


# -- the factor itself


def test_lr_factor_warms_up_from_its_start_factor_and_decays_to_its_own_end():
    factor = dict(warmup=4, total=12, schedule="cosine", min_ratio=0.2, start=0.0)
    assert [lr_factor(s, **factor) for s in range(5)] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert lr_factor(8, **factor) == pytest.approx(0.6)  # half way down the cosine, from 1 to 0.2
    assert [lr_factor(s, **factor) for s in (12, 13, 100)] == pytest.approx([0.2] * 3)  # at the end, and after it
    assert lr_factor(1, warmup=2, total=9, schedule="constant", min_ratio=0.0) == pytest.approx(0.55)  # from 0.1


def _schedule(steps_per_epoch: int = 4, total: int = 40, **optim):
    model = torch.nn.Linear(2, 1)
    node = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": LR}
    cfg = OptimConfig(optimizer=node, **optim)
    return setup_optimizer(cfg, model, steps_per_epoch=steps_per_epoch, total_steps=total, global_batch=8)


def _lrs(optimizer, schedule, steps: int) -> list[float]:
    """The LR each of `steps` optimizer steps trains with."""
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return seen


@pytest.mark.parametrize(
    ("optim", "warm"),
    [({}, 4), ({"warmup_steps": 2}, 2), ({"warmup_epochs": 0.5}, 2), ({"warmup_epochs": 0, "warmup_steps": 3}, 3)],
    ids=["an-epoch-by-default", "in-steps", "in-epochs", "no-epochs-and-steps"],
)
def test_the_warm_up_is_an_epoch_unless_its_steps_are_set(optim, warm):
    lrs = _lrs(*_schedule(schedule="constant", **optim), steps=6)
    assert lrs == pytest.approx([LR * (0.1 + 0.9 * min(1, s / warm)) for s in range(6)])


def test_an_epoch_warm_up_of_zero_is_none():
    assert _lrs(*_schedule(schedule="constant", warmup_epochs=0), steps=3) == pytest.approx([LR] * 3)


# -- real runs: the LR logged at every step


def test_the_nanogpt_recipe_is_nanogpts_lr_at_every_step(make_cfg):
    cfg = make_cfg(*ONE_EPOCH, *NANO)
    saturate.train(cfg)
    logged = logged_lr(cfg.run_dir)
    assert sorted(logged) == list(range(1, STEPS + 1))
    for step, lr in logged.items():
        assert lr == pytest.approx(get_lr(step), abs=1e-6), step
    assert logged[DECAY] == logged[STEPS] == pytest.approx(LR * MIN_RATIO)  # reached, and kept


def test_a_cosine_longer_than_the_run_stops_above_its_minimum_and_resumes_along_it(make_cfg):
    """A run of 12 steps ends part way down a cosine to step 20 (decay_steps), above its minimum;
    resumed to 30 steps, it continues the same curve: each LR is nanoGPT's."""
    cfg = make_cfg(*ONE_EPOCH, *NANO, "trainer.max_steps=12")
    saturate.train(cfg)
    end = logged_lr(cfg.run_dir)[12]
    assert end == pytest.approx(get_lr(12), abs=1e-6) and end > LR * MIN_RATIO + 0.04  # 0.0597, not 0.01
    resumed = make_cfg(*ONE_EPOCH, *NANO, f"run_dir={cfg.run_dir}", "trainer.resume=auto")
    saturate.train(resumed)
    logged = logged_lr(cfg.run_dir)
    assert sorted(logged) == list(range(1, STEPS + 1))
    for step, lr in logged.items():
        assert lr == pytest.approx(get_lr(step), abs=1e-6), step


def test_a_warm_up_in_steps_multiplies_a_step_lr(make_cfg):
    """StepLR(1, 0.5) per epoch (3 steps each) under a 4-step warm-up from 0.2 x: the warm-up
    crosses the first epoch's end, the scheduler's own LR halving beneath it."""
    node = "optim.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:1,gamma:0.5}"
    overrides = ["trainer.max_epochs=3", node, "optim.warmup_steps=4", "optim.warmup_start_factor=0.2"]
    cfg = make_cfg(*LOGGED, *overrides)
    saturate.train(cfg)
    logged = logged_lr(cfg.run_dir)
    expected = {s: LR * 0.5 ** ((s - 1) // 3) * (0.2 + 0.8 * min(1, s / 4)) for s in range(1, 10)}
    assert logged == pytest.approx(expected, abs=1e-7)


# -- schedule state


def test_a_checkpoint_older_than_the_schedule_object_continues_the_warm_up():
    """A checkpoint whose schedule entry is the built-in LambdaLR's own state (written before
    the schedule object wrapped it) resumes at its step, inside a warm-up in steps."""
    recipe = {"warmup_steps": 5, "warmup_start_factor": 0.0, "decay_steps": 20}
    optimizer, schedule = _schedule(**recipe)
    _lrs(optimizer, schedule, 3)
    saved_optimizer, old_state = optimizer.state_dict(), schedule.inner.state_dict()
    later = _lrs(optimizer, schedule, 5)
    optimizer, schedule = _schedule(**recipe)
    optimizer.load_state_dict(saved_optimizer)
    schedule.load_state_dict(old_state)
    assert _lrs(optimizer, schedule, 5) == pytest.approx(later)


# -- mistakes: one line, naming the key


def test_a_warm_up_in_steps_beside_one_in_epochs_is_one_line_before_any_work(tmp_path):
    result = run_cli(*TINY, "optim.warmup_steps=5", "optim.warmup_epochs=1", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    says = "optim.warmup_steps=5: expected unset beside optim.warmup_epochs=1.0 (one warm-up: in steps or in epochs)"
    assert says in result.stderr.splitlines()[-1], result.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists()


def refused(make_cfg, *overrides: str) -> str:
    """The message of a run refused: one problem, one line under the config's header."""
    cfg = make_cfg(*overrides)
    with pytest.raises(CompactHydraException) as err:
        saturate.train(cfg)
    message = str(err.value)
    assert "Traceback" not in message and len(message.splitlines()) <= 2 and len(message) < 400, message
    assert not (Path(cfg.run_dir) / "checkpoints").exists()  # before the first step
    return message


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["optim.warmup_steps=-1"], "optim.warmup_steps=-1: expected an integer >= 0"),
        (["optim.decay_steps=-3"], "optim.decay_steps=-3: expected an integer >= 1"),
        (["optim.warmup_start_factor=2"], "optim.warmup_start_factor=2.0: expected a number in [0, 1]"),
        (
            ["optim.decay_steps=10", "optim.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true}"],
            "optim.decay_steps=10: expected unset",
        ),
        (["optim.decay_steps=10", "optim.schedule=constant"], "optim.decay_steps=10: expected unset"),
        (["optim.decay_steps=5", "optim.warmup_steps=5"], "optim.decay_steps=5: expected an optimizer step after"),
    ],
    ids=["negative-warm-up", "negative-decay", "start-factor-2", "with-scheduler", "constant", "short"],
)
def test_a_mistaken_recipe_is_one_line_before_any_work(make_cfg, overrides, says):
    assert says in refused(make_cfg, *overrides)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["trainer.max_steps=2", "optim.warmup_steps=3"], "optim.warmup_steps=3: expected at most the run's 2"),
        (["optim.warmup_steps=4"], "optim.warmup_steps=4: expected at most the run's 3"),  # 1 epoch of 3 steps
        (["optim.warmup_epochs=0.5", "optim.decay_steps=1"], "optim.decay_steps=1: expected an optimizer step after"),
    ],
    ids=["beyond-max-steps", "beyond-the-epochs", "within-an-epoch-warm-up"],
)
def test_a_recipe_longer_than_the_run_is_refused_with_its_length(make_cfg, overrides, says):
    assert says in refused(make_cfg, *overrides)
