from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset


@dataclass
class DataInfo:
    name: str
    channels: int
    height: int
    width: int
    num_classes: int
    mean: tuple[float, ...]  # per channel, of the training images scaled to [0, 1]
    std: tuple[float, ...]
    synthetic: bool = False  # shown wherever results are reported
    notes: dict = field(default_factory=dict)  # counts worth reporting (e.g. skipped files)


def channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images (N, C, H, W), in [0, 1] units."""
    x = images.to(torch.float64).div_(255).transpose(0, 1).flatten(1)
    return tuple(x.mean(1).tolist()), tuple(x.std(1).clamp_min(1e-3).tolist())


class ImageTensors(Dataset):
    """Images held in memory as one uint8 tensor (N, C, H, W), with int64 labels (N,)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        assert images.dtype == torch.uint8 and images.ndim == 4 and len(images) == len(labels)
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch in one gather; the DataLoader calls this instead of __getitem__ per
        sample (and then collates nothing: see saturate.loader.StreamLoader)."""
        index = torch.tensor(indices)
        return self.images.index_select(0, index), self.labels.index_select(0, index)
