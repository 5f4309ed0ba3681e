"""`saturate.fit(model, train_data, val_data, ...)`: the Python entry. The same run as
train.py, from Python objects (a notebook, existing code), with saturate's config groups and
run directory."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from saturate.config.dirs import CONF, project_search_path
from saturate.config.invocation import Invocation, outside_hydra_app
from saturate.config.naming import run_name
from saturate.config.registration import register
from saturate.errors import UserError
from saturate.tasks import BUILT_IN

if TYPE_CHECKING:  # torch is imported by the run, not by this module's import
    from torch import nn
    from torch.utils.data import Dataset

    from saturate.trainer.outcome import Metrics


def config_dir() -> Path:
    """saturate's own config groups, in the package (saturate.config.dirs.CONF)."""
    return CONF


def fit(
    model: nn.Module | Callable[..., nn.Module],
    train_data: Dataset,
    val_data: Dataset | None = None,
    *,
    test_data: Dataset | None = None,
    task: str | Any = "classification",
    loss: Callable | str | None = None,
    overrides: Sequence[str] = (),
    run_dir: str | Path | None = None,
    callbacks: Sequence[Any] | dict = (),
    loggers: Sequence[Any] | dict = (),
    collate: Callable | None = None,
    target_inverse: Callable | None = None,
) -> Metrics:
    """Train `model` on `train_data` (validated on `val_data`, tested with best.pt on
    `test_data`, if given) with saturate's engine and config groups: `overrides` as on the
    command line (`["precision=amp", "loader.batch_size=64", "trainer.max_epochs=5"]`).

    - `model`: an nn.Module, or a factory (a class, a function) called after seeding with the
      data-derived arguments it names (in_channels, in_features, input_shape, num_classes,
      num_outputs): give a factory for reproducible initial weights.
    - datasets: map-style; samples `(input, target)` or dicts (batched by `collate`, e.g.
      saturate.data.pad_collate, for samples of variable length).
    - `task`: "classification", "regression", "sequence", or a task object (saturate.tasks.base);
      `loss(outputs, targets)` replaces the task's own (for regression also "mse", "l1", "huber").
    - `callbacks` and `loggers`: objects with hooks of saturate.callbacks.Callback (a list, or
      {name: object}).
    - `target_inverse`: takes targets back to their units (regression metrics `*_raw`).

    Writes the same run dir as train.py (default: outputs/runs/<date>/<time>) and returns the
    final metrics (saturate.trainer.run.Metrics)."""
    from saturate.data import Data
    from saturate.trainer.build import UserObjects
    from saturate.trainer.run import train

    register()
    overrides, loss = _fit_arguments(overrides, loss, task)
    overrides = _with_run_dir(overrides, run_dir)
    task_object = None if isinstance(task, str) else task
    with outside_hydra_app():
        cfg = _compose([f"task={task}"] * isinstance(task, str) + overrides)
        _check_devices(cfg.trainer.devices)
        splits = {"train": train_data, "val": val_data, "test": test_data}
        data = Data.of({**splits, "collate": collate, "target_inverse": target_inverse}, "saturate.fit")
        objects = UserObjects(
            model=model,
            data=data,
            task=task_object,
            loss=loss,
            callbacks=_named(callbacks),
            loggers=_named(loggers),
        )
        return train(cfg, Invocation.given(overrides), objects)


def _with_run_dir(overrides: list[str], run_dir: str | Path | None) -> list[str]:
    """The overrides with the run dir: the one given, or one named as train.py names its runs."""
    if run_dir is not None:
        return [*overrides, f"run_dir={Path(run_dir).absolute()}"]
    if any(o.startswith("run_dir=") for o in overrides):
        return overrides
    named = next((o.partition("=")[2] for o in overrides if o.startswith("name=")), None)
    stamp = datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f") + run_name(named, Invocation.given(overrides))
    return [*overrides, f"run_dir={Path('outputs/runs').absolute() / stamp}"]


def _check_devices(devices) -> None:
    """fit trains in its own process: several devices need torchrun to have started them."""
    if devices not in ("auto", 1) and int(os.environ.get("WORLD_SIZE", "1")) != devices:
        raise UserError(
            f"trainer.devices={devices}: saturate.fit trains in the process that calls it; for {devices} processes "
            f"start your script with torchrun --nproc_per_node={devices} (fit then joins their process group)"
        )


def _named(objects) -> dict[str, Any]:
    """{name: object}: a dict as it is, a list by class name (a second of a class gets _2)."""
    if isinstance(objects, dict):
        return dict(objects)
    named: dict[str, Any] = {}
    for obj in objects:
        name = type(obj).__name__
        named[name if name not in named else f"{name}_{sum(k.startswith(name) for k in named) + 1}"] = obj
    return named


def _fit_arguments(overrides, loss, task) -> tuple[list[str], Callable | None]:
    """fit's overrides as a list (a string is a mistake, not a list of characters) and its
    loss as a callable (a regression loss's name becomes task.loss)."""
    if isinstance(overrides, (str, bytes)) or not all(isinstance(o, str) for o in overrides):
        given = repr(overrides) if len(repr(overrides)) < 80 else repr(overrides)[:77] + "..."
        raise UserError(
            f"saturate.fit: overrides={given}: expected a list of 'key=value' strings, e.g. "
            "overrides=['precision=amp', 'trainer.max_epochs=5']"
        )
    if isinstance(task, str) and task not in BUILT_IN:
        raise UserError(
            f"saturate.fit: task={task!r}: expected one of {', '.join(BUILT_IN)}, or a task object "
            "(saturate.tasks.base)"
        )
    overrides = list(overrides)
    if isinstance(loss, str):
        if task != "regression":
            raise UserError(
                f"saturate.fit: loss={loss!r}: task={task} takes a callable loss(outputs, targets), or None for its "
                "own; named losses (mse, l1, huber) are regression's"
            )
        return [f"task.loss={loss}", *overrides], None
    return overrides, loss


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    # a project config dir (./conf) before saturate's groups (saturate.config.dirs)
    with project_search_path(), initialize_config_dir(str(config_dir()), version_base="1.3"):
        return compose("config", overrides=overrides)
