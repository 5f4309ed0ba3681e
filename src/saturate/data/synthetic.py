from __future__ import annotations

import torch

from saturate.data.in_memory import InMemory
from saturate.data.options import at_least, fits_in_memory
from saturate.data.options import seed as check_seed


def make_synthetic(
    *, num_train: int, num_val: int, channels: int, height: int, width: int, num_classes: int, seed: int
) -> tuple[InMemory, InMemory]:
    """SYNTHETIC data for throughput work: uniform noise images, each class shifted by its
    own fixed pattern so that a model can learn something. Labelled synthetic everywhere."""
    for key, value in (
        ("num_train", num_train),
        ("num_val", num_val),
        ("channels", channels),
        ("height", height),
        ("width", width),
    ):
        at_least(key, value, 1)
    at_least("num_classes", num_classes, 2)
    check_seed("seed", seed)
    # the images as uint8, and the int64 noise each split is drawn as
    fits_in_memory(
        f"data.num_train={num_train}, data.num_val={num_val}", 9 * (num_train + num_val) * channels * height * width
    )
    g = torch.Generator().manual_seed(seed)
    shape = (channels, height, width)
    patterns = torch.randint(-40, 41, (num_classes, *shape), generator=g)

    def split(n: int) -> InMemory:
        labels = torch.randint(0, num_classes, (n,), generator=g)
        noise = torch.randint(0, 256, (n, *shape), generator=g)
        return InMemory((noise + patterns[labels]).clamp_(0, 255).to(torch.uint8), labels)

    train, val = split(num_train), split(num_val)
    train.synthetic, train.num_classes = True, num_classes
    return train, val
