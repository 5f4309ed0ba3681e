"""Resuming: what a checkpoint restores besides the weights and states it holds. The
hyperparameters this run's config changed since the checkpoint's are put back on top of the
saved optimizer and schedule, and where the run resumed is kept as `Resumed`.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from saturate.errors import CheckpointError, is_number

log = logging.getLogger(__name__)


def configured_hyperparameters(stateful: dict[str, Any]) -> dict | None:
    """The optimizer's hyperparameters per group (lr apart) and the schedule's base LRs, as
    the config builds them."""
    optimizer, scheduler = stateful.get("optimizer"), stateful.get("scheduler")
    if optimizer is None or scheduler is None:
        return None
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in optimizer.param_groups]
    return {"groups": copy.deepcopy(groups), "base_lrs": list(scheduler.base_lrs)}


def apply_hyperparameters(optimizer, scheduler, now: dict, then: dict | None, lr_scale: float) -> list[str]:
    """After the saved optimizer and schedule are loaded: put back what this run's config
    changed since the checkpoint's (`then`: its configured hyperparameters; a checkpoint
    written before they were saved: every configured value that differs from the saved
    state) -- a changed lr, momentum, weight decay -- and restart the schedule from the new
    base at the saved step. What a scheduler moves itself (OneCycleLR's momentum, a plateau
    rule's LR) stays as saved. Returns what changed, in words."""
    changed = []
    for i, (group, wanted) in enumerate(zip(optimizer.param_groups, now["groups"], strict=True)):
        before = then["groups"][i] if then and i < len(then["groups"]) else None
        for key, value in wanted.items():
            moved = group.get(key) != value if before is None else before.get(key) != value
            if moved:
                changed.append(f"group {i} {key} {group.get(key)!r} -> {value!r}")
                group[key] = value
    base_lrs = [lr * lr_scale for lr in now["base_lrs"]]  # the config's, as the callbacks had scaled them
    saved = then["base_lrs"] if then else scheduler.base_lrs
    if list(saved) != (base_lrs if then is None else list(now["base_lrs"])):
        pairs = enumerate(zip(scheduler.base_lrs, base_lrs, strict=True))
        changed += [f"group {i} lr {old!r} -> {new!r}" for i, (old, new) in pairs if old != new]
        scheduler.rebase(base_lrs)
    return changed


def checked_lr_scale(value, path) -> float:
    if not is_number(value, 0, math.inf, open_low=True, open_high=True):
        raise CheckpointError(f"trainer.resume: {path}: lr_scale {value!r} is not a number > 0; the file is damaged")
    return float(value)


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    return {k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}{key}.").items()}


@dataclass
class Resumed:
    """Where a resumed run continues (all zero for a fresh start), and what it had."""

    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    lr_scale: float = 1.0  # the callbacks' scaling of the configured learning rate (Run.lr_scale)
    metrics: dict[str, float] = field(default_factory=dict)  # saved with the checkpoint
