"""Segmentation: a class per pixel. Targets are masks (B, H, W) of class indices (binary
masks: 0 and 1); the model returns logits (B, C, H, W): one channel for binary masks
(binary cross-entropy), or one per class (cross-entropy). An optional soft Dice term
(`dice_weight`) is added to the loss, as the U-Net recipes do. Pixels of `ignore_index` count
in neither the loss nor the metrics.

Metrics (torchmetrics): `dice` and `iou` over the foreground classes (the mean of each
image's, then of the classes'), and per class, background included (`dice_class/<name>`,
or the class's index), when there are several.
Predictions export each image's predicted mask; an evaluation shows a few images, their
masks and the predictions side by side in TensorBoard (`<split>/segmentation`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from saturate.errors import ConfigError, DataError, Problem, UserError, is_integer
from saturate.started import import_timed
from saturate.tasks.base import Task, finite_number, user_loss

PREVIEWS = 4  # images shown per evaluation

log = logging.getLogger(__name__)


class Segmentation(Task):
    name = "segmentation"
    main = "dice"

    def __init__(
        self,
        num_classes: int | None = None,
        *,
        dice_weight: float = 0.0,
        ignore_index: int | None = None,
        loss: Callable | None = None,
        class_names: list[str] | None = None,
        **keys,
    ):
        """`keys`: the base's (metrics, input_key, target_key, output_key)."""
        super().__init__(**keys)
        if not is_integer(num_classes, 2):
            allowed = (
                "an integer >= 2 (binary masks: 2, background and foreground); the data gives none unless its "
                "dataset has a num_classes or classes attribute"
            )
            raise ConfigError([Problem("task.num_classes", num_classes, allowed)])
        finite_number("task.dice_weight", dice_weight, 0.0)
        self.num_classes, self.dice_weight, self.ignore_index = num_classes, float(dice_weight), ignore_index
        self.loss_fn, self.class_names = user_loss(loss), class_names
        self.masks_checked = False  # the first forward pass (the start-up check's) checks the masks' values

    def target(self, batch) -> torch.Tensor:
        return super().target(batch).long()

    def forward(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.masks_checked:  # once: the first batch's host read, never a step's
            self.check_masks(super().target(batch))
            self.masks_checked = True
        images, masks = self.input(batch), self.target(batch)
        if isinstance(images, torch.Tensor) and images.ndim == 4 and images.shape[-2:] != masks.shape[-2:]:
            size = lambda t: "x".join(map(str, t.shape[-2:]))
            raise DataError(
                f"data: masks of {size(masks)} for images of {size(images)}; task=segmentation needs each image's "
                "mask at the image's height and width (resize the masks with nearest-neighbour interpolation)"
            )
        every = self.call(model, batch)
        outputs = self.output(every)
        channels = outputs.shape[1] if isinstance(outputs, torch.Tensor) and outputs.ndim == 4 else None
        if (
            channels not in (1, self.num_classes)
            or outputs.shape[-2:] != masks.shape[-2:]
            or len(outputs) != len(masks)
        ):
            shape = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
            raise UserError(
                f"model: {type(model).__name__} returns outputs of shape {shape} for masks of shape "
                f"{tuple(masks.shape)}; task=segmentation with {self.num_classes} classes needs (B, "
                f"{self.num_classes} or 1 for binary masks, H, W), the masks' height and width"
            )
        own = self.model_loss_of(every)
        if own is not None:
            return own, outputs
        if self.loss_fn is not None:
            return self.loss_fn(every, masks), outputs
        return self._loss(outputs, masks), outputs

    def check_masks(self, masks) -> None:
        """Masks hold class indices in [0, num_classes), or ignore_index: not fractions (masks
        resized with bilinear interpolation), 0/255 images, or classes past the task's, which the
        loss would fail on (cross-entropy) or clamp and the metrics drop (one logit) without a
        word. One line naming the values found and what is allowed."""
        if not isinstance(masks, torch.Tensor):
            return
        head = "data: the first batch's masks hold"
        if masks.is_floating_point():
            odd = masks[(masks != masks.round()) | ~torch.isfinite(masks)].unique()
            if odd.numel():
                shown = ", ".join(f"{v:g}" for v in odd[:4].tolist()) + (" ..." if odd.numel() > 4 else "")
                raise DataError(
                    f"{head} non-integer values ({shown}); task=segmentation takes class indices: resize masks with "
                    "nearest-neighbour interpolation (not bilinear), or round them"
                )
        values = [int(v) for v in masks.long().unique().tolist()]
        found = ", ".join(map(str, values[:8])) + (" ..." if len(values) > 8 else "")
        ignore, classes = self.ignore_index, self.num_classes
        bad = [v for v in values if not 0 <= v < classes and v != ignore]
        if not bad:
            if ignore is not None and ignore in values and set(values) == {0, ignore}:  # a batch may be all background
                log.warning(
                    "%s only 0 and %s: if task.ignore_index=%s is a 0/%s mask's foreground, every foreground pixel "
                    "is left out of the loss and the metrics; divide the masks by %s or map them",
                    head,
                    ignore,
                    ignore,
                    ignore,
                    ignore,
                )
            return
        if set(values) <= {0, 255}:
            advice = "looks like a 0/255 mask; divide by 255 or map it"
        elif bad[0] < 0 and ignore is None:
            advice = f"set task.ignore_index={bad[0]} if it marks pixels to leave out, or map it"
        else:
            advice = "set task.num_classes (or the dataset's num_classes) to the number of classes, or map the values"
        allowed = f"class indices 0 to {classes - 1}" + (
            f" and task.ignore_index={ignore}" if ignore is not None else ""
        )
        took = f"task=segmentation with {classes} classes takes {allowed}"
        raise DataError(f"{head} {bad[0]} (values found: {found}); {took}: {advice}")

    def _loss(self, logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        keep = (masks != self.ignore_index) if self.ignore_index is not None else None
        if logits.shape[1] == 1:  # binary: one logit per pixel
            probs_from = logits[:, 0].float()
            target = masks.clamp(0, 1).float()
            weight = keep.float() if keep is not None else None
            loss = F.binary_cross_entropy_with_logits(probs_from, target, weight=weight)
            probs = torch.stack([1 - torch.sigmoid(probs_from), torch.sigmoid(probs_from)], 1)
        else:
            ignore = self.ignore_index if self.ignore_index is not None else -100
            loss = F.cross_entropy(logits.float(), masks, ignore_index=ignore)
            probs = logits.float().softmax(1)
        if self.dice_weight:
            loss = loss + self.dice_weight * (1 - soft_dice(probs, masks, keep))
        return loss

    def own_metrics(self) -> dict:
        """Dice and IoU fed one-hot masks (`update`): in the index format torchmetrics one-hots
        both masks into int64 for each metric at every update (Dice and IoU together: 17 ms a
        batch of 16 masks of 128x128 on one CPU thread; 3 ms fed one-hot). Same values."""
        import_timed("torchmetrics")  # imported with the first metric (saturate.tasks.base.Task.metrics)
        from torchmetrics.segmentation import DiceScore, MeanIoU

        classes = self.num_classes
        metrics = {
            "dice": DiceScore(classes, include_background=False, average="macro", input_format="one-hot"),
            "iou": MeanIoU(classes, include_background=False, input_format="one-hot"),
        }
        if classes > 2:
            metrics["dice_class"] = DiceScore(classes, include_background=True, average="none", input_format="one-hot")
        return metrics

    def logged(self) -> tuple[str, ...]:
        """The per-class Dice (a vector over every class, background included, so that entry c
        is class c) as the evaluation logs it: one entry each, named by the data's class names
        where there is one per class, else by the class's index."""
        shown: list[str] = []
        for name in self.names():
            if name != "dice_class" or "dice_class" in self.extra:
                shown.append(name)
                continue
            count = self.num_classes
            labels = self.class_names if self.class_names and len(self.class_names) == count else range(count)
            shown += [f"dice_class/{label}" for label in labels]
        return tuple(shown)

    def update(self, metrics: dict, outputs, batch) -> None:
        """Each metric fed the masks `metric_inputs` gives (B, H, W), or their one-hot (B, C, H,
        W) where the metric says it takes that (`input_format="one-hot"`: the task's own, and a
        user's torchmetrics segmentation metric so made)."""
        preds, masks = self.metric_inputs(outputs, batch)
        one_hot = None
        for metric in metrics.values():
            if getattr(metric, "input_format", None) != "one-hot":
                metric.update(preds, masks)
                continue
            if one_hot is None:
                classes = torch.arange(self.num_classes, device=preds.device).view(1, -1, *[1] * (preds.ndim - 1))
                one_hot = (preds.unsqueeze(1) == classes, masks.unsqueeze(1) == classes)
            metric.update(*one_hot)

    def metric_inputs(self, outputs, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted classes, masks), each (B, H, W); ignored pixels set to the background in
        both (neutral for the foreground metrics)."""
        masks = self.target(batch)
        preds = (outputs[:, 0] > 0).long() if outputs.shape[1] == 1 else outputs.argmax(1)
        if self.ignore_index is not None:
            ignored = masks == self.ignore_index
            preds, masks = preds.masked_fill(ignored, 0), masks.masked_fill(ignored, 0)
        return preds, masks

    def predictions(self, outputs, batch) -> dict[str, torch.Tensor]:
        preds, masks = self.metric_inputs(outputs, batch)
        return {"mask": preds.to(torch.uint8), "target": masks.to(torch.uint8)}

    def preview(self, outputs, batch) -> torch.Tensor:
        """A few images, their masks and the predicted masks side by side: (N, 3, H, 3W) in [0, 1]."""
        image = self.input(batch)[:PREVIEWS].float()
        low = image.amin(dim=(1, 2, 3), keepdim=True)
        image = (image - low) / (image.amax(dim=(1, 2, 3), keepdim=True) - low).clamp_min(1e-6)
        image = image[:, :3] if image.shape[1] >= 3 else image[:, :1].expand(-1, 3, -1, -1)
        preds, masks = (t[:PREVIEWS] for t in self.metric_inputs(outputs, batch))
        colour = lambda m: (m.float() / (self.num_classes - 1))[:, None].expand(-1, 3, -1, -1)
        return torch.cat([image, colour(masks), colour(preds)], dim=-1)


def soft_dice(probs: torch.Tensor, masks: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The soft Dice of the foreground classes: probabilities (B, C, H, W) against the masks'
    one-hot, over the whole batch (the U-Net recipe's dice loss), ignored pixels left out."""
    one_hot = torch.zeros_like(probs).scatter_(1, masks.clamp(0, probs.shape[1] - 1)[:, None], 1.0)
    if keep is not None:
        weight = keep[:, None].float()
        probs, one_hot = probs * weight, one_hot * weight
    probs, one_hot = probs[:, 1:], one_hot[:, 1:]
    inter = (probs * one_hot).sum(dim=(0, 2, 3))
    total = probs.sum(dim=(0, 2, 3)) + one_hot.sum(dim=(0, 2, 3))
    return ((2 * inter + 1e-6) / (total + 1e-6)).mean()
