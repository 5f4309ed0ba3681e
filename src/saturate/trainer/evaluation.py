"""`saturate eval`: a checkpoint's model evaluated on a split, with the engine's own
evaluation (saturate.loop.evaluate.Evaluator) over the batches a run would make from the
same config (build_evaluation, below).

The config comes from conf/ and the command line, composed as for training; the checkpoint
gives the weights only (read as data: torch.load(weights_only=True)). Reading a run dir's
saved config instead (`saved_config`) instantiates the classes it names, which is running
that config: the command does it only when asked by name (--run-saved-config). A saved
config that names a module this saturate does not have (one saved by an older version) is
refused in one line naming it.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
from torch import nn

from saturate import files
from saturate import record as run_record
from saturate.checkpoint.files import load, non_finite
from saturate.components.device import seeded, setup_device
from saturate.components.model import load_weights, make, place
from saturate.components.precision import Precision, setup_precision
from saturate.config.invocation import Invocation
from saturate.config.schema import RunConfig, validate
from saturate.data import Data, DataSpec
from saturate.data.loader import Loaders, Shard, build_loaders
from saturate.errors import ConfigError, Problem, UserError, printable
from saturate.loop.evaluate import Evaluator
from saturate.record import RunRecord
from saturate.scale.distributed import Dist
from saturate.tasks.base import TaskProtocol
from saturate.trainer.build import UserObjects, data_and_task
from saturate.trainer.outcome import class_names

log = logging.getLogger("saturate")
MAX_SAVED = 1 << 20  # a run's saved config is a few KB


def _exists(target: str) -> bool:
    """Whether a dotted name resolves: each part an attribute of the one before, or a module
    under it (saturate's own package: importing it runs nothing of the run dir's)."""
    parts = target.split(".")
    found: Any = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        try:
            found = getattr(found, parts[i])
        except AttributeError:
            try:
                found = importlib.import_module(".".join(parts[: i + 1]))
            except ImportError:
                return False
    return True


def _missing_module(tree: Any) -> str | None:
    """The first `_target_` in `tree` under saturate's own package that this saturate does not
    have (a config saved by another version), if any. A user's own targets are checked as any
    config's are, by validate()."""
    if isinstance(tree, dict):
        target = tree.get("_target_")
        if isinstance(target, str) and target.startswith("saturate."):
            if not _exists(target):
                return target
        children = list(tree.values())
    elif isinstance(tree, list):
        children = tree
    else:
        return None
    return next((target for child in children if (target := _missing_module(child))), None)


def saved_config(run_dir: Path, overrides: list[str], base: DictConfig) -> DictConfig:
    """The config a run dir saved (.hydra/config.yaml), merged into `base` (the schema's
    defaults: conf/ composed without overrides) node by node, then `key=value` overrides on
    top. Keys today's schema no longer has are dropped, named."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        raise UserError(f"--run-saved-config: {run_dir} has no .hydra/config.yaml (is it a run dir of train.py?)")
    saved = OmegaConf.to_container(OmegaConf.create(_saved_text(path)), resolve=False)
    if not isinstance(saved, dict):
        raise UserError(f"--run-saved-config: {path} holds a {type(saved).__name__}, not a run's config (a mapping)")
    missing = _missing_module(saved)
    if missing is not None:
        raise UserError(
            f"--run-saved-config: {path} names {missing}, which this saturate does not have (a config saved by "
            "another version); evaluate without --run-saved-config, giving the overrides the run was trained with"
        )
    saved.pop("run_dir", None)  # the eval's own dir is given by the caller
    cfg = base.copy()
    for key, value in ((str(k), v) for k, v in saved.items()):
        whole = key in ("model", "data", "task") or not isinstance(value, dict)  # a _target_'s keys, not the option's
        for name, item in [(key, value)] if whole else [(f"{key}.{sub}", item) for sub, item in value.items()]:
            try:
                OmegaConf.update(cfg, name, item, merge=False)
            except (ConfigKeyError, ConfigAttributeError):
                log.warning("--run-saved-config: %s is not a key any more; left out", name)
    for override in overrides:
        _override(cfg, override)
    return cfg


def _saved_text(path: Path) -> str:
    """The saved config's text, refused in one line where it is no config train.py saved: not
    a regular file (a FIFO is not waited on), larger than MAX_SAVED, or using YAML anchors and
    aliases (Hydra writes none; expanded, a few lines can take all memory)."""
    with files.open_regular(path, "--run-saved-config") as f:
        data = f.read(MAX_SAVED + 1)
    if len(data) > MAX_SAVED:
        raise UserError(f"--run-saved-config: {path} is larger than {MAX_SAVED >> 20} MB; no run's config is")
    text = data.decode("utf-8", "replace")
    try:
        events = list(yaml.parse(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as e:
        raise UserError(f"--run-saved-config: {path} is not YAML: {' '.join(str(e).split())[:200]}") from None
    if any(isinstance(e, yaml.AliasEvent) or getattr(e, "anchor", None) for e in events):
        raise UserError(f"--run-saved-config: {path} uses YAML anchors or aliases, which no config train.py saved has")
    return text


def _override(cfg: DictConfig, override: str) -> None:
    """`key=value` (or +key=value, ++key=value) set on the saved config: its keys only; a
    group option (model=small_cnn) or a deletion (~key) is refused in one line."""
    name, eq, value = override.partition("=")
    key = name.lstrip("+")
    supported = "--run-saved-config takes key=value (or +key=value) for the saved config's keys"
    if not eq or not key or name.startswith("~"):
        raise UserError(f"{override}: {supported}; not a deletion or a bare key")
    try:
        parsed = yaml.safe_load(value) if value else None
    except yaml.YAMLError as e:
        raise UserError(f"{override}: not a YAML value ({' '.join(str(e).split())[:120]})") from None
    if isinstance(OmegaConf.select(cfg, key), DictConfig) and not isinstance(parsed, dict):
        raise UserError(
            f"{override}: a group option; {supported}: set the group's keys ({key}.<key>=...), or evaluate "
            "without --run-saved-config"
        )
    try:
        OmegaConf.update(cfg, key, parsed, merge=True)
    except OmegaConfBaseException as e:
        raise UserError(f"{override}: {str(e).splitlines()[0]}") from None


def find_checkpoint(given: str) -> Path:
    """A checkpoint file, or a run dir's best.pt (its last.pt when it has none)."""
    path = Path(given).expanduser()
    if path.is_dir():
        for candidate in ("checkpoints/best.pt", "checkpoints/last.pt", "best.pt", "last.pt"):
            if (path / candidate).is_file():
                return path / candidate
        raise UserError(f"{given}: no checkpoints/best.pt or checkpoints/last.pt in this dir")
    if not path.is_file():
        raise UserError(f"{given}: no such checkpoint file or run dir")
    return path


@dataclass
class Evaluation:
    """What evaluating or exporting a checkpoint needs: the data and its batches (never
    augmented), the task, the precision policy, and the model holding the checkpoint's
    weights, on the device, in eval mode."""

    data: Data
    spec: DataSpec
    task: TaskProtocol
    precision: Precision
    model: nn.Module
    loaders: Loaders
    nodes: dict[str, dict]  # the model and task nodes as built (the data's values bound)


def build_evaluation(
    run: RunConfig, invocation: Invocation, device: torch.device, weights: dict, source: str
) -> Evaluation:
    """The parts of a run that evaluation reads, built as build_parts builds them (same data,
    task, precision, model node and loaders: the same batches in the same order), with the
    model's weights from `weights` (a checkpoint's `model`; one of another model is refused
    in one line naming `source`). No optimizer, no batch-size search, no augmentation."""
    data, spec, values, nodes, task = data_and_task(run, invocation, UserObjects(), device)
    precision = setup_precision(run.precision, device)
    raw = make(nodes["model"], values, None)  # pretrained weights are not loaded: the checkpoint's replace them
    load_weights(raw, weights, source, node=nodes["model"])
    model = place(raw, device=device, trainer=run.trainer, dist=Dist(None)).eval()
    if run.loader.batch_size == "auto":
        raise ConfigError([Problem("loader.batch_size", "auto", "the batch size to evaluate with (an integer)")])
    loaders = build_loaders(
        run.loader,
        dataclasses.replace(run.augmentation, placement="none"),
        data,
        spec,
        device=device,
        trainer=run.trainer,
        shard=Shard(run.trainer.seed, 0, 1),
    )
    return Evaluation(data, spec, task, precision, model, loaders, nodes)


@dataclass
class Opened:
    """A checkpoint, and the parts of a run built around its weights."""

    path: Path
    checkpoint: dict
    run: RunConfig
    built: Evaluation


def open_checkpoint(cfg: DictConfig, path: Path, command: str) -> Opened:
    """Check `cfg`, read the checkpoint at `path` as data, and build the data, task and model
    around its weights (a checkpoint of another model: one line)."""
    run = validate(cfg)
    checkpoint = load(path, what=command)
    bad = non_finite(checkpoint["model"]) if isinstance(checkpoint.get("model"), dict) else []
    if bad:  # its outputs are NaN too: the figures or the export checks say nothing about a model
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        print(f"warning: {command}: {printable(path)} holds weights that are NaN or inf: {shown}", file=sys.stderr)
    saved = checkpoint.get("config") or {}
    target = saved.get("model", {}).get("_target_") if isinstance(saved.get("model"), dict) else None
    trained = f" (trained as {target})" if target and target != run.model.get("_target_") else ""
    device = setup_device(run.device)
    with seeded(run.trainer, device):
        built = build_evaluation(run, Invocation(), device, checkpoint["model"], f"{command}: {path}{trained}")
    return Opened(path, checkpoint, run, built)


def evaluate_checkpoint(
    cfg: DictConfig, path: Path, *, split: str = "val", name: str | None = None, out: Path, predict: bool = False
) -> dict[str, float]:
    """The metrics of the checkpoint's model on `split` (val or test), named `name/...`
    (default: the split), written to out/metrics.json (and out/predictions/<name>.npz with
    `predict`) and printed as a table."""
    opened = open_checkpoint(cfg, path, "saturate eval")
    built, name = opened.built, name or split
    batches = {"val": built.loaders.val, "test": built.loaders.test}.get(split)
    if batches is None:
        raise UserError(f"--split {split}: the data ({built.spec.name}) has no {split} split; val or test")
    start = time.perf_counter()
    evaluator = Evaluator(
        batches, built.precision, built.task, interval=1, split=name, class_names=class_names(built.data)
    )
    try:
        metrics = evaluator.run(built.model, predict=predict)
        assert metrics is not None  # None only where an interrupt is watched
        out.mkdir(parents=True, exist_ok=True)
        if predict:
            write_predictions(evaluator, out / "predictions" / f"{name}.npz")
    finally:
        built.loaders.close()
    record = {
        **metrics,
        "checkpoint": str(path.resolve()),
        "epoch": opened.checkpoint.get("epoch"),
        "step": opened.checkpoint.get("step"),
        "split": split,
        "samples": batches.sampler.num_samples,  # in the split
        "batches": len(batches),  # evaluated (trainer.limit_val_batches for val)
        "model": built.nodes["model"].get("_target_"),
        "data": built.spec.name,
        "seconds": time.perf_counter() - start,
    }
    run_record.write(out, RunRecord(record))
    print(table(record, metrics, out))
    return metrics


def write_predictions(evaluator: Evaluator, path: Path) -> None:
    """The predictions written to a temporary file made here (never a link) and renamed onto
    `path`: a link planted at `path`, or in place of its folder, is replaced, not followed."""
    folder = path.parent
    if folder.is_symlink():
        folder.unlink()
    try:
        folder.mkdir(exist_ok=True)
        tmp = files.fresh(path, suffix=".npz")  # np.savez adds .npz to a name without it
    except OSError as e:
        raise UserError(f"cannot write {printable(path)}: {e.strerror or e}") from None
    try:
        evaluator.write_predictions(Path(tmp), Dist(None))
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write {printable(path)}: {e.strerror or e}") from None


def table(record: dict, metrics: dict[str, float], out: Path) -> str:
    """The printed result: what was evaluated, then one row per metric."""
    head = (
        f"saturate eval: {record['checkpoint']} (epoch {record['epoch']}, step {record['step']}) on "
        f"{record['data']} {record['split']} ({record['batches']} batches; {record['samples']} samples in the split), "
        f"{record['seconds']:.1f} s"
    )
    width = max(len(k) for k in metrics)
    rows = [f"  {k:<{width}}  {v:.6g}" for k, v in metrics.items()]
    return "\n".join([head, *rows, f"-> {run_record.path(out)}"])
