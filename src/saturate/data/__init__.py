"""Data sets, as uint8 images (N, C, H, W) with int64 labels, and what the run needs to know
about them (shape, classes, normalisation statistics). Builders are imported when chosen:
scikit-learn and PIL cost start-up time only to the runs that use them."""

from __future__ import annotations

import importlib

from saturate.data.base import DataInfo, ImageTensors

__all__ = ["DataInfo", "ImageTensors", "build_datasets"]

_BUILDERS = {
    "digits": "saturate.data.digits:load_digits",
    "synthetic": "saturate.data.synthetic:make_synthetic",
    "cifar10": "saturate.data.cifar10:load_cifar10",
    "image_folder": "saturate.data.image_folder:load_image_folder",
}


def build_datasets(cfg):
    """(train, val, info) for the data option `cfg` (a schema from saturate.config)."""
    module, name = _BUILDERS[cfg.name].split(":")
    return getattr(importlib.import_module(module), name)(cfg)
