"""Data sources: a `data` node with a `_target_` names a callable; its other keys are the
callable's keyword arguments. It returns `(train_dataset, val_dataset)` (val may be None), or
a mapping (or an object with these attributes) holding

- `train`, and optionally `val` and `test` (a test set is evaluated once, with best.pt, at the end);
- `collate`: the function that makes a batch of samples (padding variable-length ones, see
  `pad_collate`); a training set's own `collate_fn` attribute is used too;
- `target_inverse`: a function taking targets (and predictions) back to their own units, on
  tensors (e.g. a scaler's inverse): regression metrics are then also reported in those units.

The built-in options (conf/data/*.yaml) are callables of the same kind. What the run needs to
know about the datasets is learnt from them (saturate.data.base.describe).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch.utils.data import Dataset

from saturate.errors import DataError, UserError

__all__ = ["Data", "UserCollate", "build_datasets", "pad_collate"]

KEYS = ("train", "val", "test", "collate", "target_inverse")


@dataclass
class Data:
    """What a data callable gives: the splits, and how to batch and read them."""

    train: Dataset
    val: Dataset | None = None
    test: Dataset | None = None
    collate: Callable | None = None
    target_inverse: Callable | None = None

    @classmethod
    def of(cls, result: Any, where: str) -> Data:
        """From a (train, val) pair, a mapping or an object with the KEYS as attributes."""
        if isinstance(result, Data):
            data = result
        elif isinstance(result, (tuple, list)) and len(result) == 2:
            data = cls(result[0], result[1])
        elif isinstance(result, dict):
            unknown = sorted(set(map(str, result)) - set(KEYS))
            if unknown or "train" not in result:
                raise DataError(
                    f"{where}: returned a mapping with keys {sorted(map(str, result))}; expected 'train' and any of "
                    f"{', '.join(KEYS[1:])}"
                )
            data = cls(**result)
        elif hasattr(result, "train"):
            found: dict[str, Any] = {k: getattr(result, k, None) for k in KEYS}
            data = cls(**found)
        else:
            raise DataError(
                f"{where}: returned a {type(result).__name__}; expected (train_dataset, val_dataset) or a mapping "
                f"with {', '.join(KEYS)}"
            )
        if data.collate is None:
            data.collate = getattr(data.train, "collate_fn", None)
        for key in ("collate", "target_inverse"):
            if getattr(data, key) is not None and not callable(getattr(data, key)):
                raise DataError(f"{where}: its {key} is a {type(getattr(data, key)).__name__}, not a function")
        if data.collate is not None and not isinstance(data.collate, UserCollate):
            data.collate = UserCollate(data.collate)
        return data


class UserCollate:
    """The data's own collate: what it raises is one message naming it, in a worker too (its
    own UserError, e.g. pad_collate's, keeps its words)."""

    def __init__(self, fn: Callable):
        self.fn, self.name = fn, getattr(fn, "__qualname__", type(fn).__name__)

    def __call__(self, samples: list) -> Any:
        try:
            return self.fn(samples)
        except UserError:
            raise
        except Exception as e:
            raise DataError(
                f"data: the collate function {self.name} raised {type(e).__name__}: {' '.join(str(e).split())[:300]} "
                f"(batching {len(samples)} samples)"
            ) from e


def build_datasets(node: Any) -> Data:
    """Call the data node's `_target_`. A mistake the callable reports (saturate's UserError)
    keeps its message; any other exception is the callable's bug and keeps its traceback."""
    try:
        result = instantiate(node, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, UserError):
            raise cause.with_traceback(None) from None
        raise (cause or e) from None
    return Data.of(result, f"data._target_={node['_target_']}")


def pad_collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Dict samples of variable length made into one padded batch: each entry stacked, those
    whose first dimension varies padded with 0 to the longest (a (T, F) input to (B, T_max,
    F)); a `<key>_length` entry (B,) is added for each padded one that the samples do not
    give themselves. The collate of saturate's `sequence` task (input, target and their
    lengths), usable for any dict samples."""
    from torch.nn.utils.rnn import pad_sequence

    from saturate.data.samples import as_tensor

    if not samples or not all(isinstance(s, dict) for s in samples):
        raise DataError(
            "pad_collate: expected samples that are dicts (e.g. {'input': (T, F) tensor, 'target': (S,) tensor})"
        )
    batch: dict[str, torch.Tensor] = {}
    for key in samples[0]:
        values = [as_tensor(s[key]) for s in samples]
        varies = values[0].ndim > 0 and len({v.shape[0] for v in values}) > 1
        if varies or (values[0].ndim > 0 and key in ("input", "target")):  # a sequence: padded, its lengths kept
            batch[key] = pad_sequence(values, batch_first=True)
            batch.setdefault(f"{key}_length", torch.tensor([len(v) for v in values]))
        else:
            batch[key] = torch.stack(values)
    for key in samples[0]:  # lengths the samples gave themselves win
        if key.endswith("_length"):
            batch[key] = torch.stack([as_tensor(s[key]) for s in samples])
    return batch
