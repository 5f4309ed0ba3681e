from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from saturate.errors import UserError


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x), inplace=True)


class ResNet18(nn.Module):
    """ResNet-18. `stem="cifar"` (the default, for small images): a 3x3 stride-1 stem and no
    max-pool, so 32x32 inputs reach the last stage at 4x4. `stem="imagenet"`: torchvision's
    7x7 stride-2 stem and 3x3 max-pool (224x224 reaches 7x7); at 224x224 the CIFAR stem does
    16 times the work of a real ResNet-18."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 64, stem: str = "cifar"):
        super().__init__()
        if stem not in ("cifar", "imagenet"):
            raise UserError(f"model.stem={stem!r}: expected one of cifar, imagenet")
        if stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 7, 2, 3, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, 2, 1),
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
            )
        stages, c_in = [], width
        for i, blocks in enumerate((2, 2, 2, 2)):
            c_out = width * 2**i
            for b in range(blocks):
                stages.append(BasicBlock(c_in, c_out, stride=2 if (i > 0 and b == 0) else 1))
                c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x):  # (B, C, H, W) -> (B, num_classes)
        x = self.stages(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))
