"""`saturate export CHECKPOINT [overrides ...]`: a checkpoint to ONNX, a torch.export program and
safetensors, each checked. saturate.cli parses the arguments the checkpoint commands share,
composes the config and answers a mistake in one line; here are export's own flags and the
export."""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import DictConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--to",
        default="onnx,program,safetensors",
        help="comma-separated: onnx, program (torch.export), torchscript, safetensors (default: all but torchscript)",
    )
    p.add_argument("--batches", type=int, default=3, help="validation batches each export is checked on")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest difference from PyTorch allowed")


def check(args: argparse.Namespace) -> None:
    """The flags' values, before any work (one line naming the flag, the value, what is allowed)."""
    import math

    from saturate.errors import UserError
    from saturate.export import FORMATS

    forms = args.to.split(",")
    unknown = [f for f in forms if f not in FORMATS]
    if unknown:
        named = ", ".join(f or "''" for f in unknown)
        raise UserError(f"--to {args.to!r}: {named} is not a form; any of {', '.join(FORMATS)}")
    if len(set(forms)) < len(forms):
        raise UserError(f"--to {args.to!r}: a form named twice; each of {', '.join(FORMATS)} at most once")
    if args.batches < 1:
        raise UserError(f"--batches {args.batches}: expected a number of validation batches, 1 or more")
    if not math.isfinite(args.tolerance) or args.tolerance < 0:
        raise UserError(f"--tolerance {args.tolerance}: expected a finite number, 0 or more (e.g. 1e-4)")


def run_on(cfg: DictConfig, path: Path, args: argparse.Namespace, out: Path) -> int:
    """The checkpoint at `path` exported as `--to` asks, each export checked against PyTorch;
    1 when one of them failed its check."""
    from saturate.export import export_checkpoint

    report = export_checkpoint(
        cfg, path, out=out, to=args.to.split(","), batches=args.batches, tolerance=args.tolerance
    )
    return 0 if report["ok"] else 1
