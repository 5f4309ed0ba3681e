"""What the built-in tasks are called and what they log: names only (no torch, no
torchmetrics), so that a config is checked before anything heavy is imported. The tasks
themselves are saturate.task."""

from __future__ import annotations

KINDS = ("classification", "regression")
REGRESSION_LOSSES = ("mse", "l1", "huber")
# metric -> whether larger is better; `val/loss` and `train/loss` are lower-is-better everywhere
DIRECTIONS = {"val/acc": "max", "val/top5": "max", "val/r2": "max", "val/mae": "min", "val/rmse": "min",
              "val/loss": "min", "train/loss": "min"}  # fmt: skip


def metric_names(kind: str, num_classes: int | None = None) -> tuple[str, ...]:
    """The validation metrics a task of `kind` logs (besides val/loss). Without
    `num_classes`, every metric the kind can log (val/top5 needs more than 5 classes)."""
    if kind == "classification":
        return ("val/acc", "val/top5") if num_classes is None or num_classes > 5 else ("val/acc",)
    return ("val/mae", "val/rmse", "val/r2")


def main_metric(kind: str, has_val: bool = True) -> str:
    """What a run of this kind is judged by when checkpoint.monitor is `auto`."""
    if not has_val:
        return "train/loss"
    return "val/acc" if kind == "classification" else "val/loss"
