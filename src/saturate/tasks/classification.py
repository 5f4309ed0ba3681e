"""Classification: logits (B, num_classes) against class indices (B,); or a class per position,
logits (B, T, num_classes) against (B, T) (a language model's), each position counted as a sample.

Cross-entropy with label smoothing (or the user's `loss(outputs, targets)`); `acc`, and
`top5` where it means something (more than 10 classes, or `top_k=5` asked for). Per-class
metrics of the user's (`average: null`) are logged per class name; `confusion_matrix=true`
shows the validation confusion matrix as an image in TensorBoard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from saturate.errors import ConfigError, DataError, Problem, UserError, is_integer
from saturate.started import import_timed
from saturate.tasks.base import Task, user_loss, wrong_outputs


class Classification(Task):
    name = "classification"
    main = "acc"
    class_targets = True

    def __init__(
        self,
        num_classes: int,
        *,
        label_smoothing: float = 0.0,
        top_k: int | str = "auto",
        confusion_matrix: bool = False,
        loss: Callable | None = None,
        metrics: dict | None = None,
        class_names: list[str] | None = None,
        input_key: str | list[str] = "input",
        target_key: str = "target",
        output_key: str | int | None = None,
        carry: bool = False,
        model_loss: str | int | None = None,
        target_arg: str | None = None,
        loss_reduction: str = "mean",
    ):
        super().__init__(
            metrics=metrics,
            input_key=input_key,
            target_key=target_key,
            output_key=output_key,
            carry=carry,
            model_loss=model_loss,
            target_arg=target_arg,
            loss_reduction=loss_reduction,
        )
        if not 0 <= label_smoothing < 1:
            raise ConfigError([Problem("task.label_smoothing", label_smoothing, "a number in [0, 1)")])
        if top_k != "auto" and not is_integer(top_k, 0, num_classes - 1):
            raise ConfigError(
                [Problem("task.top_k", top_k, f"auto, 0 (none) or an integer below the {num_classes} classes")]
            )
        self.num_classes, self.label_smoothing, self.loss_fn = num_classes, label_smoothing, user_loss(loss)
        # top-5 of 6 classes is near 1.0: noise
        self.top_k: int = (5 if num_classes > 10 else 0) if isinstance(top_k, str) else top_k
        self.confusion_matrix, self.class_names = confusion_matrix, class_names

    def target(self, batch) -> torch.Tensor:
        """Class indices (B,); or soft targets (B, num_classes), a batch mix's (mix.mixup, mix.cutmix)."""
        targets = super().target(batch)
        return targets if targets.is_floating_point() and targets.ndim == 2 else targets.long()

    def forward(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        every = self.call(model, batch)
        outputs, targets = self.output(every), self.target(batch)
        soft = targets.is_floating_point()
        needed = (len(targets), self.num_classes) if soft else (*targets.shape, self.num_classes)
        if not isinstance(outputs, torch.Tensor) or outputs.shape != needed:
            what = f"{self.name} with {self.num_classes} classes"
            raise UserError(wrong_outputs(model, outputs, len(targets), f"{needed}", what))
        own = self.model_loss_of(every)
        if own is not None:
            return own, outputs
        if self.loss_fn is not None:
            return self.loss_fn(every, targets), outputs
        try:  # soft targets (a mix's) are probabilities: torch's cross-entropy takes them, label smoothing too
            if outputs.ndim > 2:  # a class per position (a language model's logits (B, T, C)): one cross-entropy
                return F.cross_entropy(
                    outputs.flatten(0, -2), targets.flatten(), label_smoothing=self.label_smoothing
                ), outputs
            return F.cross_entropy(outputs, targets, label_smoothing=self.label_smoothing), outputs
        except IndexError as e:  # a class index past the outputs (the CPU's error; CUDA asserts on the device)
            raise DataError(
                f"data: a target is not a class index in [0, {outputs.shape[-1] - 1}] ({e}); the data's classes and "
                "its targets disagree"
            ) from None

    def own_metrics(self) -> dict:
        # validate_args=False: torchmetrics' checks read the device per batch; the targets were
        # checked at start-up (saturate.components.model) and the outputs' shape in forward
        wanted = {
            "acc",
            *([f"top{self.top_k}"] if self.top_k else []),
            *(["confusion"] if self.confusion_matrix else []),
        }
        if not wanted - self.removed():
            return {}
        import_timed("torchmetrics")  # imported with the first metric (saturate.tasks.base.Task.metrics)
        from torchmetrics.classification import MulticlassAccuracy

        metrics: dict[str, Any] = {"acc": MulticlassAccuracy(self.num_classes, average="micro", validate_args=False)}
        if self.top_k:
            metrics[f"top{self.top_k}"] = MulticlassAccuracy(
                self.num_classes, top_k=self.top_k, average="micro", validate_args=False
            )
        if self.confusion_matrix:  # a (K, K) result: shown as an image, not logged as numbers
            from torchmetrics.classification import MulticlassConfusionMatrix

            metrics["confusion"] = MulticlassConfusionMatrix(self.num_classes, normalize="true", validate_args=False)
        return metrics

    def predictions(self, outputs, batch) -> dict[str, torch.Tensor]:
        """Each sample's logits and target (per position: (T, C) and (T,) a sample)."""
        return {"output": outputs.float(), "target": self.target(batch)}

    def metric_inputs(self, outputs, batch) -> tuple[torch.Tensor, torch.Tensor]:
        targets = self.target(batch)
        if outputs.ndim > 2 and not targets.is_floating_point():  # per position: every position is a sample
            return outputs.float().flatten(0, -2), targets.flatten()
        return outputs.float(), targets
