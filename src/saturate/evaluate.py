"""Validation: loss and accuracy over the whole validation set, never augmented."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from saturate.precision import Precision


class Evaluator:
    def __init__(self, model: nn.Module, batches, precision: Precision, *, interval: int):
        self.model, self.batches, self.precision, self.interval = model, batches, precision, interval

    def due(self, epoch: int, last: bool) -> bool:
        """After every `interval`-th epoch, and always after the last."""
        return last or epoch % self.interval == 0

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        loss_sum = correct = None
        count = 0
        for batch in self.batches.epoch(0):
            x, y = self.batches.to_device(batch)
            with self.precision.autocast():
                logits = self.model(x)
            loss = F.cross_entropy(logits.float(), y, reduction="sum")
            hits = (logits.argmax(1) == y).sum()
            loss_sum = loss if loss_sum is None else loss_sum + loss
            correct = hits if correct is None else correct + hits
            count += len(y)
        self.model.train(was_training)
        totals = torch.stack([loss_sum, correct.float(), torch.tensor(float(count), device=loss_sum.device)]).tolist()
        return {"val/loss": totals[0] / totals[2], "val/acc": totals[1] / totals[2]}
