"""Convert an image folder into WebDataset tar shards that `data=shards` reads.

    saturate make-shards data/images data/shards [--per-shard 1000] [--val-fraction 0.2] [--split-seed 0]
    python train.py data=shards data.train=data/shards/train.json data.val=data/shards/val.json

The folder is read as `data=image_folder` reads it (root/<class>/... or root/train and
root/val; every file checked first, broken ones skipped and named; the same stratified split), so a run on the shards
sees the same training and validation images. Each file's bytes are stored as they are (no
re-encoding) under its extension, its class index under `cls`, in one seeded shuffled order
(so that a shard holds every class), `--per-shard` samples per shard, written with
WebDataset's ShardWriter. `train.json` and `val.json` are wids indexes: the shards and their
sample counts, the class names, and the training images' mean/std.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from saturate import names


def write_split(name: str, dataset, out: Path, per_shard: int, seed: int, extra: dict) -> int:
    import webdataset as wds

    order = list(range(len(dataset)))
    random.Random(seed).shuffle(order)
    pattern = str(out / f"{name}-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
        for n, i in enumerate(order):
            path = Path(dataset.path(i))
            suffix = path.suffix.lower().lstrip(".") or "img"
            sink.write({"__key__": f"{n:09d}", suffix: path.read_bytes(), "cls": str(int(dataset.labels[i])).encode()})
    shards = sorted(out.glob(f"{name}-*.tar"))
    counts = [min(per_shard, len(order) - k * per_shard) for k in range(len(shards))]
    index = {
        "wids_version": 1,
        "name": name,
        "shardlist": [{"url": s.name, "nsamples": c} for s, c in zip(shards, counts, strict=True)],
        **extra,
    }
    (out / f"{name}.json").write_text(json.dumps(index, indent=1))
    return len(shards)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="saturate make-shards", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--val-fraction", type=float, default=0.2)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--channels", type=int, default=3, choices=[1, 3])
    parser.add_argument(
        "--stats-size", type=int, default=64, help="image size at which the training images' mean/std are taken"
    )
    args = parser.parse_args(argv)

    from saturate.data.image_folder import load_image_folder
    from saturate.errors import UserError

    try:
        train, val = load_image_folder(
            root=str(args.folder),
            image_size=args.stats_size,
            channels=args.channels,
            val_fraction=args.val_fraction,
            split_seed=args.split_seed,
            strict=False,
            check=True,
        )
    except UserError as e:
        print(f"make_shards: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if args.out.exists() and any(args.out.glob("*.tar")):
        print(f"make_shards: {args.out} already holds shards; give an empty or new folder", file=sys.stderr)
        raise SystemExit(1)
    args.out.mkdir(parents=True, exist_ok=True)
    extra = {"classes": train.classes, "mean": list(train.mean), "std": list(train.std)}
    n_train = write_split("train", train, args.out, args.per_shard, args.split_seed, extra)
    n_val = write_split("val", val, args.out, args.per_shard, args.split_seed, extra)
    print(
        f"wrote {len(train)} training samples in {n_train} shards and {len(val)} validation samples in {n_val} shards "
        f"({train.notes[names.SKIPPED_FILES]} broken files skipped) under {args.out}; train with: python train.py "
        f"data=shards data.train={args.out / 'train.json'} data.val={args.out / 'val.json'}"
    )
