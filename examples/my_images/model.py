"""A user's own model, built by a timm-style factory that takes only `num_classes`: it
assumes greyscale input itself. saturate passes the data-derived arguments a constructor
names, and only those."""

from torch import nn


def tiny_net(num_classes: int, width: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * width, 4 * width, 3, padding=1),
        nn.BatchNorm2d(4 * width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, num_classes),
    )
