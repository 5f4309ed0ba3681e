"""Evaluation inside the epoch (trainer.eval_every): every N optimizer steps or a fraction of
an epoch, each evaluation placed at its step in TensorBoard, saved (last.pt, best.pt), counted
by early stopping, and optionally the test split at each."""

from __future__ import annotations

import logging

import pytest
import torch

import saturate
from tests.conftest import read_metrics
from tests.trainer.test_run import events

# digits: 1437 training samples, batch 128 (11 steps per epoch, the last partial one dropped)
STEPS = [
    "device=cpu",
    "loader.batch_size=128",
    "trainer.limit_train_batches=-1",
    "trainer.limit_val_batches=2",
    "trainer.log_interval=1",
]


def evaluated_steps(run_dir, tag: str = "val/loss") -> list[int]:
    """The steps a metric was logged at (the run's final values are logged again at its last)."""
    return sorted({e.step for e in events(run_dir).Scalars(tag)})


def test_every_n_steps_across_epochs_each_at_its_step(make_cfg, caplog):
    cfg = make_cfg(*STEPS, "trainer.max_epochs=2", "trainer.eval_every=4")
    with caplog.at_level(logging.INFO, logger="saturate"):
        saturate.train(cfg)
    assert evaluated_steps(cfg.run_dir) == [4, 8, 12, 16, 20, 22]  # every 4 steps, and the run's last
    saved = torch.load(f"{cfg.run_dir}/checkpoints/best.pt", weights_only=False)
    assert saved["step"] in (4, 8, 12, 16, 20, 22) and saved["best"] == read_metrics(cfg.run_dir)["best"]["value"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch 1/2")]
    assert lines and "(evaluated at step 8)" in lines[0]  # the epoch's last evaluation, shown at its end


def test_a_fraction_of_an_epoch(make_cfg):
    cfg = make_cfg(*STEPS, "trainer.max_epochs=1", "trainer.eval_every=0.5")
    saturate.train(cfg)
    assert evaluated_steps(cfg.run_dir) == [6, 11]  # round(0.5 x 11) = 6 steps, and the end


def test_early_stopping_counts_evaluations_not_epochs(make_cfg):
    """At lr 1e-9 nothing improves after the first evaluation: patience 2 stops the run at
    the third evaluation, step 9, inside the first epoch."""
    cfg = make_cfg(
        *STEPS,
        "trainer.max_epochs=5",
        "trainer.eval_every=3",
        "optim.optimizer.lr=1e-9",
        "callbacks=[early_stopping]",
        "callbacks.early_stopping.patience=2",
        "callbacks.early_stopping.monitor=val/loss",
        "callbacks.early_stopping.min_delta=1",
    )
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 9 and evaluated_steps(cfg.run_dir) == [3, 6, 9]
    assert metrics["stopped_early"].startswith(
        "early stopping: val/loss did not improve by more than 1 in 2 evaluation(s)"
    )


def test_the_test_split_at_every_evaluation(make_cfg, tmp_path):
    from tests.tasks.test_segmentation import Squares, tiny_segmenter  # a data set with a test split

    overrides = [
        "task.input_key=image",
        "task.target_key=mask",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=-1",
        "trainer.eval_every=2",
        "trainer.eval_test=true",
        "trainer.progress=false",
        "loader.batch_size=16",
    ]
    saturate.fit(
        tiny_segmenter,
        Squares(64),
        Squares(16, 1),
        test_data=Squares(16, 2),
        task="segmentation",
        run_dir=tmp_path,
        overrides=overrides,
    )
    assert evaluated_steps(tmp_path, "val/dice") == [2, 4]
    assert evaluated_steps(tmp_path, "test/dice")[:2] == [2, 4]  # and once more with best.pt at the end


@pytest.mark.parametrize("value", [-1, 1.5])
def test_a_bad_eval_every_is_named(make_cfg, value):
    from saturate.errors import ConfigError

    with pytest.raises(ConfigError, match="trainer.eval_every"):
        saturate.train(make_cfg(f"trainer.eval_every={value}"))
