"""Evaluation: the task's loss and metrics over a whole split (validation, test), never
augmented; and the model's predictions, when asked for.

Metrics are torchmetrics objects: their states accumulate on the device (no host read per
batch for the built-in ones: no argument validation, no NaN check; torchmetrics' per-class and
confusion metrics count with torch.bincount, which reads its input's maximum on CUDA, once per
batch) and `compute()` sums them across DDP ranks, each rank having seen its own unpadded
shard. `val/loss` is the mean over samples of each batch's loss (a batch's loss weighted by
its samples; a loss summed over them, task.loss_reduction=sum, divided by their number first).
A metric's result is logged as `<split>/<name>`; a per-class result (a vector,
`average=None`) as one value per class, `<split>/<name>/<class>`; a matrix (a confusion
matrix) is not a number: it is kept for the image TensorBoard shows.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
from torch import nn

from saturate.components.precision import Precision
from saturate.errors import UserError
from saturate.loop.step import batch_size


class EvaluationError(UserError):
    """The task's metrics or predictions failed in an evaluation (a user's metric whose
    compute() raises, predictions that do not match the samples): one line; the run saves at
    its last completed step and records the failure."""


def joined(arrays: list):
    """Batches' (or ranks') arrays joined along the samples; where their other dimensions
    differ (decoded sequences of another length per batch) each is padded to the largest,
    with -1 for integers and NaN for floats."""
    import numpy as np

    shape = np.max([a.shape[1:] for a in arrays], axis=0) if arrays[0].ndim > 1 else ()
    if all(a.shape[1:] == tuple(shape) for a in arrays):
        return np.concatenate(arrays)
    fill = np.nan if np.issubdtype(arrays[0].dtype, np.floating) else -1
    padded = []
    for a in arrays:
        out = np.full((len(a), *shape), fill, dtype=a.dtype)
        out[(slice(None), *(slice(0, n) for n in a.shape[1:]))] = a
        padded.append(out)
    return np.concatenate(padded)


class LossMean:
    """The split's loss per sample: a sum and a count, kept on the device (no host read per
    batch) and added up over the DDP ranks when read. torchmetrics' MeanMetric sums the same
    way; this one lets a run whose task has no metrics leave torchmetrics unimported (with it
    scipy.signal and matplotlib: about a second of start-up on a 2-core CPU)."""

    def __init__(self, device: torch.device):
        self.total = torch.zeros((), dtype=torch.float32, device=device)
        self.count = 0

    def update(self, per_sample: torch.Tensor, count: int) -> None:
        """A batch of `count` samples whose loss per sample is `per_sample`."""
        self.total += per_sample.expand(count).sum()
        self.count += count

    def compute(self) -> float:
        """The mean over every rank's samples (NaN without any)."""
        both = torch.stack([self.total, torch.tensor(float(self.count), device=self.total.device)])
        if torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
            torch_dist.all_reduce(both)
        return float(both[0] / both[1])


class Evaluator:
    """A split's evaluation, and when it is due: every `interval`-th epoch, or every `every`
    optimizer steps (inside the epoch) when that is set; always after the last. `test_evaluator`: the
    test split's evaluator, run at every evaluation too (trainer.eval_test)."""

    def __init__(
        self,
        batches,
        precision: Precision,
        task,
        *,
        interval: int,
        every: int = 0,
        split: str = "val",
        class_names: list[str] | None = None,
        test_evaluator: Evaluator | None = None,
        estimate_evaluator: Evaluator | None = None,
    ):
        self.batches, self.precision, self.task, self.interval, self.split = batches, precision, task, interval, split
        self.every, self.test_evaluator, self.class_names = every, test_evaluator, class_names
        self.estimate_evaluator = estimate_evaluator  # trainer.train_est_batches: drawn training batches
        self.summed = getattr(task, "loss_reduction", "mean") == "sum"  # a loss summed over the batch's samples
        self.matrices: dict[str, torch.Tensor] = {}  # the last evaluation's matrix results (confusion), on the CPU
        self.preview: torch.Tensor | None = None  # images the task drew of the first batch (segmentation), on the CPU

    def due(self, epoch: int, last: bool) -> bool:
        """After every `interval`-th epoch (when not evaluating inside epochs), and always after
        the last (never without batches)."""
        return self.batches is not None and (last or (not self.every and epoch % self.interval == 0))

    def due_step(self, step: int) -> bool:
        """After every `every`-th optimizer step, counted across epochs."""
        return self.batches is not None and self.every > 0 and step % self.every == 0

    @torch.inference_mode()
    def run(
        self, model: nn.Module, interrupted=lambda: False, predict: bool = False, key: int = 0
    ) -> dict[str, float] | None:
        """The metrics, or None when `interrupted()` turned true between two batches (a
        preemption signal during a long evaluation: the caller saves and stops). With
        `predict`, the per-sample predictions are kept in `self.predictions`. `key` (the step):
        what a split evaluated on samples drawn at random draws them by."""
        reset = getattr(self.task, "reset", None)
        if callable(reset):  # a new stream: no state carried into it from training or the last evaluation
            reset(self.split)
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        metrics = {name: metric.to(device) for name, metric in self.task.metrics().items()}
        self.preview, self.preview_due = None, True
        loss = LossMean(device)
        kept: list[dict[str, torch.Tensor]] = []
        try:
            for batch in self.batches.epoch(key):  # this rank's shard of the split, unpadded
                if interrupted():
                    return None
                batch = self.batches.to_device(batch)
                with self.precision.autocast():  # the loss too, as in the step (autocast computes it in fp32)
                    value, outputs = self.task.forward(model, batch)
                if self.preview_due and callable(getattr(self.task, "preview", None)):
                    self.preview, self.preview_due = self.task.preview(outputs, batch).float().cpu(), False
                count = batch_size(batch)
                per_sample = value.float() / count if self.summed else value.float()
                loss.update(per_sample, count)  # weighted by the batch's samples
                self.task.update(metrics, outputs, batch)
                if predict:
                    kept.append(self._predictions(outputs, batch))
        finally:
            model.train(was_training)
        self.predictions = {k: joined([p[k].numpy() for p in kept]) for k in kept[0]} if kept else {}
        return {f"{self.split}/loss": loss.compute(), **self._results(metrics)}

    def _predictions(self, outputs, batch) -> dict[str, torch.Tensor]:
        """The task's predictions for a batch, on the host: a dict of tensors with one row per
        sample (rows dropped or added would be written beside the wrong sample indices)."""
        given = self.task.predictions(outputs, batch)
        kind, count = type(self.task).__name__, batch_size(batch)
        if not isinstance(given, dict):
            raise EvaluationError(
                f"task: {kind}.predictions() returned a {type(given).__name__}; expected a dict {{name: tensor with "
                "one row per sample}"
            )
        for name, value in given.items():
            rows = len(value) if isinstance(value, torch.Tensor) and value.ndim else None
            if rows != count:
                got = f"{rows} row(s)" if rows is not None else f"a {type(value).__name__} with no rows"
                raise EvaluationError(
                    f"task: {kind}.predictions() gave {name!r} with {got} for a batch of {count}; expected one per "
                    "sample"
                )
        return {k: v.detach().cpu() for k, v in given.items()}

    def write_predictions(self, path, dist) -> None:
        """This split's predictions (the last run with predict=True) with each sample's index,
        gathered from every rank, in sample order, as a .npz of plain arrays (read it with
        numpy.load(path): no pickle). Rank 0 writes."""
        import numpy as np

        shard = self.batches.sampler.indices  # this rank's samples, in the order evaluated
        mine = {
            "index": torch.as_tensor(list(shard))[: len(next(iter(self.predictions.values()), []))],
            **self.predictions,
        }
        parts = dist.gather_objects({k: np.asarray(v) for k, v in mine.items()})
        if not dist.is_main:
            return
        merged = {k: joined([p[k] for p in parts]) for k in parts[0]} if parts[0] else {}
        order = np.argsort(merged["index"], kind="stable") if merged else np.array([], dtype=np.int64)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **{k: v[order] for k, v in merged.items()})

    def _results(self, metrics: dict) -> dict[str, float]:
        """Scalars as they are, per-class vectors one value per class, matrices kept aside."""
        out: dict[str, float] = {}
        self.matrices = {}
        for name, metric in metrics.items():
            try:
                value = metric.compute()
            except Exception as e:  # noqa: BLE001 (a user's metric: one line, and the run keeps its last step)
                raise EvaluationError(
                    f"task: metric {name} ({type(metric).__name__}) raised {type(e).__name__} in compute(): "
                    f"{' '.join(str(e).split())[:300]}"
                ) from None
            value = torch.as_tensor(value)
            key = f"{self.split}/{name}"
            if value.ndim == 0:
                out[key] = float(value)
            elif value.ndim == 1:
                names = (
                    self.class_names if self.class_names and len(self.class_names) == len(value) else range(len(value))
                )
                out.update({f"{key}/{label}": float(v) for label, v in zip(names, value.tolist(), strict=True)})
            else:
                self.matrices[key] = value.detach().float().cpu()
        return out
