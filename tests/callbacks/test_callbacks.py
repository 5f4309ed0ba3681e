"""Callbacks that steer: early stopping, weight averaging, a plateau rule and a user's own,
each through the public protocol; their state survives a resume bit for bit; a callback
that raises is one line."""

from __future__ import annotations

import copy
import re
import signal
from pathlib import Path

import pytest
import torch

import saturate
from saturate.loop.faults import Preempted
from tests.checkpoint.test_resume import EXACT, final_weights, signal_at, step_losses
from tests.conftest import ROOT, TINY, read_metrics, run_cli
from tests.trainer.test_run import events

# min_delta 1.0: accuracy can never improve by more than 1, so the first evaluation is the best
# and the run stops after `patience` more (training itself is untouched)
NO_IMPROVEMENT = ["callbacks=[early_stopping]", "callbacks.early_stopping.min_delta=1.0"]


def checkpoint_of(run_dir, name: str = "last.pt") -> dict:
    return torch.load(Path(run_dir) / "checkpoints" / name, weights_only=False)


def test_early_stopping_stops_as_a_success_and_says_why(make_cfg):
    cfg = make_cfg(*NO_IMPROVEMENT, "callbacks.early_stopping.patience=2", "trainer.max_epochs=10")
    metrics = saturate.train(cfg)
    assert (
        read_metrics(cfg.run_dir)["status"] == "completed"
        and metrics["progress/epoch"] == 3
        and metrics["progress/step"] == 9
    )
    reason = metrics["stopped_early"]
    assert reason.startswith("early stopping: val/acc did not improve by more than 1 in 2 evaluation(s) (best ")
    assert reason in (Path(cfg.run_dir) / "report.md").read_text()
    assert checkpoint_of(cfg.run_dir)["step"] == 9 and (Path(cfg.run_dir) / "checkpoints" / "best.pt").is_file()


def test_early_stopping_from_the_command_line_exits_0_and_says_why(tmp_path):
    result = run_cli(
        *TINY,
        "trainer.max_epochs=10",
        "callbacks=[early_stopping]",
        "callbacks.early_stopping.patience=3",
        "callbacks.early_stopping.min_delta=1",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    said = result.stdout + result.stderr
    assert "stopped at step 12: early stopping: val/acc did not improve by more than 1 in 3 evaluation(s)" in said
    assert read_metrics(tmp_path / "run")["progress/epoch"] == 4


def test_early_stopping_resumed_after_sigterm_stops_at_the_same_step_with_the_same_weights(make_cfg):
    """Interrupted after the second evaluation (one without improvement counted): the resumed
    run must stop after the third, as the uninterrupted one does; without its saved counters
    it would start counting again and train two epochs more."""
    overrides = [*NO_IMPROVEMENT, "callbacks.early_stopping.patience=2", "trainer.max_epochs=6"]
    full = make_cfg(*EXACT, *overrides)
    assert saturate.train(full)["progress/step"] == 33
    first = make_cfg(*EXACT, *overrides, *signal_at(27, signal.SIGTERM))
    with pytest.raises(Preempted) as stopped:
        saturate.train(first)
    assert stopped.value.code == 143 and checkpoint_of(first.run_dir)["step"] == 27
    second = make_cfg(*EXACT, *overrides, f"trainer.resume={first.run_dir}")
    metrics = saturate.train(second)
    assert metrics["progress/step"] == 33 and metrics["stopped_early"] == read_metrics(full.run_dir)["stopped_early"]
    assert step_losses(first.run_dir, second.run_dir) == step_losses(full.run_dir)
    weights, resumed = final_weights(full.run_dir), final_weights(second.run_dir)
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)


class Trained:
    """Records the trained weights after every optimizer step (and before the first)."""

    seen: list[dict[str, torch.Tensor]] = []

    def on_run_start(self, run) -> None:
        Trained.seen = [copy.deepcopy(run.model.state_dict())]

    def on_after_optimizer_step(self, run) -> None:
        Trained.seen.append(copy.deepcopy(run.model.state_dict()))


def test_ema_is_what_is_evaluated_and_checkpointed(make_cfg):
    """The average, computed here from the trained weights step by step with timm's formula
    (decay ramped as 1 - (1 + updates)^(-2/3)), is last.pt's and best.pt's `model`; the
    trained weights are `train_model`."""
    cfg = make_cfg(
        "callbacks=[ema]",
        "callbacks.ema.decay=0.9",
        "+callbacks.trained._target_=tests.callbacks.test_callbacks.Trained",
        "trainer.max_epochs=2",
        "trainer.deterministic=true",
    )
    saturate.train(cfg)
    seen = Trained.seen
    assert len(seen) == 7  # the start and 6 steps
    average, by_step = {k: v.clone() for k, v in seen[0].items()}, {}
    for update, trained in enumerate(seen[1:]):
        weight = 1 - min(0.9, 1 - (1 + update) ** (-2 / 3))
        for k, v in trained.items():
            average[k] = average[k] + weight * (v - average[k]) if v.is_floating_point() else v.clone()
        by_step[update + 1] = {k: v.clone() for k, v in average.items()}
    last, best = checkpoint_of(cfg.run_dir), checkpoint_of(cfg.run_dir, "best.pt")
    for name in seen[-1]:
        torch.testing.assert_close(last["model"][name], by_step[6][name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(best["model"][name], by_step[best["step"]][name], rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(last["train_model"][name], seen[-1][name])
    assert any(not torch.equal(last["model"][k], last["train_model"][k]) for k in last["model"])


def test_ema_resumed_mid_epoch_equals_the_uninterrupted_run(make_cfg):
    overrides = ["callbacks=[ema]", "callbacks.ema.decay=0.95"]
    full = make_cfg(*EXACT, *overrides)
    saturate.train(full)
    first = make_cfg(*EXACT, *overrides, *signal_at(16))
    with pytest.raises(Preempted):
        saturate.train(first)
    second = make_cfg(*EXACT, *overrides, f"trainer.resume={first.run_dir}")
    saturate.train(second)
    a, b = checkpoint_of(full.run_dir), checkpoint_of(second.run_dir)
    for key in ("model", "train_model"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
    assert read_metrics(full.run_dir)["val/acc"] == read_metrics(second.run_dir)["val/acc"]


def test_plateau_lowers_the_lr_and_keeps_it_lowered_across_a_resume(make_cfg):
    """A threshold no value can beat: every evaluation is a bad one, so with patience 0 each
    halves the rate; the resumed run continues from the halved rate (the checkpoint keeps the
    callbacks' scaling) and ends as the uninterrupted run."""
    overrides = [
        "callbacks=[plateau]",
        "callbacks.plateau.monitor=val/loss",
        "callbacks.plateau.patience=0",
        "callbacks.plateau.factor=0.5",
        "callbacks.plateau.threshold=1.0",
        "optim.schedule=constant",
        "optim.warmup_epochs=0",
    ]
    full = make_cfg(*EXACT, *overrides)
    saturate.train(full)
    lrs = {e.step: e.value for e in events(full.run_dir).Scalars("train/lr")}
    base = lrs[1]
    assert lrs[11] == pytest.approx(base) and lrs[12] == pytest.approx(base / 2) and lrs[23] == pytest.approx(base / 4)
    first = make_cfg(*EXACT, *overrides, *signal_at(16))
    with pytest.raises(Preempted):
        saturate.train(first)
    second = make_cfg(*EXACT, *overrides, f"trainer.resume={first.run_dir}")
    saturate.train(second)
    resumed = {e.step: e.value for e in events(second.run_dir).Scalars("train/lr")}
    assert resumed[17] == pytest.approx(base / 2) and resumed[33] == pytest.approx(base / 4)
    assert step_losses(first.run_dir, second.run_dir) == step_losses(full.run_dir)


def readme_callback(tmp_path) -> str:
    """The user's callback exactly as the docs show it, saved as my_project/callbacks.py."""
    text = (ROOT / "docs" / "your-code.md").read_text()
    code = re.search(r"```python\n(# my_project/callbacks\.py\n.*?)```", text, re.S)
    assert code, "the docs' callback example is missing"
    package = tmp_path / "my_project"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "callbacks.py").write_text(code.group(1))
    return "+callbacks.budget._target_=my_project.callbacks.StopAfterEvaluations"


def test_the_readme_callback_stops_a_run_keeps_its_count_across_a_resume_and_changes_nothing_else(
    make_cfg, tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(tmp_path))
    mine = [readme_callback(tmp_path), "+callbacks.budget.evaluations=2", "trainer.max_epochs=3"]
    plain = make_cfg(*EXACT, "trainer.max_epochs=3")
    saturate.train(plain)
    stopped = make_cfg(*EXACT, *mine)
    metrics = saturate.train(stopped)
    assert read_metrics(stopped.run_dir)["status"] == "completed" and metrics["progress/step"] == 22
    assert "2 evaluations" in metrics["stopped_early"]
    assert step_losses(stopped.run_dir) == step_losses(plain.run_dir)[:22]  # the same training up to its stop
    evaluated = {e.step: e.value for e in events(plain.run_dir).Scalars("val/acc") if e.step <= 22}
    assert {e.step: e.value for e in events(stopped.run_dir).Scalars("val/acc")} == evaluated
    first = make_cfg(*EXACT, *mine, *signal_at(16))
    with pytest.raises(Preempted):
        saturate.train(first)
    resumed = saturate.train(make_cfg(*EXACT, *mine, f"trainer.resume={first.run_dir}"))
    assert resumed["progress/step"] == 22  # its one evaluation before the interruption was counted


class Raises:
    def on_eval_end(self, run, metrics) -> None:
        raise ValueError("the tracking server said no")


def test_a_callback_that_raises_is_one_line_with_last_pt_saved(tmp_path):
    result = run_cli(
        *TINY,
        "trainer.max_epochs=2",
        "+callbacks.flaky._target_=tests.callbacks.test_callbacks.Raises",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=ROOT,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-2000:]
    assert lines[0] == "error: flaky.on_eval_end raised ValueError: the tracking server said no"
    assert read_metrics(tmp_path / "run")["status"] == "failed"
    assert checkpoint_of(tmp_path / "run")["step"] == 3
