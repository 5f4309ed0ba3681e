"""Data sources: a `data` node with a `_target_` names a callable; its other keys are the
callable's keyword arguments; it returns `(train_dataset, val_dataset)` (val may be None).
The built-in options (conf/data/*.yaml) are callables of the same kind. What the run needs
to know about the datasets is learnt from them (saturate.data.base.describe)."""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

from saturate.data.base import DataSpec, ImageTensors, InMemory, describe, materialize
from saturate.errors import DataError, UserError

__all__ = ["DataSpec", "ImageTensors", "InMemory", "build_datasets", "describe", "materialize"]


def build_datasets(node: Any) -> tuple[Any, Any]:
    """Call the data node's `_target_`; return (train, val). A mistake the callable reports
    (saturate's UserError) keeps its message; any other exception is the callable's bug and
    keeps its traceback."""
    try:
        result = instantiate(node, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, UserError):
            raise cause.with_traceback(None) from None
        raise (cause or e) from None
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise DataError(f"data._target_={node['_target_']}: returned a {type(result).__name__}; expected (train_dataset, val_dataset)")
    return result[0], result[1]
