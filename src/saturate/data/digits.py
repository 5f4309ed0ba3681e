from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits as sk_digits
from sklearn.model_selection import train_test_split

from saturate.data.in_memory import InMemory
from saturate.data.options import fraction, seed


def load_digits(*, val_fraction: float, split_seed: int) -> tuple[InMemory, InMemory]:
    """scikit-learn's bundled handwritten digits (no download): 1,797 grey 8x8 images with
    values 0..16, scaled to uint8 0..255, split stratified by class with a fixed seed."""
    fraction("val_fraction", val_fraction)
    seed("split_seed", split_seed)
    x, y = sk_digits(return_X_y=True)
    images = torch.from_numpy(np.rint(x * (255 / 16)).astype(np.uint8).reshape(-1, 1, 8, 8))
    labels = torch.from_numpy(y.astype(np.int64))
    train_idx, val_idx = train_test_split(
        np.arange(len(y)), test_size=val_fraction, stratify=y, random_state=split_seed
    )
    return InMemory(images[train_idx], labels[train_idx]), InMemory(images[val_idx], labels[val_idx])
