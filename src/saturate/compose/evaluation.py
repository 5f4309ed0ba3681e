"""`saturate eval`: a checkpoint's model evaluated on a split, with the engine's own
evaluation (saturate.loop.evaluate.Evaluator) over the batches a run would make from the
same config (saturate.compose.build.build_evaluation).

The config comes from conf/ and the command line, composed as for training; the checkpoint
gives the weights only (read as data: torch.load(weights_only=True)). Reading a run dir's
saved config instead (`saved_config`) instantiates the classes it names, which is running
that config: the command does it only when asked by name (--run-saved-config). Configs
saved before the modules moved into folders (issue 33) name the old modules: `moved`
reads them with today's names.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from saturate.compose.build import Evaluation, build_evaluation
from saturate.compose.outcome import class_names
from saturate.config.invocation import Invocation
from saturate.config.schema import RunConfig, validate
from saturate.errors import UserError
from saturate.loop.evaluate import Evaluator
from saturate.parts.checkpoint import load
from saturate.parts.device import seeded, setup_device
from saturate.parts.rundir import write_json
from saturate.scale.distributed import Dist

log = logging.getLogger("saturate")

# Modules that moved when the flat package became folders (git show --stat 443645e): a saved
# config naming one of them is read with today's name.
MOVED = {
    "saturate.parts": "saturate.compose.build",
    "saturate.outcome": "saturate.compose.outcome",
    "saturate.run": "saturate.compose.run",
    "saturate.naming": "saturate.config.naming",
    "saturate.registration": "saturate.config.registration",
    "saturate.config": "saturate.config.schema",
    "saturate.augment": "saturate.data.augment",
    "saturate.loader": "saturate.data.loader",
    "saturate.policy": "saturate.config.policy",
    "saturate.engine": "saturate.loop.engine",
    "saturate.evaluate": "saturate.loop.evaluate",
    "saturate.faults": "saturate.loop.faults",
    "saturate.step": "saturate.loop.step",
    "saturate.costs": "saturate.observe.costs",
    "saturate.doctor": "saturate.observe.doctor",
    "saturate.environment": "saturate.observe.environment",
    "saturate.monitor": "saturate.observe.monitor",
    "saturate.report": "saturate.observe.report",
    "saturate.sweep": "saturate.observe.sweep",
    "saturate.timing": "saturate.observe.timing",
    "saturate.tracking": "saturate.observe.tracking",
    "saturate.batch_size": "saturate.parts.batch_size",
    "saturate.checkpoint": "saturate.parts.checkpoint",
    "saturate.device": "saturate.parts.device",
    "saturate.models.build": "saturate.parts.model",
    "saturate.optim": "saturate.parts.optim",
    "saturate.precision": "saturate.parts.precision",
    "saturate.rundir": "saturate.parts.rundir",
    "saturate.distributed": "saturate.scale.distributed",
    "saturate.launch": "saturate.scale.launch",
    "saturate.ranks": "saturate.scale.ranks",
}


def moved(target: str) -> str:
    """Today's name of a `_target_` that a config saved before the move names (saturate.parts
    and saturate.config are packages now: a name they still hold is today's)."""
    import importlib

    module, _, name = target.rpartition(".")
    if module not in MOVED:
        return target
    try:
        if hasattr(importlib.import_module(module), name):
            return target
    except ImportError:
        pass
    return f"{MOVED[module]}.{name}"


def _renamed(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: (moved(v) if k == "_target_" and isinstance(v, str) else _renamed(v)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_renamed(v) for v in tree]
    return tree


def saved_config(run_dir: Path, overrides: list[str], base: DictConfig) -> DictConfig:
    """The config a run dir saved (.hydra/config.yaml), its old module names read as today's,
    merged into `base` (the schema's defaults: conf/ composed without overrides) node by node,
    then `key=value` overrides on top. Keys today's schema no longer has are dropped, named."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        raise UserError(f"--run-saved-config: {run_dir} has no .hydra/config.yaml (is it a run dir of train.py?)")
    saved = _renamed(OmegaConf.to_container(OmegaConf.load(path), resolve=False))
    saved.pop("run_dir", None)  # the eval's own dir is given by the caller
    cfg = base.copy()
    for key, value in saved.items():
        whole = key in ("model", "data", "task") or not isinstance(value, dict)  # a _target_'s keys, not the option's
        for name, item in [(key, value)] if whole else [(f"{key}.{sub}", item) for sub, item in value.items()]:
            try:
                OmegaConf.update(cfg, name, item, merge=False)
            except (ConfigKeyError, ConfigAttributeError):
                log.warning("--run-saved-config: %s is not a key any more; left out", name)
    for override in overrides:
        name, _, value = override.partition("=")
        OmegaConf.update(cfg, name.lstrip("+"), yaml.safe_load(value) if value else None, merge=True)
    return cfg


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
            evaluator.write_predictions(out / "predictions" / f"{name}.npz", Dist(None))
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
    write_json(out / "metrics.json", record)
    print(table(record, metrics, out))
    return metrics


def table(record: dict, metrics: dict[str, float], out: Path) -> str:
    """The printed result: what was evaluated, then one row per metric."""
    head = (
        f"saturate eval: {record['checkpoint']} (epoch {record['epoch']}, step {record['step']}) on "
        f"{record['data']} {record['split']} ({record['batches']} batches; {record['samples']} samples in the split), "
        f"{record['seconds']:.1f} s"
    )
    width = max(len(k) for k in metrics)
    rows = [f"  {k:<{width}}  {v:.6g}" for k, v in metrics.items()]
    return "\n".join([head, *rows, f"-> {out / 'metrics.json'}"])
