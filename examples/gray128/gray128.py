"""128x128 grayscale image classification with the user's own Kornia augmentation on the
device: workload 004 of saturate's seeds (a GPU-utilisation guide whose fix is "move the
augmentation to the GPU with Kornia": flip, rotation up to 15 degrees, brightness and
contrast 0.2, batched on the device, validation never augmented). Its project wrapped those
in its own `GPUAugmentation` class handed to its trainer; here the same four Kornia modules
are listed in the config (conf/augmentation/gray_gpu.yaml) and saturate runs them.

The images follow torchvision's `ToTensor()` convention: float32 (1, 128, 128) in [0, 1].
They are drawn, not downloaded: a filled shape (disc, square, triangle or cross) of random
size, position and grey level on a noisy, unevenly lit background, as a defect-inspection or
X-ray crop would be. Nothing here is saturate's.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

SHAPES = ("disc", "square", "triangle", "cross")
SIZE = 128


def draw(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 128, 128) uint8, shape index (N,) int64)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    images, labels = np.empty((count, SIZE, SIZE), np.uint8), rng.integers(0, len(SHAPES), count)
    for i, k in enumerate(labels):
        cy, cx, r = rng.uniform(35, 93), rng.uniform(35, 93), rng.uniform(12, 28)
        dy, dx = yy - cy, xx - cx
        mask = {
            0: dy**2 + dx**2 < r**2,
            1: (abs(dy) < r * 0.8) & (abs(dx) < r * 0.8),
            2: (dy < r * 0.7) & (dy > -r) & (abs(dx) < (dy + r) * 0.6),
            3: ((abs(dy) < r) & (abs(dx) < r * 0.3)) | ((abs(dx) < r) & (abs(dy) < r * 0.3)),
        }[int(k)]
        light = rng.uniform(60, 120) + rng.uniform(-30, 30) * (xx / SIZE) + rng.uniform(-30, 30) * (yy / SIZE)
        image = light + mask * rng.uniform(70, 120) * rng.choice([-1, 1]) + rng.normal(0, 12, (SIZE, SIZE))
        images[i] = np.clip(image, 0, 255)
    return images, labels


class GrayImages(Dataset):
    """Samples (image (1, 128, 128) float32 in [0, 1], class index): ToTensor()'s output."""

    classes = list(SHAPES)

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = torch.from_numpy(images), torch.from_numpy(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i].unsqueeze(0).float() / 255, self.labels[i]


def load_gray(train: int = 2000, val: int = 400, seed: int = 0) -> tuple[GrayImages, GrayImages]:
    return GrayImages(*draw(train, seed)), GrayImages(*draw(val, seed + 1))


class GrayNet(nn.Module):
    """Four conv-BN-ReLU stages, each halving the resolution (128 -> 8), pooled to a vector."""

    def __init__(self, in_channels: int = 1, num_classes: int = 4, width: int = 16):
        super().__init__()
        stages, channels = [], in_channels
        for out in (width, width * 2, width * 4, width * 8):
            stages += [
                nn.Conv2d(channels, out, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(inplace=True),
            ]
            channels = out
        self.features = nn.Sequential(*stages, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
