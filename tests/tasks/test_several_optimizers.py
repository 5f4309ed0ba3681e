"""Several optimizers in one run (optim.optimizers): a task that takes its own steps, a GAN's
alternating discriminator and generator updates, with the guarantees of a one-optimizer step:
each optimizer's state in the checkpoint (bit-exact resume), the non-finite guard on each step,
each learning rate logged; and what cannot hold refused in one line."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import saturate
from saturate.errors import ConfigError, UserError
from saturate.loop.faults import Preempted
from saturate.tasks.base import Task
from tests.checkpoint.test_resume import final_weights, signal_at, step_losses
from tests.conftest import ROOT, TINY, python, read_metrics, run_cli
from tests.trainer.test_run import events

NZ = 4


class GAN(nn.Module):
    """One module holding both nets; its forward is the generator's."""

    def __init__(self, features: int = 8, **_):
        super().__init__()
        self.netG = nn.Sequential(nn.Linear(NZ, 16), nn.ReLU(), nn.Linear(16, features))
        self.netD = nn.Sequential(nn.Linear(features, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, noise):
        return self.netG(noise)


class GANTask(Task):
    """pytorch/examples dcgan's loop body, on vectors: D on real then fake, then G."""

    def __init__(self, nan_at: dict | None = None, **_):
        super().__init__()
        self.nan_at = dict(nan_at or {})  # {"D": step, "G": step}: that step's loss made NaN
        self.step = 0

    def training_step(self, model, batch, optimizers):
        self.step += 1
        real = batch[0]
        noise = torch.randn(len(real), NZ)
        optimizers.zero_grad("D")
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        fake = model.netG(noise)
        loss_d = F.binary_cross_entropy_with_logits(model.netD(real), ones) + F.binary_cross_entropy_with_logits(
            model.netD(fake.detach()), zeros
        )
        optimizers.backward(loss_d * self._poison("D"))
        optimizers.step("D")
        optimizers.zero_grad("G")
        loss_g = F.binary_cross_entropy_with_logits(model.netD(fake), ones)
        optimizers.backward(loss_g * self._poison("G"))
        optimizers.step("G")
        return loss_d.detach() + loss_g.detach()

    def _poison(self, name: str) -> float:
        return float("nan") if self.nan_at.get(name) == self.step else 1.0

    def forward(self, model, batch):
        """Evaluation: the generator's loss against the discriminator, on noise drawn per batch."""
        real = batch[0]
        fake = model(torch.randn(len(real), NZ, generator=torch.Generator().manual_seed(len(real))))
        return F.binary_cross_entropy_with_logits(model.netD(fake), torch.ones(len(real), 1)), fake

    def update(self, metrics, outputs, batch):
        pass


def vectors(**_):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 8, generator=g) * 0.5 + 1.0
    return {"train": TensorDataset(x[:256], torch.zeros(256)), "val": TensorDataset(x[256:], torch.zeros(64))}


ADAM = "{_target_:torch.optim.Adam,_partial_:true,lr:0.001,betas:[0.5,0.999]}"
GAN_CLI = [
    "data._target_=tests.tasks.test_several_optimizers.vectors",
    "~data.val_fraction",
    "~data.split_seed",
    "model._target_=tests.tasks.test_several_optimizers.GAN",
    "~model.width",
    "~model.norm",
    "task._target_=tests.tasks.test_several_optimizers.GANTask",
    f"optim.optimizers={{D:{{params:netD,optimizer:{ADAM}}},G:{{params:netG,optimizer:{ADAM}}}}}",
    "optim.schedule=constant",
    "optim.warmup_epochs=0",
    "checkpoint.monitor=val/loss",
    "monitor.costs=false",
    "loader.batch_size=32",
]
OPTIMIZERS = [GAN_CLI[7], "optim.schedule=constant", "optim.warmup_epochs=0", "trainer.progress=false"]


def test_a_gan_takes_both_steps_and_logs_each_learning_rate(make_cfg):
    cfg = make_cfg(*GAN_CLI, "trainer.max_epochs=2", "trainer.limit_train_batches=-1")
    saturate.train(cfg)
    record = read_metrics(cfg.run_dir)
    assert record["status"] == "completed" and record["progress/step"] == 16
    tags = events(cfg.run_dir).Tags()["scalars"]
    assert {"train/lr/D", "train/lr/G", "train/loss", "val/loss"} <= set(tags)
    saved = torch.load(Path(cfg.run_dir) / "checkpoints" / "last.pt", weights_only=True)
    assert sorted(saved["optimizer"]) == ["D", "G"]  # each optimizer's state (Adam's moments, its step count)
    assert all(float(s["step"]) == 16 for s in saved["optimizer"]["D"]["state"].values())
    assert sorted(saved["scheduler"]) == ["D", "G"]


def test_a_two_optimizer_run_resumes_bit_for_bit_after_sigterm(make_cfg):
    exact = [*GAN_CLI, "trainer.max_epochs=2", "trainer.limit_train_batches=-1"]
    exact += ["trainer.deterministic=true", "trainer.log_interval=1"]
    first = make_cfg(*exact, *signal_at(11, signal.SIGTERM))
    with pytest.raises(Preempted):
        saturate.train(first)
    second = make_cfg(*exact, f"trainer.resume={first.run_dir}")
    saturate.train(second)
    full = make_cfg(*exact)
    saturate.train(full)
    assert step_losses(first.run_dir, second.run_dir) == step_losses(full.run_dir)
    for key, value in final_weights(full.run_dir).items():
        assert torch.equal(value, final_weights(second.run_dir)[key]), key


def test_a_nan_in_either_step_skips_that_step_alone(tmp_path):
    model = GAN()
    before = {}

    class Watch:
        def on_train_batch_end(self, run, loss):
            if run.step in (2, 4):
                before[run.step] = {k: v.clone() for k, v in model.state_dict().items()}

    metrics = saturate.fit(
        model,
        vectors()["train"],
        vectors()["val"],
        task=GANTask(nan_at={"D": 3, "G": 5}),
        callbacks=[Watch()],
        overrides=[*OPTIMIZERS, "trainer.max_epochs=1", "loader.batch_size=32"],
        run_dir=tmp_path,
    )
    assert metrics["train/nonfinite_steps"] == 2 and read_metrics(tmp_path)["status"] == "completed"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    steps = {name: float(next(iter(s["state"].values()))["step"]) for name, s in saved["optimizer"].items()}
    assert steps == {"D": 7.0, "G": 7.0}  # 8 batches, one step of each skipped


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["trainer.accumulate=2"], "trainer.accumulate=2: expected 1 with optim.optimizers"),
        (["trainer.devices=2"], "trainer.devices=2: expected 1 with optim.optimizers"),
        (["loader.batch_size=auto"], "loader.batch_size='auto': expected an integer with optim.optimizers"),
        (
            [f"+optim.optimizers.E={{params:netX,optimizer:{ADAM}}}"],
            "optim.optimizers.E.params='netX': expected a submodule of GAN (netG, netD) or a pattern",
        ),
        (
            [f"+optim.optimizers.E={{params:'netD.*',optimizer:{ADAM}}}"],
            "optim.optimizers.E.params='netD.*': expected parameters of this optimizer only: netD.0.weight is",
        ),
        (["+optim.optimizers.E={params:netD}"], "optim.optimizers.E="),
        (["task=regression"], "optim.optimizers: task Regression trains with one optimizer"),
    ],
)
def test_what_several_optimizers_cannot_do_is_one_line(tmp_path, overrides, says):
    base = [o for o in GAN_CLI if not (o.startswith("task._target_") and "task=regression" in overrides)]
    result = run_cli(*TINY, *base, *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert says in result.stderr, result.stderr[-2000:]


def test_an_optimizer_name_the_task_does_not_know_is_one_message(tmp_path):
    class Typo(GANTask):
        def training_step(self, model, batch, optimizers):
            optimizers.step("Disc")

    with pytest.raises(UserError, match="task: training_step asked for optimizer 'Disc'; optim.optimizers has D, G"):
        saturate.fit(GAN(), vectors()["train"], vectors()["val"], task=Typo(), overrides=OPTIMIZERS, run_dir=tmp_path)


def test_a_task_that_takes_its_own_steps_needs_its_optimizers_named(tmp_path):
    with pytest.raises(UserError, match=r"task: GANTask takes its own steps \(training_step\); name its optimizers"):
        saturate.fit(GAN(), vectors()["train"], vectors()["val"], task=GANTask(), run_dir=tmp_path)


def test_a_config_error_lists_the_optimizers_problems_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"optim.param_groups=.*: expected \[\] with optim.optimizers"):
        saturate.fit(
            GAN(),
            vectors()["train"],
            vectors()["val"],
            task=GANTask(),
            overrides=[*OPTIMIZERS, "optim.param_groups=[{params:'netG.*',lr:0.1}]"],
            run_dir=tmp_path,
        )


def test_the_one_module_is_what_eval_and_export_load_with_its_forward_the_generator(tmp_path):
    """best.pt holds the module with both nets (EMA's average of all of them, with
    callbacks=[ema]); saturate eval runs the task's forward on it, saturate export records its
    forward: the generator's, from noise."""
    run = tmp_path / "run"
    trained = run_cli(*TINY, *GAN_CLI, "callbacks=[ema]", f"hydra.run.dir={run}", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    env = {"PYTHONPATH": str(ROOT)}  # this module's GAN and task
    evaluated = python(
        "-m", "saturate", "eval", run, "--run-saved-config", "--out", tmp_path / "ev", cwd=tmp_path, env=env
    )
    assert evaluated.returncode == 0 and "val/loss" in evaluated.stdout, evaluated.stderr[-2000:]
    exported = python(
        "-m",
        "saturate",
        "export",
        run,
        "--run-saved-config",
        "--to",
        "safetensors",
        "--out",
        tmp_path / "ex",
        cwd=tmp_path,
        env=env,
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "(tests.tasks.test_several_optimizers.GAN); inputs noise (" in exported.stdout
