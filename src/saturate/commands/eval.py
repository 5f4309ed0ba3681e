"""`saturate eval CHECKPOINT [overrides ...]`: a checkpoint evaluated on the val or test split.
saturate.cli parses the arguments the checkpoint commands share, composes the config and
answers a mistake in one line; here are eval's own flags and the evaluation."""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import DictConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--split", choices=["val", "test"], default="val", help="the data's split to evaluate")
    p.add_argument("--name", default=None, help="the metrics' prefix (a new test set: name/acc); default: split")
    p.add_argument("--predict", action="store_true", help="also write predictions/<name>.npz (numpy.load)")


def check(args: argparse.Namespace) -> None:
    """The flags' values, before any work: --name becomes a file name, so it is a plain name."""
    from saturate.commands.after_run import plain_name

    if args.name is not None:
        plain_name("--name", args.name)


def run_on(cfg: DictConfig, path: Path, args: argparse.Namespace, out: Path) -> int:
    """The checkpoint at `path` evaluated with `cfg`; its metrics (and predictions) in `out`."""
    from saturate.trainer.evaluation import evaluate_checkpoint

    evaluate_checkpoint(cfg, path, split=args.split, name=args.name, out=out, predict=args.predict)
    return 0
