"""Binary segmentation of 128x128 grayscale images, as `milesial/Pytorch-UNet` trains its
U-Net (train.py and evaluate.py at 21d7850): per-pixel masks, binary cross-entropy plus a
soft Dice term, RMSprop, the Dice of each image evaluated five times per epoch, and a
ReduceLROnPlateau (patience 5) stepped after every evaluation. What it did, and where it
lives here:

- images and their masks as dict samples {'image': (1, H, W) float, 'mask': (H, W) long}
                                                   -> `load_shapes` (task.input_key: image,
                                                      task.target_key: mask)
- UNet(n_channels, n_classes), 64 channels wide    -> `UNet`, written here (the same
                                                      architecture, narrower: `width`)
- BCEWithLogits + dice_loss, Dice per image        -> task=segmentation, dice_weight: 1
- evaluate every n_train // (5 x batch) steps,     -> trainer.eval_every: 0.2 (a fifth of an
  ReduceLROnPlateau(mode max, patience 5)             epoch), optim.scheduler: ReduceLROnPlateau
                                                      (fed val/dice, the monitored metric)
- RMSprop(lr, weight_decay 1e-8, momentum 0.999), clip 1.0  -> optim=rmsprop, trainer.grad_clip=1
- model.to(memory_format=torch.channels_last)      -> trainer.channels_last: true
- no augmentation                                  -> none; `augmentation=shapes_gpu` adds flips
                                                      and small rotations (Kornia, on the
                                                      device) that move each mask with its image,
                                                      and a brightness change of the image only

The images are drawn, not downloaded: 1-3 filled shapes (ellipses, rotated rectangles,
triangles) on a noisy, shaded background, as an inspection or a cell-imaging crop would be.
Nothing here is saturate's.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


def _shape(rng: np.random.Generator, yy: np.ndarray, xx: np.ndarray, size: int) -> np.ndarray:
    """One filled shape as a boolean (size, size) array."""
    kind, (cy, cx) = rng.integers(3), rng.uniform(0.2, 0.8, size=2) * size
    r, theta = rng.uniform(0.12, 0.30) * size, rng.uniform(0, np.pi)
    u = (xx - cx) * np.cos(theta) + (yy - cy) * np.sin(theta)
    v = -(xx - cx) * np.sin(theta) + (yy - cy) * np.cos(theta)
    if kind == 0:
        return (u / r) ** 2 + (v / (r * rng.uniform(0.5, 1.0))) ** 2 <= 1.0
    if kind == 1:
        return (np.abs(u) <= r) & (np.abs(v) <= r * rng.uniform(0.4, 1.0))
    return (v >= -r / 2) & (v <= r - np.abs(u) * 1.5)  # a triangle with its apex up (rotated)


def make_shapes(n: int, size: int = 128, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(images float32 (n, 1, size, size) in [0, 1], masks int64 (n, size, size) of 0/1)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    images, masks = np.empty((n, 1, size, size), np.float32), np.zeros((n, size, size), np.int64)
    for k in range(n):
        base = rng.uniform(0.25, 0.75)
        shade = rng.uniform(-0.15, 0.15, size=2)
        image = base + shade[0] * (yy / size - 0.5) + shade[1] * (xx / size - 0.5)
        for _ in range(rng.integers(1, 4)):
            shape = _shape(rng, yy, xx, size)
            image = np.where(shape, base + rng.uniform(0.2, 0.4) * rng.choice([-1.0, 1.0]), image)
            masks[k] |= shape
        images[k, 0] = np.clip(image + rng.normal(0.0, rng.uniform(0.04, 0.10), image.shape), 0, 1)
    return images, masks


class Shapes(Dataset):
    """Dict samples of an image and its mask, held in memory."""

    num_classes = 2  # background and the shapes

    def __init__(self, images: np.ndarray, masks: np.ndarray):
        self.images, self.masks = torch.from_numpy(images), torch.from_numpy(masks)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        return {"image": self.images[i], "mask": self.masks[i]}


def load_shapes(num_train: int = 240, num_val: int = 48, size: int = 128, seed: int = 0) -> dict:
    """Training and validation shapes from independent streams of one seed."""
    train, val = make_shapes(num_train, size, seed * 2), make_shapes(num_val, size, seed * 2 + 1)
    return {"train": Shapes(*train), "val": Shapes(*val)}


def block(cin: int, cout: int) -> nn.Sequential:
    """Two 3x3 convolutions with BatchNorm and ReLU: a U-Net stage."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """An encoder of `depth` halvings and a decoder of as many doublings joined to the
    encoder's stages by skip connections; `out_channels` logits per pixel (1: binary)."""

    def __init__(self, in_channels: int, out_channels: int = 1, width: int = 8, depth: int = 4):
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        pairs = list(itertools.pairwise(widths))
        self.down = nn.ModuleList([block(in_channels, widths[0])] + [block(a, b) for a, b in pairs])
        self.up = nn.ModuleList([nn.ConvTranspose2d(b, a, 2, stride=2) for a, b in pairs])
        self.merge = nn.ModuleList([block(2 * a, a) for a in widths[:-1]])
        self.head = nn.Conv2d(widths[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, stage in enumerate(self.down):
            x = stage(x if i == 0 else nn.functional.max_pool2d(x, 2))
            skips.append(x)
        x = skips.pop()
        for up, merge in zip(reversed(self.up), reversed(self.merge), strict=True):
            x = merge(torch.cat([up(x), skips.pop()], dim=1))
        return self.head(x)
