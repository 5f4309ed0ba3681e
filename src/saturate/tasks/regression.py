"""Regression: real-valued targets of any shape, outputs with as many values per sample.

MSE, L1 or Huber (or the user's `loss(outputs, targets)`, given the outputs in the targets'
shape when only a trailing 1 differs: (B, 1) against (B,), which torch's losses would
broadcast to (B, B)); `mae`, `rmse`, `r2` and the user's metrics. When the data gives a
`target_inverse` (e.g. its scaler's inverse), every metric is also reported in the targets'
own units as `<name>_raw` (`test/rmse_raw`, `test/mape_raw`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from saturate.errors import ConfigError, Problem, UserError
from saturate.started import import_timed
from saturate.tasks.base import Task, user_loss, wrong_outputs

LOSSES = ("mse", "l1", "huber")


class Regression(Task):
    name = "regression"
    main = None  # val/loss

    def __init__(
        self,
        num_outputs: int,
        *,
        loss: str | Callable = "mse",
        huber_delta: float = 1.0,
        metrics: dict | None = None,
        target_inverse: Callable | None = None,
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
        if isinstance(loss, str) and loss not in LOSSES:
            raise ConfigError(
                [
                    Problem(
                        "task.loss", loss, f"one of {', '.join(LOSSES)}, or a `_target_` node taking (outputs, targets)"
                    )
                ]
            )
        if not isinstance(huber_delta, (int, float)) or isinstance(huber_delta, bool) or not huber_delta > 0:
            raise ConfigError([Problem("task.huber_delta", huber_delta, "a number > 0")])
        if target_inverse is not None and not callable(target_inverse):
            allowed = "a callable taking targets back to their units"
            raise ConfigError([Problem("data.target_inverse", type(target_inverse).__name__, allowed)])
        self.num_outputs, self.huber_delta, self.inverse = num_outputs, huber_delta, target_inverse
        self.loss_name = loss if isinstance(loss, str) else None
        self.loss_fn = user_loss(loss) if not isinstance(loss, str) else None

    def target(self, batch) -> torch.Tensor:
        return super().target(batch).float()

    def forward(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        targets = self.target(batch)
        every = self.call(model, batch)
        outputs = self.output(every)
        if not isinstance(outputs, torch.Tensor) or outputs.numel() != targets.numel():
            per = targets[0].numel() if len(targets) else 1
            needed = f"{per} value(s) per sample"
            raise UserError(wrong_outputs(model, outputs, len(targets), needed, f"{self.name} with targets"))
        if outputs.shape != targets.shape:
            outputs = outputs.reshape(targets.shape)
        own = self.model_loss_of(every)
        if own is not None:
            return own, outputs
        if self.loss_fn is not None:
            return self.loss_fn(every if self.output_key is not None else outputs, targets), outputs
        o = outputs.float()
        if self.loss_name == "huber":
            return F.huber_loss(o, targets, delta=self.huber_delta), outputs
        return (F.l1_loss if self.loss_name == "l1" else F.mse_loss)(o, targets), outputs

    def own_metrics(self) -> dict:
        """mae, rmse and r2, less those the user's task.metrics set to null: a run that logs its
        loss only never imports torchmetrics."""
        wanted = [name for name in ("mae", "rmse", "r2") if name not in self.removed()]
        if not wanted:
            return {}
        import_timed("torchmetrics")  # imported with the first metric (saturate.tasks.base.Task.metrics)
        from torchmetrics import MeanAbsoluteError, MeanSquaredError, R2Score

        made: dict[str, Callable[[], Any]] = {
            "mae": MeanAbsoluteError,
            "rmse": lambda: MeanSquaredError(squared=False),
            "r2": lambda: R2Score(multioutput="uniform_average"),
        }
        return {name: made[name]() for name in wanted}

    def metrics(self) -> dict:
        metrics = super().metrics()
        if self.inverse is not None:
            metrics.update({f"{name}_raw": metric.clone() for name, metric in list(metrics.items())})
        return metrics

    def metric_inputs(self, outputs, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) or (B, k) for both: images and sequences of values flattened per sample."""
        targets = self.target(batch)
        outputs = outputs.float().reshape(targets.shape) if outputs.numel() == targets.numel() else outputs.float()
        if targets.ndim > 2:
            return outputs.flatten(1), targets.flatten(1)
        return outputs, targets

    def update(self, metrics: dict, outputs, batch) -> None:
        preds, target = self.metric_inputs(outputs, batch)
        raw = (self.inverse(preds), self.inverse(target)) if self.inverse is not None else None
        for name, metric in metrics.items():
            metric.update(*(raw if name.endswith("_raw") and raw is not None else (preds, target)))

    def predictions(self, outputs, batch) -> dict[str, torch.Tensor]:
        preds, target = self.metric_inputs(outputs, batch)
        out = {"output": preds, "target": target}
        if self.inverse is not None:
            out.update(output_raw=self.inverse(preds), target_raw=self.inverse(target))
        return out
