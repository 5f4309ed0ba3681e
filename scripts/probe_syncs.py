"""Host synchronisations per batch of the batched (device) augmentation, counted by CUDA's
sync debug mode: the presets' Kornia pipeline and a user's Kornia transforms.

    python scripts/probe_syncs.py --batches 20 --json syncs.json   # on a GPU (saturate selftest runs it)

Some Kornia versions that `kornia>=0.7` allows index the batch with masks made on the host
and copy parameters drawn on the host with blocking copies: each is a synchronisation, the
host waiting for the GPU to drain. torch's sync debug mode warns once per such call; the
warnings are counted over `--batches` batches after a warm-up. Without CUDA it counts
nothing (the mode is CUDA's) and says so.
"""

from __future__ import annotations

import argparse
import json
import warnings
from importlib.metadata import version
from pathlib import Path

import torch

from saturate.data.augment import PRESETS, BatchAugment, Schedule, Transforms


def syncs(augment: BatchAugment, x: torch.Tensor, batches: int) -> int:
    """Synchronisations over `batches` augmented batches (after two untimed ones)."""
    for b in range(2):
        augment(x, 0, b)
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for b in range(batches):
                augment(x, 0, 2 + b)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    import kornia.augmentation as K

    x = torch.rand(args.batch, 3, args.size, args.size, device=args.device)
    pipelines = {
        "presets": BatchAugment(Schedule([(0, PRESETS["strong"])]), seed=0),
        "transforms": BatchAugment(
            Transforms([K.RandomAffine(degrees=15, translate=(0.1, 0.1), p=0.5), K.RandomHorizontalFlip(p=0.5)]), seed=0
        ),
    }
    figures = {
        "kornia": version("kornia"),
        "device": args.device,
        "batches": args.batches,
        "syncs": {name: syncs(augment, x, args.batches) for name, augment in pipelines.items()},
    }
    if args.device != "cuda":
        figures["note"] = "no CUDA: the sync debug mode is CUDA's, nothing was counted"
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
