"""Batches per second of each loader preset on the same data set, side by side.

    python scripts/bench_loader.py [--batch 256] [--size 32] [--samples 10240]

Each preset is built by the same code as `python train.py loader=<preset>` (config composed
from conf/, saturate.data.loader.build_loaders) over a synthetic uint8 data set of 3 x size x size
images, with `loader.batch_size` set to --batch for all; a batch counts once it is on the
training device as the normalised float tensor the model gets. Two reference rows: raw
index_select slicing of a uint8 tensor plus the float conversion, and
`DataLoader(TensorDataset)` over float tensors. Rows are interleaved over --rounds; each
figure is the median round. Worker start-up is outside the timing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch
from hydra import compose, initialize_config_dir
from torch.utils.data import DataLoader, TensorDataset

import saturate
from saturate.config.dirs import CONF
from saturate.config.schema import validate
from saturate.data import build_datasets, describe
from saturate.data.loader import build_loaders

saturate.register()  # the schema and resolvers, before composing conf/
PRESETS = ["default", "fast", "debug", "resident"]


def timed(batches, n: int, take) -> float:
    """Batches per second over n batches of the iterator factory `batches`, after one."""
    it = batches()
    take(next(it))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start, done = time.perf_counter(), 0
    while done < n:
        for batch in it:
            take(batch)
            done += 1
            if done == n:
                break
        it = batches()
    sync()
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=10240)
    parser.add_argument("--batches", type=int, default=80, help="timed batches per row and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data_overrides = [
        "data=synthetic",
        f"data.num_train={args.samples}",
        "data.num_val=256",
        f"data.height={args.size}",
        f"data.width={args.size}",
    ]
    rows: dict[str, callable] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in PRESETS:
            with initialize_config_dir(str(CONF), version_base="1.3"):
                cfg = compose(
                    "config",
                    overrides=[
                        f"loader={preset}",
                        f"loader.batch_size={args.batch}",
                        *data_overrides,
                        f"run_dir={tmp}",
                    ],
                )
            run = validate(cfg)
            data = build_datasets(run.data)
            train_set = data.train
            spec = describe(data.train, data.val, name="synthetic", classes=True)
            loader = build_loaders(run.loader, run.augmentation, data, spec, device=device, trainer=run.trainer).train
            rows[f"loader={preset} ({loader.num_workers} workers)"] = (
                lambda loader=loader: (loader.to_device(b) for b in loader.epoch(0)),
                lambda batch: None,
            )

        images, labels = train_set.images.to(device), train_set.labels.to(device)

        def raw_slices():
            order = torch.randperm(len(images), device=device)
            for b in range(len(images) // args.batch):
                index = order[b * args.batch : (b + 1) * args.batch]
                yield images.index_select(0, index).float(), labels.index_select(0, index)

        reference = DataLoader(
            TensorDataset(train_set.images.float(), train_set.labels),
            batch_size=args.batch,
            shuffle=True,
            drop_last=True,
        )
        rows = {
            "raw index_select + float (reference)": (raw_slices, lambda batch: None),
            "DataLoader(TensorDataset) (reference)": (
                lambda: iter(reference),
                lambda batch: [t.to(device) for t in batch],
            ),
            **rows,
        }
        results: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(args.rounds):
            for name, (batches, take) in rows.items():
                results[name].append(timed(batches, args.batches, take))

    medians = {name: statistics.median(r) for name, r in results.items()}
    base = medians["DataLoader(TensorDataset) (reference)"]
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu, {os.cpu_count()} CPUs"
    print(
        f"\nbatch {args.batch} of 3x{args.size}x{args.size} uint8, {args.samples} samples; device {where} "
        f"({platform.machine()}), torch {torch.__version__}; median of {args.rounds} rounds x {args.batches} batches\n"
    )
    print(f"| {'loader':<40} | batches/s | ms/batch | vs DataLoader(TensorDataset) |")
    print(f"|{'-' * 42}|----------:|---------:|-----------------------------:|")
    for name, rate in medians.items():
        print(f"| {name:<40} | {rate:9.0f} | {1000 / rate:8.3f} | {rate / base:27.2f}x |")


if __name__ == "__main__":
    main()
