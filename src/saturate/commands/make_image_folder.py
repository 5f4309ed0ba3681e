"""Write scikit-learn's digits as an image folder (one sub-folder per class), to try the
image-decoding path of `data=image_folder` on real images.

    saturate make-image-folder data/digits_png [--size 32] [--format png|jpg] [--corrupt 2]

`--corrupt N` also writes N broken files (a truncated image and a text file named like an
image, alternately) to see how they are skipped and reported.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits


def write_digits(out: Path, size: int = 32, fmt: str = "png", corrupt: int = 0, per_class: int | None = None) -> int:
    x, y = load_digits(return_X_y=True)
    if per_class is not None:  # the first `per_class` images of each digit
        keep = np.concatenate([np.flatnonzero(y == label)[:per_class] for label in range(10)])
        x, y = x[np.sort(keep)], y[np.sort(keep)]
    for i, (pixels, label) in enumerate(zip(x, y, strict=True)):
        img = Image.fromarray(np.rint(pixels.reshape(8, 8) * 255 / 16).astype(np.uint8), mode="L").convert("RGB")
        folder = out / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        img.resize((size, size), Image.Resampling.NEAREST).save(folder / f"{i:04d}.{fmt}")
    for j in range(corrupt):
        folder = out / str(j % 10)
        if j % 2 == 0:
            good = next(folder.glob(f"*.{fmt}")).read_bytes()
            (folder / f"broken_{j}.{fmt}").write_bytes(good[: len(good) // 3])
        else:
            (folder / f"notes_{j}.{fmt}").write_text("not an image\n")
    return len(y)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="saturate make-image-folder", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--format", default="png", choices=["png", "jpg"])
    parser.add_argument("--corrupt", type=int, default=0)
    parser.add_argument("--per-class", type=int, default=None, help="only the first N images of each digit")
    args = parser.parse_args(argv)
    n = write_digits(args.out, args.size, args.format, args.corrupt, args.per_class)
    print(f"wrote {n} images ({args.format}, {args.size}x{args.size}) and {args.corrupt} broken files under {args.out}")
