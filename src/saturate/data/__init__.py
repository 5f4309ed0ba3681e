"""Data: where a run's samples come from (source: the `data` node's contract, `Data`,
`pad_collate`), what saturate learns from one look at them (base: `describe`; spec:
`DataSpec`; samples, checks, image_stats), in-memory sets (in_memory), how they become
batches on the device (loader: samplers, to_device, streaming, resident), augmentation
(policy: plain values; augment: the two placements), and the built-in sources (digits,
cifar10, synthetic, image folders, shards).

Importing this package imports no torch (the augmentation presets are read while a config
is checked): the names below are loaded when first asked for.
"""

from __future__ import annotations

_LAZY = {
    "Data": "saturate.data.source",
    "build_datasets": "saturate.data.source",
    "pad_collate": "saturate.data.source",
    "DataSpec": "saturate.data.spec",
    "ImageTensors": "saturate.data.in_memory",
    "InMemory": "saturate.data.in_memory",
    "describe": "saturate.data.base",
    "materialize": "saturate.data.in_memory",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'saturate.data' has no attribute {name!r}")
