"""Data sets, as uint8 images N x C x H x W plus int64 labels, and what the run needs to know
about them (shape, classes, normalisation statistics)."""

from __future__ import annotations

from saturate.data.base import DataInfo, ImageTensors
from saturate.data.digits import load_digits
from saturate.data.synthetic import make_synthetic

__all__ = ["DataInfo", "ImageTensors", "build_datasets"]

_BUILDERS = {"digits": load_digits, "synthetic": make_synthetic}


def build_datasets(cfg) -> tuple[ImageTensors, ImageTensors, DataInfo]:
    """(train, val, info) for the data option `cfg` (a schema from saturate.config)."""
    return _BUILDERS[cfg.name](cfg)
