from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from saturate.data.in_memory import InMemory
from saturate.errors import DataError

FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def find_batches(root: Path) -> Path | None:
    """The folder holding the python batches: `root` itself or root/cifar-10-batches-py."""
    for folder in (root, root / "cifar-10-batches-py"):
        if all((folder / name).is_file() for name in FILES):
            return folder
    return None


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles what CIFAR-10's python batches hold (dicts, lists, strings, numbers and
    numpy uint8 arrays) and nothing else: a pickle naming any other global (os.system, ...)
    is refused before it can run."""

    # _codecs.encode: how protocol 2 writes bytes
    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refused to load {module}.{name}: CIFAR-10 batches hold only arrays, lists and numbers"
        )


def _read(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = _BatchUnpickler(f, encoding="latin1").load()
        return np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32), np.asarray(
            batch["labels"], dtype=np.int64
        )
    except Exception as e:  # noqa: BLE001 (any failure to unpickle it: not a CIFAR-10 batch)
        raise DataError(f"data.root: {path} is not a CIFAR-10 python batch ({type(e).__name__}: {e})") from None


def load_cifar10(*, root: str) -> tuple[InMemory, InMemory]:
    """CIFAR-10 from the standard python-pickle batches under `data.root` (never downloaded):
    the 50,000 training images for training, the 10,000 test images for validation."""
    path = Path(root).expanduser()
    folder = find_batches(path)
    if folder is None:
        raise DataError(
            f"data.root={str(path)!r}: no CIFAR-10 python batches there (looked for {', '.join(FILES)} in {path} and "
            f"{path / 'cifar-10-batches-py'}). Download cifar-10-python.tar.gz from "
            "https://www.cs.toronto.edu/~kriz/cifar.html, extract it, and pass data.root=<the extracted folder>; "
            "saturate downloads nothing."
        )
    parts = [_read(folder / name) for name in FILES[:5]]
    train = InMemory(
        torch.from_numpy(np.concatenate([x for x, _ in parts])), torch.from_numpy(np.concatenate([y for _, y in parts]))
    )
    x, y = _read(folder / "test_batch")
    train.num_classes = 10
    return train, InMemory(torch.from_numpy(x), torch.from_numpy(y))
