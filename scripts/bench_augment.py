"""Per-sample augmentation in DataLoader workers vs batched augmentation on the device.

    python scripts/bench_augment.py --size 32 --batch 256 --workers 0 1 2
    python scripts/bench_augment.py --size 224 --batch 256 --workers 0 4 8 16 --model resnet18   # on a GPU

Both placements run the same policy (saturate.data.augment). Per-sample rows go through a real
DataLoader (uint8 in, uint8 out, collated, as `augmentation=cpu` runs it); the batched row
copies the uint8 batch to the device and augments it there with Kornia (as
`augmentation=gpu` runs it), timed with a synchronisation per batch. All rows run in this one
process, interleaved over `--rounds`, and each figure is the median round. With `--model`,
one training step of that model at this batch size is timed too, set up as a tuned run
would be (step_ms), to give augmentation's share of the step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from saturate.data.augment import PRESETS, BatchAugment, SampleAugment, Schedule
from saturate.data.base import ImageTensors
from saturate.data.loader import ResumableSampler

PREFETCH = 2  # batches each worker keeps ready (DataLoader's default)


def warmup_batches(workers: int) -> int:
    """Batches taken before timing: the first (worker start-up) and as many as the workers
    hold prefetched by then, so that the timed batches are made while they are timed."""
    return 1 + workers * PREFETCH


def per_sample_ms(data: SampleAugment, batch: int, workers: int, batches: int) -> list[float]:
    """ms per batch over `batches` batches, after the warm-up batches (warmup_batches)."""
    sampler = ResumableSampler(data, batch_size=batch, seed=0, rank=0, world_size=1, keyed=True)
    loader = DataLoader(
        data, batch_size=batch, sampler=sampler, num_workers=workers, prefetch_factor=PREFETCH if workers else None
    )
    it = iter(loader)
    for _ in range(warmup_batches(workers)):
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return [1000 * (time.perf_counter() - start) / batches]


def batched_ms(
    images: torch.Tensor, augment: BatchAugment, device: torch.device, batch: int, batches: int
) -> list[float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    augment(images[:batch].to(device).float().div_(255), 0, 0)  # warm-up: build the pipeline
    sync()
    start = time.perf_counter()
    for b in range(batches):
        i = (b * batch) % (len(images) - batch)
        augment(images[i : i + batch].to(device, non_blocking=True).float().div_(255), 0, b)
    sync()
    return [1000 * (time.perf_counter() - start) / batches]


def step_ms(
    model_name: str, batch: int, size: int, device: torch.device, warmup: int = 3, steps: int = 10
) -> tuple[float, str]:
    """One training step of the model at this batch, set up as a tuned run would be: on a
    GPU bf16 autocast, channels_last, cuDNN autotuning and torch.compile (what
    `experiment=fast` runs), on a CPU channels_last in fp32 (the report's CPU advice; bf16
    is emulated on most CPUs). The device is synchronised at both ends of the timed steps,
    after `warmup` steps (compilation, autotuning). Returns (ms per step, the setting)."""
    from hydra.utils import instantiate

    node = {"_target_": "saturate.models.SmallCNN"}
    # a real ResNet-18 on large images (the CIFAR stem would do 16 times its work at 224x224)
    if model_name == "resnet18":
        node = {"_target_": "saturate.models.ResNet18", "stem": "imagenet" if size >= 128 else "cifar"}
    model = instantiate(node, in_channels=3, num_classes=10)
    model = model.to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)
    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = cuda
    step_model = torch.compile(model) if cuda else model
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = torch.nn.functional.cross_entropy(step_model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    setting = "bf16, channels_last, cudnn.benchmark, compiled" if cuda else "fp32, channels_last, eager"
    setting += ", ImageNet stem" if node.get("stem") == "imagenet" else ""
    return 1000 * (time.perf_counter() - start) / steps, setting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--preset", default="standard", choices=sorted(PRESETS))
    parser.add_argument("--batches", type=int, default=10, help="timed batches per row and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--model",
        choices=["none", "small_cnn", "resnet18"],
        default="none",
        help="also time a training step of this model (resnet18: the ImageNet stem from 128x128 up)",
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file (saturate selftest reads it)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.batches < 2 * PREFETCH * max(args.workers):
        parser.error(
            f"--batches {args.batches}: at least {2 * PREFETCH * max(args.workers)} with {max(args.workers)} workers "
            "(twice what they hold prefetched), or the figure times batches made before the clock started"
        )
    n = max(args.batch * (args.batches + warmup_batches(max(args.workers)) + 1), 2048)
    images = torch.randint(0, 256, (n, 3, args.size, args.size), dtype=torch.uint8)
    # the batched row copies from pinned memory (as loader=resident stages it); the workers read
    # the pageable tensor: forked workers never touch page-locked CUDA host memory
    pinned = images.pin_memory() if device.type == "cuda" else images
    schedule = Schedule([(0, PRESETS[args.preset])])
    data = SampleAugment(ImageTensors(images, torch.zeros(n, dtype=torch.long)), schedule, seed=0)
    augment = BatchAugment(schedule, seed=0)

    rows: dict[str, list[float]] = {f"per-sample, {w} workers": [] for w in args.workers}
    batched_row = f"batched on {device.type}" + (
        f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else f" ({torch.get_num_threads()} threads)"
    )
    rows[batched_row] = []
    for _ in range(args.rounds):  # interleaved: drift on a shared machine hits every row alike
        for w in args.workers:
            rows[f"per-sample, {w} workers"] += per_sample_ms(data, args.batch, w, args.batches)
        rows[batched_row] += batched_ms(pinned, augment, device, args.batch, args.batches)

    medians = {name: statistics.median(ms) for name, ms in rows.items()}
    best_cpu = min(v for k, v in medians.items() if k.startswith("per-sample"))
    machine = f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    rounds = f"median of {args.rounds} rounds x {args.batches} batches"
    print(f"\naugmentation '{args.preset}' on {args.batch} x 3x{args.size}x{args.size}; {machine}; {rounds}\n")
    print(f"| {'placement':<40} | ms/batch | images/s | vs best per-sample |")
    print(f"|{'-' * 42}|---------:|---------:|-------------------:|")
    figures: dict = {
        "device": batched_row,
        "size": args.size,
        "batch": args.batch,
        "batches": args.batches,
        "rounds": args.rounds,
        "rows": {},
    }
    for name, ms in medians.items():
        print(f"| {name:<40} | {ms:8.2f} | {1000 * args.batch / ms:8.0f} | {best_cpu / ms:17.2f}x |")
        figures["rows"][name] = {
            "ms_per_batch": ms,
            "images_per_s": 1000 * args.batch / ms,
            "vs_best_per_sample": best_cpu / ms,
        }
    if args.model != "none":
        step, setting = step_ms(args.model, args.batch, args.size, device)
        aug = medians[batched_row]
        share = 100 * aug / (step + aug)
        print(
            f"\n{args.model} step at batch {args.batch} ({setting}): {step:.1f} ms; batched augmentation {aug:.2f} ms "
            f"= {share:.1f}% of the step"
        )
        figures["step"] = {"model": args.model, "setting": setting, "step_ms": step, "augmentation_share": share / 100}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
