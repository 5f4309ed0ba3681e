"""Batch transforms of training batches, on the device: mixup, CutMix, or the user's own.

Mixup and CutMix follow the recipe of their papers and of torchvision's `transforms.v2.MixUp`
and `CutMix` (the maintained implementations; torchvision is not a dependency here, and
Kornia's RandomMixUpV2 draws a uniform weight per sample, another recipe): one weight per
batch from Beta(alpha, alpha), a permutation of the batch as the partners, the inputs mixed
(mixup) or a box of the partner pasted in (CutMix, its weight then the exact area kept), and
the targets mixed with the same weight into soft targets (class indices become one-hot
first). With both on, a batch takes CutMix with `switch_prob`; `prob` of the batches are
mixed at all.

The draws are keyed by (seed, epoch, batch) on a generator of their own: a resumed run mixes
what the uninterrupted one did, and nothing else's random stream moves. Nothing is read back
from the device.
"""

from __future__ import annotations

import math
import random

import torch
from torch.utils._pytree import tree_leaves, tree_map

from saturate.errors import UserError


class BatchMix:
    """`mix(inputs, targets, epoch, batch) -> (inputs, targets)` for a training batch on the
    device; `num_classes`: the classes of index targets (None: real-valued targets, mixed as
    they are)."""

    def __init__(self, cfg, *, num_classes: int | None, seed: int, transform=None):
        self.mixup, self.cutmix, self.prob, self.switch = cfg.mixup, cfg.cutmix, cfg.prob, cfg.switch_prob
        self.num_classes, self.seed, self.transform = num_classes, seed, transform

    def __call__(self, inputs, targets, epoch: int, batch: int):
        if self.transform is not None:
            return self._own(inputs, targets)
        draw = random.Random((self.seed * 1_000_003 + epoch) * 1_000_003 + batch)
        if (not self.mixup and not self.cutmix) or draw.random() >= self.prob:
            return inputs, self._soft(targets)
        cut = bool(self.cutmix) and (not self.mixup or draw.random() < self.switch)
        alpha = self.cutmix if cut else self.mixup
        lam = draw.betavariate(alpha, alpha)
        g = torch.Generator().manual_seed(draw.getrandbits(63))
        partners = torch.randperm(len(targets), generator=g).to(targets.device, non_blocking=True)
        if cut:
            if not (isinstance(inputs, torch.Tensor) and inputs.ndim >= 3):
                raise UserError("mix.cutmix: pastes a box of an image; the inputs are not images (use mix.mixup)")
            inputs, lam = self._paste(inputs, partners, lam, draw)
        else:
            inputs = tree_map(
                lambda x: x.mul(lam).add_(x[partners], alpha=1 - lam) if x.is_floating_point() else x, inputs
            )
        soft = self._soft(targets)
        return inputs, soft.mul(lam).add_(soft[partners], alpha=1 - lam)

    def _soft(self, targets: torch.Tensor) -> torch.Tensor:
        """Class indices as one-hot rows (scatter: no host read, as one_hot's range check would be)."""
        if self.num_classes is None or targets.is_floating_point():
            return targets.float()
        rows = torch.zeros(len(targets), self.num_classes, device=targets.device)
        return rows.scatter_(1, targets.long().view(-1, 1), 1.0)

    @staticmethod
    def _paste(x: torch.Tensor, partners: torch.Tensor, lam: float, draw: random.Random):
        """CutMix: a box of each partner's image in its place; the weight becomes the area kept."""
        h, w = x.shape[-2], x.shape[-1]
        ratio = math.sqrt(1 - lam)
        cy, cx = draw.randrange(h), draw.randrange(w)
        y0, y1 = max(cy - int(h * ratio) // 2, 0), min(cy + int(h * ratio) // 2, h)
        x0, x1 = max(cx - int(w * ratio) // 2, 0), min(cx + int(w * ratio) // 2, w)
        out = x.clone()
        out[..., y0:y1, x0:x1] = x[partners][..., y0:y1, x0:x1]
        return out, 1 - (y1 - y0) * (x1 - x0) / (h * w)

    def _own(self, inputs, targets):
        """The user's transform (mix.transform): (inputs, targets) -> (inputs, targets), the
        batch size kept."""
        try:
            out = self.transform(inputs, targets)
        except Exception as e:
            name = getattr(self.transform, "__qualname__", type(self.transform).__name__)
            raise UserError(f"mix.transform: {name} raised {type(e).__name__}: {' '.join(str(e).split())[:300]}") from e
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise UserError(f"mix.transform: returned a {type(out).__name__}; expected (inputs, targets)")
        size = len(targets)
        got = {len(leaf) for leaf in (*tree_leaves(out[0]), out[1]) if isinstance(leaf, torch.Tensor)}
        if got != {size}:
            raise UserError(
                f"mix.transform: a batch of {size} came back with {sorted(got)} samples; a batch transform keeps "
                "the batch size (the step and its LR schedule count samples)"
            )
        return out[0], out[1]


class MixedPipeline:
    """A training pipeline whose device batches are then mixed (`mix`): the input and the
    target are found where the data keeps them (a pair's, or a dict's `input_key` entries and
    `target_key`), and put back mixed."""

    def __init__(self, inner, mix: BatchMix, *, input_key=0, target_key=1):
        self.inner, self.mix, self.input_key, self.target_key = inner, mix, input_key, target_key
        self.device = inner.device
        self.epoch = self.batch = 0

    def begin_epoch(self, epoch: int, start: int) -> None:
        self.inner.begin_epoch(epoch, start)
        self.epoch, self.batch = epoch, start

    def __call__(self, batch):
        batch = self.inner(batch)
        keys = self.input_key if isinstance(self.input_key, list) else None
        inputs = tuple(batch[k] for k in keys) if keys else batch[self.input_key]
        inputs, targets = self.mix(inputs, batch[self.target_key], self.epoch, self.batch)
        self.batch += 1
        if isinstance(batch, dict):
            placed = dict(zip(keys, inputs, strict=True)) if keys else {self.input_key: inputs}
            return {**batch, **placed, self.target_key: targets}
        return type(batch)([inputs, targets, *batch[2:]]) if isinstance(batch, tuple) else [inputs, targets, *batch[2:]]
