from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits as sk_digits
from sklearn.model_selection import train_test_split

from saturate.data.base import DataInfo, ImageTensors, channel_stats


def load_digits(cfg) -> tuple[ImageTensors, ImageTensors, DataInfo]:
    """scikit-learn's bundled handwritten digits (no download): 1,797 grey 8x8 images with
    values 0..16, scaled to uint8 0..255, split stratified by class with a fixed seed."""
    x, y = sk_digits(return_X_y=True)
    images = torch.from_numpy(np.rint(x * (255 / 16)).astype(np.uint8).reshape(-1, 1, 8, 8))
    labels = torch.from_numpy(y.astype(np.int64))
    train_idx, val_idx = train_test_split(np.arange(len(y)), test_size=cfg.val_fraction, stratify=y, random_state=cfg.split_seed)
    train = ImageTensors(images[train_idx], labels[train_idx])
    val = ImageTensors(images[val_idx], labels[val_idx])
    mean, std = channel_stats(train.images)
    return train, val, DataInfo("digits", 1, 8, 8, 10, mean, std)
