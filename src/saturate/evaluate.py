"""Validation: loss and accuracy over the whole validation set, never augmented."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from saturate.precision import Precision


class Evaluator:
    def __init__(self, model: nn.Module, batches, precision: Precision, *, interval: int, dist):
        self.model, self.batches, self.precision, self.interval, self.dist = model, batches, precision, interval, dist

    def due(self, epoch: int, last: bool) -> bool:
        """After every `interval`-th epoch, and always after the last."""
        return last or epoch % self.interval == 0

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=next(self.model.parameters()).device)  # loss sum, hits, count
        for batch in self.batches.epoch(0):  # this rank's shard of the validation set, unpadded
            x, y = self.batches.to_device(batch)
            with self.precision.autocast():
                logits = self.model(x)
            totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += len(y)
        self.model.train(was_training)
        loss, hits, count = self.dist.sum_tensor(totals.cpu()).tolist()
        return {"val/loss": loss / count, "val/acc": hits / count}
