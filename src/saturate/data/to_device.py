"""Host batch -> device batch: the copy, and for images the augmentation (when it runs on the
device), the normalisation and the memory layout, decided once when the loader is built."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from saturate.config.schema import AugmentationConfig, LoaderConfig, TrainerConfig
from saturate.data.augment import BatchAugment, Schedule
from saturate.data.spec import DataSpec

# what the collate makes: (inputs, targets), a dict, nested; uint8 or float images (B, C, H, W) among them
HostBatch = object


def move(batch, device: torch.device, non_blocking: bool, keep: tuple[str, ...] = ()):
    """Every tensor of a batch (any structure: torch's pytree) on `device`, but a dict's
    entries named in `keep` (what the task reads on the host: CTC's lengths, which PyTorch's
    loss would otherwise copy back with a blocking copy); float64 becomes float32, the
    model's dtype. Host tensors are pinned by the loader on CUDA, so the copies run
    asynchronously."""

    def to(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.to(device, dtype=torch.float32 if leaf.dtype == torch.float64 else None, non_blocking=non_blocking)

    if keep and isinstance(batch, dict):
        return {k: v if k in keep else tree_map(to, v) for k, v in batch.items()}
    return tree_map(to, batch)


class PlainPipeline:
    """Host batch -> device batch, values unchanged: inputs that are not images reach the
    model as the dataset gave them (float64 becomes float32, the model's dtype); the task
    casts the targets it reads."""

    def __init__(self, device: torch.device, *, non_blocking: bool, keep: tuple[str, ...] = ()):
        self.device, self.non_blocking, self.keep = device, non_blocking, keep

    def begin_epoch(self, epoch: int, start: int) -> None:
        pass

    def __call__(self, batch):
        return move(batch, self.device, self.non_blocking, self.keep)


class DevicePipeline:
    """Host image batch -> the model's batch on the device: the whole batch copied, then its
    image entry (`entry`: 0 of a pair, the input key of a dict) augmented there (when
    augmentation runs on the device), normalised with `mean`/`std` ([0, 1] units) when they
    are given (uint8 images always; float images in [0, 1] when the data gives them, else
    left as they are) and laid out as channels_last if asked.

    `preview(x, epoch)`, if given, sees the images the model gets before normalisation
    (uint8, or floats in [0, 1]) and decides when to record them.
    """

    def __init__(
        self,
        device: torch.device,
        mean,
        std,
        *,
        non_blocking: bool,
        channels_last: bool,
        augment=None,
        preview=None,
        entry=0,
        normalise: bool = True,
        mask_entry=None,
        keep: tuple[str, ...] = (),
    ):
        self.device, self.non_blocking, self.augment, self.preview = device, non_blocking, augment, preview
        self.entry, self.normalise, self.mask_entry, self.keep = entry, normalise, mask_entry, keep
        if normalise:
            std = torch.tensor(std, device=device).view(1, -1, 1, 1)
            # (x - mean) / std
            self.scale, self.shift = (
                1 / std,
                -torch.tensor(mean, device=device).view(1, -1, 1, 1) / std,
            )
            self.scale_u8 = self.scale / 255  # the same, straight from uint8 when nothing runs in between
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.epoch = self.batch = 0

    def begin_epoch(self, epoch: int, start: int) -> None:
        self.epoch, self.batch = epoch, start

    def __call__(self, batch):
        batch = move(batch, self.device, self.non_blocking, self.keep)
        x = batch[self.entry]
        uint8 = x.dtype == torch.uint8
        if self.augment is None:
            if self.preview is not None:
                self.preview(x, self.epoch)
            if self.normalise and uint8:
                x = x.float().mul_(self.scale_u8).add_(self.shift)
            elif self.normalise:  # a new tensor: a float batch may be the host's own (on the CPU, `move` keeps it)
                x = torch.addcmul(self.shift, x, self.scale)
        else:
            x = x.float().div_(255) if uint8 else x.float()
            if self.mask_entry is None:
                x = self.augment(x, self.epoch, self.batch)
            else:  # the targets are masks of the images: moved with them
                x, masks = self.augment(x, self.epoch, self.batch, batch[self.mask_entry])
                batch = _replace(batch, self.mask_entry, masks)
            if self.preview is not None:
                self.preview(x, self.epoch)
            if self.normalise:  # an augmentation may give back its input: a float batch is not changed in place
                x = x.mul_(self.scale).add_(self.shift) if uint8 else torch.addcmul(self.shift, x, self.scale)
        self.batch += 1
        return _replace(batch, self.entry, x.contiguous(memory_format=self.memory_format))


def _replace(batch, entry, value):
    """`batch` with `entry` (a pair's index, a dict's key) replaced by `value`."""
    if isinstance(batch, dict):
        return {**batch, entry: value}
    parts = list(batch)
    parts[entry] = value
    return type(batch)(parts) if isinstance(batch, tuple) else parts


def build_pipeline(
    cfg: LoaderConfig, spec: DataSpec, device: torch.device, trainer: TrainerConfig, augment=None, preview=None
) -> DevicePipeline | PlainPipeline:
    """Images: augmented and normalised on the device (with the data's statistics: spec.mean
    and spec.std, which float images without mean/std lack); anything else: unchanged."""
    if not spec.image:
        return PlainPipeline(device, non_blocking=cfg.non_blocking, keep=spec.host_keys)
    return DevicePipeline(
        device,
        spec.mean,
        spec.std,
        non_blocking=cfg.non_blocking,
        channels_last=trainer.channels_last,
        augment=augment,
        preview=preview,
        entry=spec.image_entry,
        normalise=spec.mean is not None,
        mask_entry=spec.target_entry if augment is not None and spec.mask_target else None,
        keep=spec.host_keys,
    )


def device_augment(aug: AugmentationConfig, seed: int, transforms=None) -> BatchAugment | None:
    """The batched (device) placement of the augmentation policy (or the user's transforms), or None."""
    if aug.placement != "gpu":
        return None
    return BatchAugment(transforms or Schedule.from_config(aug), seed=seed)
