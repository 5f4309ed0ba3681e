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
- `reset(split)` (optional): a new stream of batches starts: every training epoch ("train", not
  when a run resumes inside one) and every evaluation ("val", "test", "train_est"). A task that
  carries a state from one batch to the next (truncated BPTT over `loader.order=sequential`)
  starts it afresh here.
- `state_dict()` / `load_state_dict(state)` (optional): the task's own state, saved in every
  checkpoint and restored on resume (a carried state: a resumed run continues the stream).
  saturate's checks and measurements that run the task put its attributes back afterwards.
- `loss_reduction` (optional, "mean"): "sum" when the loss sums over the batch's samples: the
  gradient is the sum's, the logged `train/loss` and `val/loss` are divided by the batch size.

A user's task is any object with these (`TaskProtocol`; a `_target_` in the `task` group, or
an object given to `saturate.fit`); subclassing `Task` gives the user's metrics, the
pair-or-dict batch access, the names and the directions for free.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from saturate.errors import ConfigError, Problem, UserError

log = logging.getLogger(__name__)


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
        carry: bool = False,
        model_loss: str | int | None = None,
        target_arg: str | None = None,
        loss_reduction: str = "mean",
    ):
        """`carry`: the model takes a state as its last argument and returns (outputs, state);
        the state of the last batch is passed on, detached (None at each epoch's and each
        evaluation's start). `model_loss`: the model computes its own loss, given the targets
        (as keyword `target_arg` when set, else as its last positional argument): the index or
        key of its outputs holding the loss. `loss_reduction`: "mean" or "sum" over the batch."""
        # several keys (a list, or the ListConfig Hydra passes): the model's inputs, in order
        self.input_key = input_key if isinstance(input_key, str) else [str(k) for k in input_key]
        self.target_key = target_key
        self.output_key = output_key  # a model with several outputs (a tuple, a dict): the one the metrics read
        problems = _call_problems(carry, model_loss, target_arg, loss_reduction)
        if problems:
            raise ConfigError(problems)
        self.carry, self.model_loss, self.target_arg, self.loss_reduction = (
            carry,
            model_loss,
            target_arg,
            loss_reduction,
        )
        self.carried: dict[str, tuple[Any, int]] = {}  # "train" / "eval": (the state, the batch size it is for)
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

    # -- the model's call, and what it carries

    def call(self, model: nn.Module, batch: Any) -> Any:
        """All the model's outputs for `batch`, called by `call_model`'s rule; with task.carry the
        state carried from the last batch goes last (and the one returned is kept, detached);
        with task.model_loss or task.target_arg, the targets go too."""
        inputs = self.input(batch)
        if not (self.carry or self.model_loss is not None or self.target_arg is not None):
            return call_model(model, inputs)
        args = list(inputs) if isinstance(inputs, (tuple, list)) else [] if isinstance(inputs, dict) else [inputs]
        kwargs = dict(inputs) if isinstance(inputs, dict) else {}
        if self.model_loss is not None or self.target_arg is not None:
            target = self.target(batch)
            if self.target_arg is not None:
                kwargs[self.target_arg] = target
            else:
                args.append(target)
        if not self.carry:
            self._check_call(model, args, kwargs)
            return model(*args, **kwargs)
        slot, size = "train" if model.training else "eval", len(self.target(batch))
        state, for_size = self.carried.get(slot, (None, size))
        state = _moved(state, _device(inputs)) if for_size == size else None  # other streams: start afresh
        if isinstance(inputs, dict):
            kwargs["state"] = state
        else:
            args.append(state)
        self._check_call(model, args, kwargs)
        returned = model(*args, **kwargs)
        if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
            kind = f"a {type(returned).__name__}" + (
                f" of {len(returned)}" if isinstance(returned, (tuple, list)) else ""
            )
            raise UserError(
                f"task.carry=true: {type(model).__name__} returned {kind}; a model that carries a state returns "
                "(outputs, state), e.g. `return self.decoder(out), hidden`"
            )
        self.carried[slot] = (_detached(returned[1]), size)
        return returned[0]

    def _check_call(self, model: nn.Module, args: list, kwargs: dict) -> None:
        """A model whose forward cannot take what these options pass is one message (once)."""
        if getattr(self, "_call_checked", False):
            return
        try:
            inspect.signature(getattr(model, "forward", model)).bind(*args, **kwargs)
        except TypeError as e:
            name = f"{type(model).__name__}.forward"
            if self.carry:
                raise UserError(
                    f"task.carry=true: {name} does not take a state after its inputs ({e}); a model that carries a "
                    "state is called as model(inputs..., state) and returns (outputs, state)"
                ) from None
            where = f"as keyword {self.target_arg}" if self.target_arg else "after its inputs"
            raise UserError(
                f"task.model_loss={self.model_loss}: {name} does not take the targets {where} ({e}); name its targets "
                "argument with task.target_arg"
            ) from None
        except ValueError:  # a callable without a signature: its own error, if any, at the call
            pass
        self._call_checked = True

    def model_loss_of(self, every: Any) -> torch.Tensor | None:
        """The loss the model computed itself (task.model_loss), or None."""
        if self.model_loss is None:
            return None
        try:
            loss = every[self.model_loss]
        except (KeyError, IndexError, TypeError):
            kind = f"a dict with keys {sorted(every)}" if isinstance(every, dict) else type(every).__name__
            raise ConfigError(
                [Problem("task.model_loss", self.model_loss, f"an index or key of the model's outputs ({kind})")]
            ) from None
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            what = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserError(f"task.model_loss={self.model_loss}: the model's output there is {what}, not one number")
        return loss.reshape(())

    def reset(self, split: str) -> None:
        """A new stream starts (every training epoch, every evaluation): no state carried into it."""
        self.carried.pop("train" if split == "train" else "eval", None)

    def state_dict(self) -> dict[str, Any]:
        """The state carried into the next training batch (task.carry): kept in checkpoints."""
        state, size = self.carried.get("train", (None, 0))
        return {"carried": state, "size": size} if self.carry and state is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.carry and state.get("carried") is not None:
            self.carried["train"] = (state["carried"], int(state["size"]))

    # -- metrics

    def own_metrics(self) -> dict[str, Any]:
        """The task's own metrics (subclasses), fresh; those in `removed()` need not be built."""
        return {}

    def removed(self) -> set[str]:
        """The task's metrics the user's task.metrics set to null: a run left with none never
        imports torchmetrics (about a second of start-up: it brings scipy.signal and matplotlib)."""
        return {name for name, metric in self.extra.items() if metric is None}

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


class TaskState:
    """The task's own state as a checkpoint holds it: its `state_dict()`, when it has one. Under
    several ranks each rank carries the state of its own streams and a checkpoint holds rank
    0's: a run resumed there starts every rank's afresh (a warning says so)."""

    def __init__(self, task, world_size: int = 1):
        self.task, self.world_size = task, world_size

    def state_dict(self) -> dict[str, Any]:
        own = getattr(self.task, "state_dict", None)
        return dict(own()) if callable(own) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = getattr(self.task, "load_state_dict", None)
        if not state or not callable(own):
            return
        if self.world_size > 1:
            log.warning(
                "resume: the checkpoint holds rank 0's task state (a state carried across batches); each of the %d "
                "ranks starts its own afresh",
                self.world_size,
            )
            return
        own(state)


def _call_problems(carry, model_loss, target_arg, loss_reduction) -> list[Problem]:
    problems = []
    if not isinstance(carry, bool):
        problems.append(Problem("task.carry", carry, "true or false"))
    if model_loss is not None and (isinstance(model_loss, bool) or not isinstance(model_loss, (str, int))):
        problems.append(Problem("task.model_loss", model_loss, "null, or the index or key of the model's loss"))
    if target_arg is not None and not (isinstance(target_arg, str) and target_arg.isidentifier()):
        problems.append(Problem("task.target_arg", target_arg, "null, or the name of the model's targets argument"))
    if loss_reduction not in ("mean", "sum"):
        problems.append(Problem("task.loss_reduction", loss_reduction, "mean or sum (over the batch's samples)"))
    return problems


def _detached(state: Any) -> Any:
    """A carried state cut from the graph of the batch that made it (truncated BPTT)."""
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, (tuple, list)):
        return type(state)(_detached(s) for s in state)
    if isinstance(state, dict):
        return {k: _detached(v) for k, v in state.items()}
    return state


def _moved(state: Any, device: torch.device | None) -> Any:
    """A state read from a checkpoint (on the CPU) on the inputs' device; a no-op otherwise."""
    if device is None or state is None:
        return state
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, (tuple, list)):
        return type(state)(_moved(s, device) for s in state)
    if isinstance(state, dict):
        return {k: _moved(v, device) for k, v in state.items()}
    return state


def _device(inputs: Any) -> torch.device | None:
    values = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, (tuple, list)) else [inputs]
    return next((v.device for v in values if isinstance(v, torch.Tensor)), None)


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
