from __future__ import annotations

import torch

from saturate.data.base import DataInfo, ImageTensors, channel_stats


def make_synthetic(cfg) -> tuple[ImageTensors, ImageTensors, DataInfo]:
    """SYNTHETIC data for throughput work: uniform noise images, each class shifted by its
    own fixed pattern so that a model can learn something. Labelled synthetic everywhere."""
    g = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.channels, cfg.height, cfg.width)
    patterns = torch.randint(-40, 41, (cfg.num_classes, *shape), generator=g)

    def split(n: int) -> ImageTensors:
        labels = torch.randint(0, cfg.num_classes, (n,), generator=g)
        noise = torch.randint(0, 256, (n, *shape), generator=g)
        return ImageTensors((noise + patterns[labels]).clamp_(0, 255).to(torch.uint8), labels)

    train, val = split(cfg.num_train), split(cfg.num_val)
    mean, std = channel_stats(train.images)
    return train, val, DataInfo("synthetic", *shape, cfg.num_classes, mean, std, synthetic=True)
