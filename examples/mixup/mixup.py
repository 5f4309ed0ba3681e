"""An image classifier trained with mixup, as `facebookresearch/mixup-cifar10`'s train.py
trains one (its LeNet, from `kuangliu/pytorch-cifar`, MIT). What its loop does, and where it
lives here:

- CIFAR-10's 32x32 RGB images, RandomCrop(32, padding=4) and a horizontal flip, normalised
                                        -> `load_digits_rgb`: scikit-learn's bundled digits
                                           upsampled to (3, 32, 32) uint8 (no download);
                                           whole-pixel shifts of up to 4 with zero fill,
                                           every image (Kornia's RandomAffine, nearest, p 1:
                                           the crop of the padded image) and a flip, batched
                                           on the device; the preset `minimal` shifts by
                                           fractions of a pixel, bilinear: it blurs, and met
                                           val/acc 0.9 at epoch 23.5 against 18 (median of
                                           seeds 1-6)
- `mixup_data`: one weight per batch from Beta(1, 1), a permutation of the batch as partners;
  `mixup_criterion`: lam*CE(y_a) + (1-lam)*CE(y_b)
                                        -> mix.mixup: 1.0 (cross-entropy against the mixed
                                           one-hot targets: the same loss, by linearity)
- SGD at 0.1, momentum 0.9, weight decay 1e-4, the LR constant until epoch 100
                                        -> optim=sgd with nesterov off, schedule constant,
                                           no warm-up
- the last partial batch trained     -> loader.drop_last: false
- LeNet                              -> `LeNet` below (kuangliu/pytorch-cifar's, MIT, with
                                           `num_classes`); it flattens with `.view`, so it
                                           does not take channels_last (saturate checks)

The author's script is CC BY-NC: nothing of it is copied here; mixup itself is saturate's.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class DigitImages(Dataset):
    """(uint8 image (3, 32, 32), class index)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.targets = images, labels

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.images[i], self.targets[i]


def load_digits_rgb(size: int = 32, n_val: int = 300, n_test: int = 300, seed: int = 0) -> dict:
    """scikit-learn's 1797 8x8 digits as (3, size, size) uint8 images; a shuffled
    train/val/test split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    small = torch.from_numpy((x * (255 / 16)).astype(np.float32).reshape(-1, 1, 8, 8))
    images = F.interpolate(small, size=(size, size), mode="bilinear").round().clamp(0, 255).to(torch.uint8)
    images, labels = images.expand(-1, 3, -1, -1).contiguous(), torch.from_numpy(y.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    parts = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
    return {split: DigitImages(images[rows], labels[rows]) for split, rows in parts.items()}


class LeNet(nn.Module):
    """kuangliu/pytorch-cifar models/lenet.py (MIT), with the number of classes an argument."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.max_pool2d(F.relu(self.conv1(x)), 2)
        out = F.max_pool2d(F.relu(self.conv2(out)), 2)
        out = out.view(out.size(0), -1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(out)))))
