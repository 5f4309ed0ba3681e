"""The optimizer (a Hydra `_partial_` node), its parameter groups, and the learning-rate
schedule (saturate.components.schedule)."""

from __future__ import annotations

import fnmatch
import functools
import logging
import math
from collections.abc import Sequence

import torch
from hydra.utils import instantiate
from torch import nn

from saturate.components.schedule import Schedule, is_scheduler
from saturate.config.schema import OptimConfig
from saturate.errors import ConfigError, Problem, UserError

log = logging.getLogger(__name__)


def _split_decay(params: list[tuple[str, nn.Parameter]], weight_decay: float, extra: dict) -> list[dict]:
    """Weight decay on weight matrices and kernels only, not on biases or norm parameters."""
    decay = [p for _, p in params if p.ndim > 1]
    no_decay = [p for _, p in params if p.ndim <= 1]
    groups = [
        {"params": decay, "weight_decay": weight_decay, **extra},
        {"params": no_decay, "weight_decay": 0.0, **extra},
    ]
    return [g for g in groups if g["params"]]


def param_groups(model: nn.Module, weight_decay: float, configured: Sequence[dict] = ()) -> list[dict]:
    """The optimizer's parameter groups: each configured group (`params`: a name pattern or a
    list of them, as fnmatch reads them; its other keys: that group's hyperparameters) takes
    the trainable parameters it matches first, the rest form the default groups. A group that
    does not set `weight_decay` leaves its norms and biases undecayed. Frozen parameters
    (requires_grad false) are in no group: they get no optimizer state."""
    remaining = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups: list[dict] = []
    owner: dict[str, int] = {}  # each parameter's group, by name
    for i, spec in enumerate(configured):
        patterns = [spec["params"]] if isinstance(spec["params"], str) else list(spec["params"])
        taken = [(n, p) for n, p in remaining if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]
        if not taken:
            raise ConfigError([_matches_nothing(model, i, spec["params"], patterns, owner)])
        owner.update((n, i) for n, _ in taken)
        ids = {id(p) for _, p in taken}
        remaining = [(n, p) for n, p in remaining if id(p) not in ids]
        extra = {k: v for k, v in spec.items() if k != "params"}
        if "weight_decay" in extra:
            groups.append({"params": [p for _, p in taken], **extra})
        else:
            groups += _split_decay(taken, weight_decay, extra)
    return groups + _split_decay(remaining, weight_decay, {})


def _matches_nothing(model: nn.Module, i: int, given, patterns: list[str], owner: dict[str, int]) -> Problem:
    """Why group `i` got no parameters: earlier groups took those its patterns match (a
    parameter is in the first group that matches it), they are frozen, or none is named so."""
    matched = [n for n, _ in model.named_parameters() if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]
    earlier = sorted({owner[n] for n in matched if n in owner})
    key = f"optim.param_groups[{i}].params"
    if earlier:
        took = ", ".join(f"optim.param_groups[{j}]" for j in earlier)
        allowed = (
            f"a pattern matching parameters no earlier group takes: {took} took them (each parameter is in the "
            "first group that matches it; put the narrower pattern first)"
        )
        return Problem(key, given, allowed)
    if matched:
        return Problem(
            key, given, f"a pattern matching trainable parameters: those it matches are frozen ({matched[0]})"
        )
    names = ", ".join(n for n, _ in model.named_parameters())
    shown = names if len(names) < 300 else names[:300] + " ..."
    return Problem(key, given, f"a pattern matching some of {type(model).__name__}'s trainable parameters ({shown})")


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float, start: float = 0.1) -> float:
    """Multiplier of the base LR after `step` optimizer steps: a linear warm-up from `start`
    over `warmup` steps, then constant, or a cosine down to `min_ratio` at step `total` and
    `min_ratio` after it."""
    if step < warmup:
        return start + (1 - start) * step / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def scaled_lr(cfg: OptimConfig, lr: float, global_batch: int) -> float:
    """The base LR scaled for the global batch size: linear (lr x k) or sqrt (lr x sqrt k,
    seed 001's rule: 4x the batch, 2x the LR), k = global_batch / base_batch_size."""
    exponent = {"none": 0.0, "linear": 1.0, "sqrt": 0.5}[cfg.lr_scaling]
    return lr * (global_batch / cfg.base_batch_size) ** exponent


def prime_state(optimizer: torch.optim.Optimizer) -> None:
    """Give state that a skipped first step would leave uninitialised its value now.

    torch's fused SGD makes its momentum buffers with `empty_like` at its first step and
    copies the gradient in; told `found_inf` (a non-finite step skipped on the device, or
    fp16's first-step overflow through GradScaler) it writes nothing, and the next step
    reads uninitialised memory (NaN in deterministic mode, anything otherwise). A zero buffer
    gives the same first update, bit for bit: momentum x 0 + (1 - dampening) x grad, the
    gradient itself with the default dampening of 0 (with dampening d, (1 - d) x grad
    instead of the gradient, as on every later step). torch's Adam and AdamW (fused or not)
    start from zeros and take back their step count when skipped: nothing to do there
    (tests/loop/test_faults.py checks all three)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if not group.get("fused") or group["momentum"] == 0:
            continue
        for p in group["params"]:
            if p.requires_grad and "momentum_buffer" not in optimizer.state[p]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def setup_optimizer(
    cfg: OptimConfig, model: nn.Module, *, steps_per_epoch: int, total_steps: int, global_batch: int, monitor=None
) -> tuple[torch.optim.Optimizer, Schedule]:
    """The optimizer over the model's parameter groups and its schedule. `monitor`: (the
    metric, its direction) a ReduceLROnPlateau scheduler reads."""
    node = dict(cfg.optimizer)
    weight_decay = node.pop("weight_decay", 0.0)
    scale = scaled_lr(cfg, 1.0, global_batch)
    if cfg.lr_scaling != "none":
        log.info(
            "optim: lr x %g (%s scaling, global batch %d, base %d)",
            scale,
            cfg.lr_scaling,
            global_batch,
            cfg.base_batch_size,
        )
        node["lr"] = node["lr"] * scale
    groups = [{**g, "lr": g["lr"] * scale} if "lr" in g else g for g in map(dict, cfg.param_groups)]
    try:
        optimizer = instantiate(node)(param_groups(model, weight_decay, groups))
    except (TypeError, ValueError) as e:  # a bad value, e.g. optim.optimizer.lr=-1
        raise UserError(f"optim.optimizer: cannot build {node['_target_']}: {e}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"optim.optimizer._target_={node['_target_']}: builds a {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer"
        )
    prime_state(optimizer)
    warmup = warmup_steps(cfg, steps_per_epoch=steps_per_epoch, total_steps=total_steps)
    if cfg.scheduler is None:
        factor = functools.partial(
            lr_factor,
            warmup=warmup,
            total=total_steps if cfg.decay_steps is None else cfg.decay_steps,
            schedule=cfg.schedule,
            min_ratio=cfg.min_lr_ratio,
            start=cfg.warmup_start_factor,
        )
        return optimizer, Schedule(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor))
    inner = _scheduler(cfg.scheduler, optimizer, monitor)
    planned = total_steps if cfg.scheduler_interval == "step" else math.ceil(total_steps / max(1, steps_per_epoch))
    _check_cycle(inner, dict(cfg.scheduler), planned, cfg.scheduler_interval)
    name = monitor[0] if monitor else None
    return optimizer, Schedule(
        optimizer,
        inner,
        interval=cfg.scheduler_interval,
        warmup_steps=warmup,
        warmup_start=cfg.warmup_start_factor,
        monitor=name,
    )


def warmup_steps(cfg: OptimConfig, *, steps_per_epoch: int, total_steps: int) -> int:
    """The warm-up's length in optimizer steps: optim.warmup_steps, else optim.warmup_epochs
    (1 when unset) x the epoch's steps; a length in steps is at most the run's, and the
    cosine's end (optim.decay_steps) comes after it."""
    if cfg.warmup_steps is not None:
        warmup = cfg.warmup_steps
        if warmup > total_steps:
            allowed = (
                f"at most the run's {total_steps} optimizer steps (trainer.max_steps, or trainer.max_epochs x "
                f"{steps_per_epoch} steps per epoch)"
            )
            raise ConfigError([Problem("optim.warmup_steps", warmup, allowed)])
    else:
        epochs = 1.0 if cfg.warmup_epochs is None else cfg.warmup_epochs
        warmup = round(epochs * steps_per_epoch)
        if cfg.decay_steps is not None and cfg.decay_steps <= warmup:
            allowed = (
                f"an optimizer step after the warm-up's {warmup} (optim.warmup_epochs={epochs:g}"
                f"{' by default' if cfg.warmup_epochs is None else ''} x {steps_per_epoch} steps per epoch; "
                "optim.warmup_steps sets it in steps)"
            )
            raise ConfigError([Problem("optim.decay_steps", cfg.decay_steps, allowed)])
    return warmup


def _check_cycle(inner, node: dict, planned: int, interval: str) -> None:
    """A schedule of a fixed length (OneCycleLR's total_steps) covers the run's scheduler steps:
    torch raises at the step past its end, in the middle of the run."""
    length = getattr(inner, "total_steps", None)
    if not isinstance(inner, torch.optim.lr_scheduler.OneCycleLR) or not isinstance(length, int) or length >= planned:
        return
    per = "one per optimizer step" if interval == "step" else "one per epoch"
    key = "total_steps" if "total_steps" in node else "epochs"
    allowed = (
        f"at least the run's {planned} scheduler steps ({per}, optim.scheduler_interval={interval}); "
        f"OneCycleLR raises past its total_steps ({length})"
    )
    raise ConfigError([Problem(f"optim.scheduler.{key}", node.get(key, length), allowed)])


def _scheduler(node: dict, optimizer, monitor):
    """optim.scheduler built on the optimizer; a ReduceLROnPlateau watches the run's monitored
    metric in its direction (its own `mode`, if set, must agree)."""
    node = dict(node)
    target = node["_target_"]
    if str(target).endswith("ReduceLROnPlateau") and monitor is not None:
        metric, direction = monitor
        if node.get("mode", direction) != direction:
            allowed = f"{direction} or unset: it watches {metric} (checkpoint.monitor), where {direction} is better"
            raise ConfigError([Problem("optim.scheduler.mode", node["mode"], allowed)])
        node["mode"] = direction
    try:
        inner = instantiate(node)(optimizer) if node.get("_partial_") else instantiate(node, optimizer=optimizer)
    except Exception as e:  # noqa: BLE001 (the user's node: one line)
        cause = e.__cause__ or e
        raise UserError(f"optim.scheduler: cannot build {target}: {' '.join(str(cause).split())[:300]}") from None
    if not is_scheduler(inner):
        allowed = "a torch.optim.lr_scheduler class (a `_partial_: true` node, called with the optimizer)"
        raise ConfigError([Problem("optim.scheduler._target_", target, allowed)])
    return inner
