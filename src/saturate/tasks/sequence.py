"""Sequences of variable length: per-timestep classes, or label sequences not aligned with
the frames (CTC: sign language, speech, handwriting).

Batches are dicts as a padding collate makes them (saturate.data.pad_collate):
`input` (B, T, F) padded, `input_length` (B,), `target` (B, S) padded, `target_length` (B,).
The model is called as `model(input, input_length)` when its forward takes two arguments,
else `model(input)`; it returns logits (B, T', C), or `(logits, output_lengths)` when it
shortens the sequence (a strided convolution).

- `mode=ctc`: CTC loss (class 0 is the blank; labels are 1..C-1); metrics `ter` (token error
  rate: edit distance over reference length, torchmetrics' CharErrorRate on the tokens) and
  `seq_acc` (share of sequences decoded exactly), from greedy decoding.
- `mode=per_step`: cross-entropy per timestep, padding ignored; metric `acc` over the real
  timesteps.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from saturate.errors import ConfigError, DataError, Problem, is_integer
from saturate.started import import_timed
from saturate.tasks.base import Task

IGNORE = -100
TOKEN_BASE = 0x4E00  # tokens become characters from here (CJK ideographs: one code point each, never combined)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Integer tensors on the host, those on a device copied together: one synchronisation,
    not one each (those on the host already, CTC's lengths, stay as they are)."""
    away = [t for t in tensors if t.device.type != "cpu"]
    copied: Iterator[torch.Tensor] = iter([])
    if away:
        flat = torch.cat([t.reshape(-1).long() for t in away]).cpu()
        copied = (part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in away]), away, strict=True))
    return [next(copied) if t.device.type != "cpu" else t.long() for t in tensors]


class Sequence(Task):
    name = "sequence"
    class_targets = False
    CHECK_LABELS = 3  # batches whose labels on a device are read to check them (a synchronisation each)

    def __init__(
        self,
        num_classes: int,
        *,
        mode: str = "ctc",
        metrics: dict | None = None,
        input_key: str = "input",
        target_key: str = "target",
        input_length_key: str = "input_length",
        target_length_key: str = "target_length",
    ):
        super().__init__(metrics=metrics, input_key=input_key, target_key=target_key)
        if mode not in ("ctc", "per_step"):
            raise ConfigError([Problem("task.mode", mode, "ctc or per_step")])
        if not is_integer(num_classes, 2):
            raise ConfigError(
                [
                    Problem(
                        "task.num_classes", num_classes, "an integer >= 2 (with CTC: the labels and the blank, class 0)"
                    )
                ]
            )
        self.num_classes, self.mode = num_classes, mode
        self.input_length_key, self.target_length_key = input_length_key, target_length_key
        self.main = "ter" if mode == "ctc" else "acc"
        self._takes_lengths: bool | None = None
        self.labels_checked = 0  # batches whose labels were read on the host (the first CHECK_LABELS)
        # CTC reads the lengths on the host: on the device PyTorch's loss copies them back, a
        # synchronisation every step (the loaders leave these entries where they are)
        self.host_keys = (input_length_key, target_length_key) if mode == "ctc" else ()

    def _entry(self, batch, key: str):
        if not isinstance(batch, dict) or key not in batch:
            found = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise DataError(
                f"task=sequence: batches need a {key!r} entry (a dict from a padding collate, e.g. "
                f"saturate.data.pad_collate); this one has {found}"
            )
        return batch[key]

    def _call(self, model, batch):
        x, lengths = self._entry(batch, str(self.input_key)), self._entry(batch, self.input_length_key)
        if self._takes_lengths is None:
            try:
                params = [
                    p
                    for p in inspect.signature(getattr(model, "forward", model)).parameters.values()
                    if p.kind != p.VAR_KEYWORD
                ]
                self._takes_lengths = len(params) >= 2
            except (TypeError, ValueError):
                self._takes_lengths = False
        out = model(x, lengths) if self._takes_lengths else model(x)
        logits, out_lengths = out if isinstance(out, (tuple, list)) else (out, lengths)
        return logits, out_lengths.long()

    def forward(self, model, batch):
        logits, lengths = self._call(model, batch)
        target = self._entry(batch, self.target_key).long()
        if self.mode == "per_step":
            if target.shape[1] < logits.shape[1]:  # shapes: no host read
                raise DataError(
                    f"data: per_step targets have {target.shape[1]} steps, the model's outputs {logits.shape[1]}; "
                    "task.mode=per_step needs one label per output frame (for label sequences not aligned with the "
                    "frames, task.mode=ctc)"
                )
            valid = torch.arange(logits.shape[1], device=logits.device)[None, :] < lengths[:, None]
            labels = torch.where(valid, target[:, : logits.shape[1]], IGNORE)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
            return loss, (logits, lengths)
        log_probs = logits.float().log_softmax(-1).transpose(0, 1)  # (T', B, C), as ctc_loss takes it
        target_lengths = self._entry(batch, self.target_length_key).long()
        self._check_ctc(lengths, target, target_lengths)
        per_sample = F.ctc_loss(
            log_probs, target, lengths, target_lengths, blank=0, reduction="none", zero_infinity=True
        )
        # reduction="mean" as torch computes it, with the host lengths brought to the loss (torch
        # divides by them where they are: a GPU loss by host lengths is a device mismatch)
        loss = (per_sample / target_lengths.clamp_min(1).to(per_sample.device, non_blocking=True)).mean()
        return loss, (logits, lengths)

    def _check_ctc(self, lengths: torch.Tensor, target: torch.Tensor, target_lengths: torch.Tensor) -> None:
        """Targets CTC cannot align, named: a DataError, where torch's zero_infinity would make
        their loss 0 and train on nothing (or a label outside 1..C-1 would train the wrong
        class). The lengths live on the host: checked every batch. The labels in the first
        CHECK_LABELS batches (on a device a read is a synchronisation) and at start-up."""
        on_host = lengths.device.type == "cpu" and target_lengths.device.type == "cpu"
        if on_host:
            self._too_few_frames(lengths, target_lengths, torch.zeros_like(target_lengths))
        if self.labels_checked < self.CHECK_LABELS:  # on a device each read is a synchronisation
            self.labels_checked += 1
            self._check_labels(lengths, target, target_lengths)

    def _check_labels(self, lengths: torch.Tensor, target: torch.Tensor, target_lengths: torch.Tensor) -> None:
        """The labels within each target's length: none the blank, none past num_classes - 1,
        and frames enough for the repeats (a blank between two equal labels)."""
        counts = target_lengths.to(target.device)
        within = torch.arange(target.shape[1], device=target.device)[None, :] < counts[:, None]
        given = target[within]
        if given.numel():
            low, high = (int(v) for v in torch.stack([given.min(), given.max()]).cpu())
            allowed = f"labels are 1 to {self.num_classes - 1} (task.num_classes={self.num_classes} counts the blank)"
            if low == 0:
                raise DataError(f"data: a CTC target holds label 0, the blank; {allowed}: shift your labels up by one")
            if low < 0 or high >= self.num_classes:
                raise DataError(f"data: a CTC target holds label {low if low < 0 else high}; {allowed}")
        repeats = ((target[:, 1:] == target[:, :-1]) & within[:, 1:]).sum(1).cpu()
        self._too_few_frames(lengths.cpu(), target_lengths.cpu(), repeats)

    def _too_few_frames(self, frames: torch.Tensor, count: torch.Tensor, repeats: torch.Tensor) -> None:
        short = (frames < count + repeats).nonzero().flatten()
        if len(short):
            i = int(short[0])
            said = f" ({int(repeats[i])} of them repeats, each needing a blank between)" if repeats[i] else ""
            raise DataError(
                f"data: sample {i} of a batch has {int(frames[i])} output frames for {int(count[i])} labels{said}; "
                "CTC needs at least one frame per label and one more per repeat: shorten the target, or keep more "
                "frames (less downsampling in the model)"
            )

    def own_metrics(self) -> dict:
        import_timed("torchmetrics")  # imported with the first metric (saturate.tasks.base.Task.metrics)
        from torchmetrics import MeanMetric
        from torchmetrics.classification import MulticlassAccuracy
        from torchmetrics.text import CharErrorRate

        if self.mode == "per_step":
            return {
                "acc": MulticlassAccuracy(self.num_classes, average="micro", ignore_index=IGNORE, validate_args=False)
            }
        return {"ter": CharErrorRate(), "seq_acc": MeanMetric(nan_strategy="disable")}

    def better(self, name: str) -> str:
        return "min" if name.split("/")[0] in ("ter", "loss") else super().better(name)

    def decode(self, outputs) -> list[list[int]]:
        """Greedy CTC decoding: the best class per frame, repeats merged, blanks dropped."""
        logits, lengths = outputs
        return self._decoded(*to_host(logits.argmax(-1), lengths))

    @staticmethod
    def _decoded(best: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
        sequences = []
        for row, n in zip(best.tolist(), lengths.tolist(), strict=True):
            out, previous = [], 0
            for token in row[:n]:
                if token != previous and token != 0:
                    out.append(token)
                previous = token
            sequences.append(out)
        return sequences

    def update(self, metrics: dict, outputs, batch) -> None:
        if self.mode == "per_step":
            logits, lengths = outputs
            target = self._entry(batch, self.target_key).long()[:, : logits.shape[1]]
            valid = torch.arange(logits.shape[1], device=logits.device)[None, :] < lengths[:, None]
            preds, labels = logits.float().flatten(0, 1), torch.where(valid, target, IGNORE).flatten()
            for metric in metrics.values():
                metric.update(preds, labels)
            return
        logits, out_lengths = outputs  # one copy to the host per batch: decoding is on the host
        best, out_lengths, target, lengths = to_host(
            logits.argmax(-1),
            out_lengths,
            self._entry(batch, self.target_key),
            self._entry(batch, self.target_length_key),
        )
        decoded = self._decoded(best, out_lengths)
        references = [row[:n] for row, n in zip(target.tolist(), lengths.tolist(), strict=True)]
        text = lambda tokens: "".join(chr(TOKEN_BASE + t) for t in tokens)
        exact = torch.tensor([float(d == r) for d, r in zip(decoded, references, strict=True)])
        for name, metric in metrics.items():  # the user's too: torchmetrics' text metrics, on the tokens as characters
            if name == "seq_acc":
                metric.update(exact.to(metric.device))
            else:
                metric.update([text(d) for d in decoded], [text(r) for r in references])

    def predictions(self, outputs, batch) -> dict[str, torch.Tensor]:
        """Per sample: `output` (per_step: the class per frame; ctc: the decoded labels), padded
        with -1 past `output_length`; `target` and `target_length` as the batch gave them."""
        target = self._entry(batch, self.target_key).long()
        target_length = self._entry(batch, self.target_length_key).long().to(target.device, non_blocking=True)
        given = {
            "target": torch.where(
                torch.arange(target.shape[1], device=target.device) < target_length[:, None], target, -1
            ),
            "target_length": target_length,
        }
        if self.mode == "per_step":
            logits, lengths = outputs
            best = logits.argmax(-1)
            return {
                "output": torch.where(torch.arange(best.shape[1], device=best.device) < lengths[:, None], best, -1),
                "output_length": lengths,
                **given,
            }
        decoded = self.decode(outputs)
        width = max(1, max(len(d) for d in decoded))
        padded = torch.full((len(decoded), width), -1, dtype=torch.int64)
        for i, d in enumerate(decoded):
            padded[i, : len(d)] = torch.tensor(d, dtype=torch.int64)
        return {"output": padded, "output_length": torch.tensor([len(d) for d in decoded]), **given}
