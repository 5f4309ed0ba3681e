"""What is learnt: the loss, the validation metrics (torchmetrics) and what "better" means.

A task is built once from the `task` node and the data (saturate.data.DataSpec): the step
calls `task.loss(outputs, targets)`, the evaluator `task.metrics()`, and the checkpointer
and the report ask `task.direction(name)`. Nothing else in saturate knows which loss runs.

- classification: cross-entropy with label smoothing; `val/acc`, and `val/top5` when there
  are more than 5 classes. Outputs (B, num_classes) logits, targets (B,) class indices.
- regression: MSE, L1 (MAE) or Huber; `val/mae`, `val/rmse`, `val/r2`. Outputs with as many
  values per sample as the targets (a trailing 1 is squeezed: (B, 1) against (B,)).
- a user loss: any `_target_` callable `(outputs, targets) -> scalar` replaces the built-in
  loss of either kind; the kind's metrics stay. For regression it is given the outputs in
  the targets' shape when only a trailing 1 differs (torch's losses would broadcast).

Every task logs `val/loss` (the training loss on the validation set, averaged per sample).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Imported with saturate, not at the first evaluation: imported mid-run (after the training
# threads started), torchmetrics' own imports (scipy's OpenBLAS among them) left the steps
# after it 15-20 % slower on a 2-core CPU (measured: docs/benchmarks.md).
from torchmetrics import MeanAbsoluteError, MeanSquaredError, MetricCollection, R2Score
from torchmetrics.classification import MulticlassAccuracy

from saturate.errors import DataError
from saturate.tasks import DIRECTIONS, KINDS, REGRESSION_LOSSES, main_metric, metric_names

__all__ = ["DIRECTIONS", "KINDS", "REGRESSION_LOSSES", "Task", "build_task", "main_metric", "metric_names"]


@dataclass
class Task:
    kind: str  # classification or regression
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    num_classes: int | None  # classification only
    num_outputs: int  # values the model predicts per sample
    target_dtype: torch.dtype  # what the targets are cast to on the device

    @property
    def names(self) -> tuple[str, ...]:
        return metric_names(self.kind, self.num_classes)

    def metrics(self, device: torch.device):
        """A fresh torchmetrics collection on `device` for one evaluation. Its states
        accumulate on the device and are summed across DDP ranks by `compute()`."""
        if self.kind == "classification":
            k = self.num_classes
            metrics = {"val/acc": MulticlassAccuracy(k, average="micro")}
            if k > 5:
                metrics["val/top5"] = MulticlassAccuracy(k, top_k=5, average="micro")
        else:
            metrics = {"val/mae": MeanAbsoluteError(), "val/rmse": MeanSquaredError(squared=False),
                       "val/r2": R2Score(multioutput="uniform_average")}  # fmt: skip
        return MetricCollection(metrics, compute_groups=False).to(device)

    def prepare(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(outputs, targets) in the shapes the metrics expect: classification logits
        (B, K) and indices (B,); regression (B,) or (B, k) for both."""
        outputs = outputs.float()
        if self.kind == "regression":
            outputs = outputs.reshape(targets.shape) if outputs.numel() == targets.numel() else outputs
            if targets.ndim > 2:
                return outputs.flatten(1), targets.flatten(1)
        return outputs, targets


def regression_loss(name: str, huber_delta: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    fn = {"mse": F.mse_loss, "l1": F.l1_loss, "huber": lambda o, t: F.huber_loss(o, t, delta=huber_delta)}[name]
    return _shaped(lambda outputs, targets: fn(outputs.float(), targets.float()))


def _shaped(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A user's regression loss, given outputs in the targets' shape when only that differs
    ((B, 1) against (B,)): torch's losses would broadcast them to (B, B) without a word."""

    @functools.wraps(loss)
    def shaped(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if outputs.shape != targets.shape and outputs.numel() == targets.numel():
            outputs = outputs.reshape(targets.shape)
        return loss(outputs, targets)

    return shaped


def classification_loss(label_smoothing: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        try:
            return F.cross_entropy(outputs, targets, label_smoothing=label_smoothing)
        except IndexError as e:  # a class index past the outputs (the CPU's error; CUDA asserts on the device)
            raise DataError(f"data: a target is not a class index in [0, {outputs.shape[-1] - 1}] ({e}); the data's classes and its "
                            "targets disagree") from None  # fmt: skip

    return cross_entropy


def build_task(kind: str, *, loss: str | Callable | None, label_smoothing: float, huber_delta: float, num_classes: int | None,
               num_outputs: int) -> Task:  # fmt: skip
    """The task for data with `num_classes` (classification) or `num_outputs` values per
    sample (regression); `loss` a built-in name, a callable, or None for the kind's own."""
    if callable(loss) and kind == "regression":
        fn = _shaped(loss)
    elif callable(loss):
        fn = loss
    elif kind == "classification":
        fn = classification_loss(label_smoothing)
    else:
        fn = regression_loss(loss or "mse", huber_delta)
    target_dtype = torch.int64 if kind == "classification" else torch.float32
    return Task(kind, fn, num_classes if kind == "classification" else None, num_outputs, target_dtype)
