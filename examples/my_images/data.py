"""A user's own image dataset: greyscale uint8 images (1, size, size) made from
scikit-learn's 8x8 digits, enlarged; saturate sees uint8 (C, H, W) and takes its image fast
paths (uint8 copies, normalisation and augmentation on the device)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


class EnlargedDigits(Dataset):
    def __init__(self, images: torch.Tensor, labels: np.ndarray):
        self.images, self.targets = images, torch.from_numpy(labels)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.images[i], self.targets[i]


def load(size: int = 32, val_fraction: float = 0.2):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    small = torch.from_numpy(np.rint(x * (255 / 16)).astype(np.float32).reshape(-1, 1, 8, 8))
    images = (
        torch.nn.functional.interpolate(small, size=(size, size), mode="bilinear").round().clamp(0, 255).to(torch.uint8)
    )
    order = np.random.default_rng(0).permutation(len(y))
    cut = int(len(y) * (1 - val_fraction))
    train, val = order[:cut], order[cut:]
    return EnlargedDigits(images[train], y[train].astype(np.int64)), EnlargedDigits(
        images[val], y[val].astype(np.int64)
    )
