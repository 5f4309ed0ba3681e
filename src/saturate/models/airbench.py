from __future__ import annotations

from torch import nn


class ConvGroup(nn.Sequential):
    """conv -> max-pool -> BN -> GELU -> conv -> BN -> GELU (airbench's block)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
            nn.MaxPool2d(2),
            nn.BatchNorm2d(c_out),
            nn.GELU(),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.GELU(),
        )


class AirBench(nn.Module):
    """A small network built for speed on CIFAR-sized images, after Keller Jordan's airbench:
    a wide 2x2 stem, three conv groups that halve the resolution, a global max-pool and a
    bias-free linear head whose logits are scaled down. Few, large, fusable kernels."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        widths: tuple[int, int, int] = (64, 256, 256),
        stem: int = 24,
        logit_scale: float = 1 / 9,
    ):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, stem, 2, padding=1, bias=False), nn.BatchNorm2d(stem), nn.GELU()
        )
        self.groups = nn.Sequential(
            ConvGroup(stem, widths[0]), ConvGroup(widths[0], widths[1]), ConvGroup(widths[1], widths[2])
        )
        self.pool = nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten())
        self.head = nn.Linear(widths[2], num_classes, bias=False)
        self.logit_scale = logit_scale

    def forward(self, x):  # (B, C, H, W) -> (B, num_classes)
        return self.head(self.pool(self.groups(self.stem(x)))) * self.logit_scale
