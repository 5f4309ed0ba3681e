"""Several optimizers in one run (`optim.optimizers`): a GAN's discriminator and generator, a
teacher and a student, an actor and a critic. Each is named, holds a part of the one model (a
submodule, or parameter name patterns) and has its own schedule; a task with
`training_step(model, batch, optimizers)` takes each step itself (saturate.loop.manual).

`Optimizers` and `Schedules` stand for the run's optimizer and schedule wherever one is
expected: the checkpoint holds a state per name, a resume puts back the hyperparameters the
config changed (`param_groups`: every optimizer's groups, in the config's order), a callback's
LR scale applies to all, and each LR is logged under its name (`train/lr/<name>`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Iterator

import torch
from torch import nn

from saturate.components.optim import setup_optimizer
from saturate.components.schedule import Schedule
from saturate.config.schema import OptimConfig
from saturate.errors import ConfigError, Problem, UserError

log = logging.getLogger(__name__)


class Optimizers:
    """The run's optimizers by name, as one object."""

    def __init__(self, named: dict[str, torch.optim.Optimizer], params: dict[str, list[nn.Parameter]]):
        self.named, self.params = named, params

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self.named[name]

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.named.values() for group in optimizer.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.named.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: optimizer.state_dict() for name, optimizer in self.named.items()}

    def load_state_dict(self, state: dict) -> None:
        if sorted(state) != sorted(self.named):
            raise ValueError(f"the checkpoint's optimizers are {sorted(state)}, this run's {sorted(self.named)}")
        for name, optimizer in self.named.items():
            optimizer.load_state_dict(state[name])


class Schedules:
    """The optimizers' schedules by name, as one. Each steps with its own optimizer's step (the
    task's `optimizers.step(name)`), so the loop's step() does nothing."""

    def __init__(self, named: dict[str, Schedule]):
        self.named = named

    def step(self) -> None:
        pass

    def epoch_done(self) -> None:
        for schedule in self.named.values():
            schedule.epoch_done()

    def evaluated(self, metrics: dict[str, float]) -> None:
        for schedule in self.named.values():
            schedule.evaluated(metrics)

    def get_last_lr(self) -> list[float]:
        return [lr for schedule in self.named.values() for lr in schedule.get_last_lr()]

    def named_lrs(self) -> dict[str, float]:
        """Each optimizer's LR (its first group's): logged as train/lr/<name>."""
        return {name: schedule.get_last_lr()[0] for name, schedule in self.named.items()}

    @property
    def base_lrs(self) -> list[float]:
        return [lr for schedule in self.named.values() for lr in schedule.base_lrs]

    def rebase(self, base_lrs: list[float]) -> None:
        at = 0
        for schedule in self.named.values():
            count = len(schedule.base_lrs)
            schedule.rebase(base_lrs[at : at + count])
            at += count

    def scale(self, factor: float) -> None:
        for schedule in self.named.values():
            schedule.scale(factor)

    def state_dict(self) -> dict:
        return {name: schedule.state_dict() for name, schedule in self.named.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, schedule in self.named.items():
            schedule.load_state_dict(state[name])


class _Part:
    """A model's parameters chosen for one optimizer, as setup_optimizer reads a model."""

    def __init__(self, model: nn.Module, chosen: list[tuple[str, nn.Parameter]]):
        self.model, self.chosen = model, chosen

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self.chosen)


def check_steps(cfg: OptimConfig, task) -> None:
    """Several optimizers with a task that takes its own steps (training_step), one without:
    checked when the task is built, before the model's check."""
    manual, kind = callable(getattr(task, "training_step", None)), type(task).__name__
    if manual and not cfg.optimizers:
        raise UserError(
            f"task: {kind} takes its own steps (training_step); name its optimizers in optim.optimizers "
            "({name: {params: <a submodule or a parameter pattern>, optimizer: <a _partial_ optimizer node>}})"
        )
    if cfg.optimizers and not manual:
        raise UserError(
            f"optim.optimizers: task {kind} trains with one optimizer; several need a task that takes each step "
            "itself: training_step(model, batch, optimizers) (docs/your-code.md, several optimizers)"
        )


def setup_optimizers(cfg: OptimConfig, model: nn.Module, task, **schedule_args):
    """The run's optimizer and schedule: one (optim.optimizer), or one per name of
    optim.optimizers for a task that takes its own steps (training_step)."""
    check_steps(cfg, task)
    if not cfg.optimizers:
        return setup_optimizer(cfg, model, **schedule_args)
    chosen = choose(model, cfg.optimizers)
    optimizers, schedules = {}, {}
    for name, spec in cfg.optimizers.items():
        one = dataclasses.replace(
            cfg, optimizer=spec["optimizer"], scheduler=spec.get("scheduler"), optimizers=None, param_groups=[]
        )
        part = _Part(model, chosen[name])
        optimizers[name], schedules[name] = setup_optimizer(one, part, **schedule_args)  # type: ignore[arg-type]
    params = {name: [p for _, p in pairs] for name, pairs in chosen.items()}
    said = (f"{n} {type(o).__name__} ({len(params[n])} tensors)" for n, o in optimizers.items())
    log.info("optim: %s", ", ".join(said))
    return Optimizers(optimizers, params), Schedules(schedules)


def choose(model: nn.Module, specs: dict) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Each optimizer's trainable parameters: its `params`, a submodule's name or a parameter
    name pattern (or a list of them); no parameter in two optimizers."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    owner: dict[str, str] = {}
    chosen: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, spec in specs.items():
        given = spec["params"]
        taken: dict[str, nn.Parameter] = {}
        for pattern in [given] if isinstance(given, str) else list(given):
            inside = _submodule(model, pattern)
            ids = {id(p) for p in inside.parameters()} if inside is not None else None
            taken.update(
                (n, p) for n, p in trainable if (id(p) in ids if ids is not None else fnmatch.fnmatchcase(n, pattern))
            )
        key = f"optim.optimizers.{name}.params"
        if not taken:
            parts = ", ".join(n for n, _ in model.named_children())
            allowed = f"a submodule of {type(model).__name__} ({parts}) or a pattern matching its trainable parameters"
            raise ConfigError([Problem(key, given, allowed)])
        shared = next((n for n in taken if n in owner), None)
        if shared is not None:
            allowed = f"parameters of this optimizer only: {shared} is optim.optimizers.{owner[shared]}'s too"
            raise ConfigError([Problem(key, given, allowed)])
        owner.update((n, name) for n in taken)
        chosen[name] = list(taken.items())
    left = [n for n, _ in trainable if n not in owner]
    if left:
        log.warning(
            "optim.optimizers: %d trainable parameter(s) in no optimizer are not trained: %s",
            len(left),
            ", ".join(left[:5]) + (", ..." if len(left) > 5 else ""),
        )
    return chosen


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    if not name or any(c in name for c in "*?["):
        return None
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
