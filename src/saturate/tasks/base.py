"""The task protocol, and the base class the built-in tasks share.

A task is how a batch becomes a loss and metric updates, and what "better" means for each
metric it logs. The loop, DDP, precision, the non-finite guard, resume and the report never
ask which task runs: they call these, and nothing else.

- `forward(model, batch) -> (loss, outputs)`: the loss (a 0-d tensor with a gradient) and
  what the metrics need; called for training and evaluation steps alike.
- `metrics() -> {name: torchmetrics.Metric}`: a fresh set for one evaluation, named without
  the split (`acc`; logged as `val/acc` and `test/acc`). States accumulate on the device and
  are summed across DDP ranks by `compute()`.
- `update(metrics, outputs, batch)`: feed them one batch.
- `better(name) -> "max" | "min"`: which way `name` improves (`loss` is always "min").
- `names() -> (name, ...)`: the names `metrics()` logs (without `loss`).
- `main`: the metric a run is judged by when `checkpoint.monitor=auto` (e.g. `acc`), or None
  for the validation loss.
- `predictions(outputs, batch) -> {name: tensor}` (optional): per-sample values for
  `trainer.predict`, each with the batch as its first dimension.
- `host_keys` (optional): the dict entries of a batch that the task reads on the host (CTC's
  lengths); the loaders leave them there instead of copying them to the device.

A user's task is any object with these (`TaskProtocol`; a `_target_` in the `task` group, or
an object given to `saturate.fit`); subclassing `Task` gives the user's metrics, the
pair-or-dict batch access, the names and the directions for free.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from saturate.errors import ConfigError, Problem


class TaskProtocol(Protocol):
    """What saturate calls on a task (the module's docstring says what each is for)."""

    main: str | None

    def forward(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Any]: ...

    def metrics(self) -> dict[str, Any]: ...

    def update(self, metrics: dict[str, Any], outputs: Any, batch: Any) -> None: ...

    def logged(self) -> tuple[str, ...]:
        """What an evaluation logs for a split besides `loss` (bare names): a per-class metric
        as its elements (`dice_class/0`), as metrics.json holds them; a target or a monitored
        metric is one of these."""
        return self.names()

    def better(self, name: str) -> str: ...

    def names(self) -> tuple[str, ...]: ...


# Metrics whose direction torchmetrics does not say (higher_is_better is None), by name.
LOWER_IS_BETTER = ("loss", "mae", "rmse", "mse", "mape", "wer", "cer", "ter", "error", "err")


class Task:
    """Base of the built-in tasks. Batches are `(input, target)` pairs, or dicts whose
    `input_key` and `target_key` entries are the input and the target (other entries, e.g.
    lengths and masks, are left to subclasses). `metrics` adds the user's own torchmetrics
    to the task's (a name set to None removes one of the task's)."""

    name = "task"
    main: str | None = None  # checkpoint.monitor=auto: val/<main>, or val/loss when None
    host_keys: tuple[str, ...] = ()  # batch entries left on the host for the task (see the module)
    class_targets = False  # describe the targets as class indices (and count the classes)

    def __init__(
        self,
        *,
        metrics: dict[str, Any] | None = None,
        input_key: str | list[str] = "input",
        target_key: str = "target",
        output_key: str | int | None = None,
    ):
        # several keys (a list, or the ListConfig Hydra passes): the model's inputs, in order
        self.input_key = input_key if isinstance(input_key, str) else [str(k) for k in input_key]
        self.target_key = target_key
        self.output_key = output_key  # a model with several outputs (a tuple, a dict): the one the metrics read
        self.extra = dict(metrics or {})
        for name, metric in self.extra.items():
            if metric is not None and not _is_metric(metric):
                raise ConfigError(
                    [
                        Problem(
                            f"task.metrics.{name}",
                            type(metric).__name__,
                            "a torchmetrics Metric (a `_target_` node naming one, e.g. torchmetrics.classification."
                            "MulticlassF1Score), or null to drop one of the task's own",
                        )
                    ]
                )

    # -- batches

    def input(self, batch: Any) -> Any:
        """The model's input: a pair's first entry, or the dict's `input_key` entry (a list of
        keys: those entries, in order)."""
        if not isinstance(batch, dict):
            return batch[0]
        if isinstance(self.input_key, (list, tuple)):
            return tuple(batch[k] for k in self.input_key)
        return batch[self.input_key]

    def output(self, outputs: Any) -> Any:
        """The output the metrics (and the task's own loss) read: all of them, or the
        `output_key` one of a tuple or dict (a model with several heads)."""
        if self.output_key is None:
            return outputs
        try:
            return outputs[self.output_key]
        except (KeyError, IndexError, TypeError):
            kind = f"a dict with keys {sorted(outputs)}" if isinstance(outputs, dict) else type(outputs).__name__
            raise ConfigError(
                [Problem("task.output_key", self.output_key, f"an index or key of the outputs ({kind})")]
            ) from None

    def target(self, batch: Any) -> Any:
        return batch[self.target_key] if isinstance(batch, dict) else batch[1]

    # -- metrics

    def own_metrics(self) -> dict[str, Any]:
        """The task's own metrics (subclasses), fresh."""
        return {}

    def metrics(self) -> dict[str, Any]:
        """The task's metrics and the user's, fresh for one evaluation."""
        own = self.own_metrics()
        for name, metric in self.extra.items():
            if metric is None:
                own.pop(name, None)
            else:
                own[name] = metric.clone()
        return own

    def names(self) -> tuple[str, ...]:
        """What this task logs for a split, besides `loss` (bare names)."""
        return tuple(self.metrics())

    def better(self, name: str) -> str:
        """Which way `name` improves: from torchmetrics' `higher_is_better` where the metric
        says, else by its name (losses and errors are lower-is-better)."""
        metric = self.metrics().get(name.split("/")[0])
        said = getattr(metric, "higher_is_better", None)
        if said is not None:
            return "max" if said else "min"
        bare = name.split("/")[0].removesuffix("_raw")
        return "min" if bare in LOWER_IS_BETTER or bare.endswith(("_error", "_loss")) else "max"

    def update(self, metrics: dict[str, Any], outputs: Any, batch: Any) -> None:
        preds, target = self.metric_inputs(outputs, batch)
        for metric in metrics.values():
            metric.update(preds, target)

    def metric_inputs(self, outputs: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(predictions, targets) as the metrics take them."""
        return outputs.float(), self.target(batch)

    def predictions(self, outputs: Any, batch: Any) -> dict[str, torch.Tensor]:
        preds, target = self.metric_inputs(outputs, batch)
        return {"output": preds, "target": target}


def _is_metric(obj) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover (a dependency)
        return False
    return isinstance(obj, Metric)


def user_loss(loss, what: str = "task.loss") -> Callable | None:
    """A user's loss: a callable `(outputs, targets) -> loss`, or None."""
    if loss is None or callable(loss):
        return loss
    raise ConfigError(
        [Problem(what, type(loss).__name__, "a callable loss(outputs, targets), e.g. a `_target_` node naming one")]
    )


def finite_number(key: str, value, low: float, high: float = math.inf, *, open_high: bool = True) -> None:
    """A built-in task's own argument check: a number in [low, high)."""
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and low <= value
        and (value < high if open_high else value <= high)
    )
    if not ok:
        raise ConfigError([Problem(key, value, f"a number in [{low}, {high}{')' if open_high else ']'}")])


def call_model(model: nn.Module, inputs):
    """The one rule by which a model gets its input: a tensor as itself (`model(x)`), a tuple
    or list spread as positional arguments (`model(*inputs)`), a dict as keyword arguments
    (`model(**inputs)`)."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def wrong_outputs(model: nn.Module, outputs, batch: int, needed: str, task: str) -> str:
    """The message for outputs a task cannot read: their shape, or their kind (several
    outputs need task.output_key, and a loss of the user's to combine them)."""
    if isinstance(outputs, (tuple, list, dict)):
        return (
            f"model: {type(model).__name__} returns several outputs ({type(outputs).__name__} of {len(outputs)}) for "
            f"task={task}; name the one its metrics read with task.output_key (an index or a key), and combine them in "
            "task.loss (a `_target_` node called as loss(outputs, targets) with all of them)"
        )
    shape = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
    return (
        f"model: {type(model).__name__} returns outputs of shape {shape} for a batch of {batch}; task={task} needs "
        f"{needed} (the model's num_classes/num_outputs argument)"
    )
