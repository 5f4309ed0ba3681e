"""Image folders: saturate's `data=image_folder` against torchvision's ImageFolder + DataLoader,
measured side by side in one run (the two interleaved, best of the rounds).

    python scripts/bench_image_folder.py --files 20000 --size 64     # JPEGs of 64x64
    python scripts/bench_image_folder.py --files 2000 --size 224     # JPEGs of 500x375, read at 224
    python scripts/bench_image_folder.py --root /data/imagenet/train --size 224
    python scripts/bench_image_folder.py --files 20000 --size 64 --cold   # images/s read from the disk

Prints, for each system: start-up (the data set built: listed, checked, split; saturate's
first start with an empty index cache and its cached start), the peak memory that start-up
added, images/s through a DataLoader (2 workers, batch 128, uint8 batches of size x size),
ratios, and the start-up and memory projected linearly to 1.28 M files (ImageNet).
torchvision rows appear when torchvision is importable (`decode_jpeg`: torchvision.io's
libjpeg-turbo decode and an antialiased resize on the tensor; `PIL`: the default loader).
Each start-up runs in a fresh process, so its peak memory is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMAGENET = 1_281_167

START_SATURATE = """
import json, resource, sys, time
from saturate.data.image_folder import load_image_folder
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
train, val = load_image_folder(
    root=sys.argv[1], image_size=int(sys.argv[2]), channels=3, val_fraction=0.1, split_seed=0, strict=False,
    index_cache=sys.argv[3],
)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
                  "files": len(train) + len(val)}))
"""

START_TORCHVISION = """
import json, resource, sys, time
from torchvision.datasets import ImageFolder
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
data = ImageFolder(sys.argv[1])
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
                  "files": len(data)}))
"""


def make_folder(root: Path, files: int, size: int, classes: int) -> None:
    """JPEG crops of the two photos that ship with scikit-learn: real image content, so
    decoding costs what it costs on photos. 64: 64x64 files; 224: 500x375 files."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(np.asarray(a)) for a in load_sample_images().images]
    width, height = (64, 64) if size == 64 else (500, 375)
    rng = random.Random(0)
    for i in range(files):
        photo = photos[i % len(photos)]
        w, h = rng.randint(photo.width // 3, photo.width), rng.randint(photo.height // 3, photo.height)
        x, y = rng.randint(0, photo.width - w), rng.randint(0, photo.height - h)
        folder = root / f"class_{i % classes:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        photo.crop((x, y, x + w, y + h)).resize((width, height), Image.BILINEAR).save(
            folder / f"{i:07d}.jpg", quality=90
        )


def start_up(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def loaders(root: Path, size: int, workers: int, batch: int, scratch: Path) -> dict:
    """name -> a DataLoader of uint8 (N, 3, size, size) batches. `saturate shards`: the same
    folder converted by saturate make-shards, when wids is installed."""
    from torch.utils.data import DataLoader

    from saturate.data.image_folder import load_image_folder
    from saturate.data.loader import ResumableSampler, already_collated

    with tempfile.TemporaryDirectory() as cache:
        train, _ = load_image_folder(
            root=str(root), image_size=size, channels=3, val_fraction=0.1, split_seed=0, strict=False, index_cache=cache
        )
    common = {"batch_size": batch, "num_workers": workers, "drop_last": True, "persistent_workers": workers > 0}

    def sampled(dataset):  # saturate's own sampler (shards: a few shards shuffled together at a time)
        return ResumableSampler(dataset, batch_size=batch, seed=0, rank=0, world_size=1, keyed=False)

    found = {"saturate": DataLoader(train, collate_fn=already_collated, sampler=sampled(train), **common)}
    try:
        from saturate.data.shards import load_shards

        out = scratch / "shards"
        subprocess.run(
            [sys.executable, "-m", "saturate", "make-shards", str(root), str(out), "--val-fraction", "0.1"],
            capture_output=True,
            check=True,
        )
        shards, _ = load_shards(train=str(out / "train.json"), val=None, image_size=size, channels=3)
        found["saturate shards"] = DataLoader(shards, collate_fn=already_collated, sampler=sampled(shards), **common)
    except Exception as e:  # noqa: BLE001 (wids or webdataset not installed)
        print(f"shards row left out: {type(e).__name__}: {str(e)[:80]}")
    try:
        import torch
        from torchvision.datasets import ImageFolder
        from torchvision.io import ImageReadMode, decode_jpeg, read_file
        from torchvision.transforms import v2
    except Exception as e:  # noqa: BLE001 (not installed, or a build that does not match torch)
        print(f"torchvision rows left out: {type(e).__name__}: {str(e)[:80]}")
        return found
    resize = v2.Resize((size, size), antialias=True)
    common["shuffle"] = True
    found["torchvision decode_jpeg"] = DataLoader(
        ImageFolder(str(root), loader=lambda p: decode_jpeg(read_file(p), mode=ImageReadMode.RGB), transform=resize),
        **common,
    )
    found["torchvision PIL"] = DataLoader(
        ImageFolder(str(root), transform=v2.Compose([v2.PILToTensor(), resize])), **common
    )
    assert torch  # imported for the transforms' tensors
    return found


def evict(root: Path) -> None:
    """Drop the folder's files from the page cache (posix_fadvise DONTNEED on each: no root
    needed), so the next pass reads them from the disk, as the first epoch over a folder
    larger than memory does."""
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def images_per_s(loader, batches: int) -> float:
    it = iter(loader)
    next(it)  # workers started, first batch in
    count, t = 0, time.perf_counter()
    for _ in range(batches):
        x = next(it)[0]
        count += len(x)
    return count / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--root", type=Path, help="an existing folder of class sub-folders (default: made in a temporary folder)"
    )
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--size", type=int, default=64, choices=[64, 224])
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--batches", type=int, default=10, help="timed batches per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cold", action="store_true", help="images/s with the files dropped from the page cache before each pass"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        root = args.root or Path(scratch) / "images"
        if args.root is None:
            t = time.perf_counter()
            make_folder(root, args.files, args.size, args.classes)
            print(
                f"made {args.files} JPEGs ({'64x64' if args.size == 64 else '500x375'}) in {args.classes} classes in "
                f"{time.perf_counter() - t:.0f} s"
            )
        cache = Path(scratch) / "index_cache"
        rows: dict[str, list[dict]] = {}
        for _ in range(args.rounds):  # interleaved: the systems take turns
            rows.setdefault("saturate first", []).append(
                start_up(START_SATURATE, str(root), str(args.size), str(cache / "fresh"))
            )
            rows.setdefault("saturate cached", []).append(
                start_up(START_SATURATE, str(root), str(args.size), str(cache / "kept"))
            )
            try:
                rows.setdefault("torchvision", []).append(start_up(START_TORCHVISION, str(root)))
            except subprocess.CalledProcessError:
                rows.pop("torchvision", None)
            for fresh in (cache / "fresh").glob("*"):
                fresh.unlink()
        if len(rows["saturate cached"]) > 1:
            rows["saturate cached"] = rows["saturate cached"][1:]  # the first of them filled the cache
        best = {name: min(found, key=lambda r: r["seconds"]) for name, found in rows.items()}
        files = best["saturate first"]["files"]
        print(f"\nstart-up, {files} files (best of {args.rounds}; peak memory added by the start-up):")
        tv = best.get("torchvision")
        for name, r in best.items():
            ratio = (
                f"  {r['seconds'] / tv['seconds']:.2f}x torchvision's time, {r['mb'] / max(tv['mb'], 1):.2f}x its "
                "memory"
                if tv
                else ""
            )
            print(f"  {name:18s} {r['seconds']:7.3f} s  {r['mb']:7.1f} MB{ratio}")
        print(f"projected to {IMAGENET:,} files (linear in files):")
        for name, r in best.items():
            print(f"  {name:18s} {r['seconds'] * IMAGENET / files:7.1f} s  {r['mb'] * IMAGENET / files / 1024:6.2f} GB")

        found = loaders(root, args.size, args.workers, args.batch, Path(scratch))
        rates: dict[str, list[float]] = {name: [] for name in found}
        for _ in range(args.rounds):
            for name, loader in found.items():
                if args.cold:
                    evict(root)
                    evict(Path(scratch) / "shards")
                rates[name].append(images_per_s(loader, args.batches))
        where = ", files out of the page cache" if args.cold else ""
        print(
            f"\nimages/s, {args.workers} workers, batch {args.batch}, uint8 {args.size}x{args.size}{where} (best of "
            f"{args.rounds}):"
        )
        for name, r in rates.items():
            others = "".join(
                f", {max(r) / max(o):.2f}x {n}" for n, o in rates.items() if n != name and name.startswith("saturate")
            )
            print(f"  {name:24s} {max(r):8.0f}{others}")


if __name__ == "__main__":
    main()
