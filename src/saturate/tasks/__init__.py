"""Tasks: how a batch becomes a loss and metric updates (the protocol: saturate.tasks.base).

The built-in ones are the `task` group's options, each a small file: `classification`,
`regression` and `sequence` (per-timestep or CTC targets with lengths). A user's task is a
`_target_` in their own config dir's `task/` (or an object given to `saturate.fit`).
Importing this package imports no torch: the classes are loaded when first asked for.
"""

from __future__ import annotations

BUILT_IN = {
    "classification": "saturate.tasks.classification.Classification",
    "regression": "saturate.tasks.regression.Regression",
    "sequence": "saturate.tasks.sequence.Sequence",
    "segmentation": "saturate.tasks.segmentation.Segmentation",
}

__all__ = ["BUILT_IN", "Classification", "Regression", "Segmentation", "Sequence", "Task"]


def __getattr__(name: str):
    if name in ("Classification", "Regression", "Segmentation", "Sequence"):
        import importlib

        module, _, cls = BUILT_IN[name.lower()].rpartition(".")
        return getattr(importlib.import_module(module), cls)
    if name == "Task":
        from saturate.tasks.base import Task

        return Task
    raise AttributeError(f"module 'saturate.tasks' has no attribute {name!r}")
