from __future__ import annotations

from torch import nn


def norm_layer(kind: str, channels: int) -> nn.Module:
    """batch (the usual), group (per-sample: unchanged by how a batch is split) or none."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(min(8, channels), channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"model.norm={kind!r}: expected batch, group or none")


def conv_block(c_in: int, c_out: int, norm: str) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=norm == "none"), norm_layer(norm, c_out), nn.ReLU(inplace=True)
    )


class SmallCNN(nn.Module):
    """Three conv stages (width, 2 width, 4 width) with max-pooling between them, global
    average pooling and a linear head. Works from 8x8 (digits) upwards."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32, norm: str = "batch"):
        super().__init__()
        w = width
        self.features = nn.Sequential(
            conv_block(in_channels, w, norm),
            conv_block(w, w, norm),
            nn.MaxPool2d(2),
            conv_block(w, 2 * w, norm),
            conv_block(2 * w, 2 * w, norm),
            nn.MaxPool2d(2),
            conv_block(2 * w, 4 * w, norm),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(4 * w, num_classes)

    def forward(self, x):  # x: (B, C, H, W) -> logits (B, num_classes)
        return self.head(self.features(x))
