"""What an augmentation does (a `Policy`) and the named presets: plain values, no torch, so
that a config can be checked against them before anything heavy is imported. Where and how
a policy runs is saturate.data.augment's business."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    name: str
    hflip: float = 0.0  # probability
    rotation: float = 0.0  # degrees: angle uniform in [-rotation, rotation]
    brightness: float = 0.0  # added offset uniform in [-brightness, brightness]
    contrast: float = 0.0  # factor uniform in [1 - contrast, 1 + contrast]
    translate: float = 0.0  # shift uniform in [-translate, translate] x size (zero fill)
    erasing: float = 0.0  # probability of erasing one rectangle (filled with 0)

    def is_identity(self) -> bool:
        return not any((self.hflip, self.rotation, self.brightness, self.contrast, self.translate, self.erasing))


PRESETS = {
    "minimal": Policy("minimal", hflip=0.5, translate=0.125),
    "standard": Policy("standard", hflip=0.5, rotation=10, brightness=0.2, contrast=0.2, translate=0.125),
    "strong": Policy("strong", hflip=0.5, rotation=20, brightness=0.4, contrast=0.4, translate=0.125, erasing=0.5),
}
POLICY_FIELDS = ("hflip", "rotation", "brightness", "contrast", "translate", "erasing")
