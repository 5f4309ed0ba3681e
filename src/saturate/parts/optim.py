"""The optimizer (a Hydra `_partial_` node) and its per-step learning-rate schedule."""

from __future__ import annotations

import functools
import logging
import math

import torch
from hydra.utils import instantiate
from torch import nn

from saturate.config.schema import OptimConfig
from saturate.errors import UserError

log = logging.getLogger(__name__)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices and kernels only, not on biases or norm parameters."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base LR after `step` optimizer steps: linear warmup from 0.1, then
    constant or cosine down to `min_ratio` at `total`."""
    if step < warmup:
        return 0.1 + 0.9 * step / warmup
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
    cfg: OptimConfig, model: nn.Module, *, steps_per_epoch: int, total_steps: int, global_batch: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    node = dict(cfg.optimizer)
    weight_decay = node.pop("weight_decay", 0.0)
    if cfg.lr_scaling != "none":
        lr = scaled_lr(cfg, node["lr"], global_batch)
        log.info(
            "optim: lr %g -> %g (%s scaling, global batch %d, base %d)",
            node["lr"],
            lr,
            cfg.lr_scaling,
            global_batch,
            cfg.base_batch_size,
        )
        node["lr"] = lr
    try:
        optimizer = instantiate(node)(param_groups(model, weight_decay))
    except (TypeError, ValueError) as e:  # a bad value, e.g. optim.optimizer.lr=-1
        raise UserError(f"optim.optimizer: cannot build {node['_target_']}: {e}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"optim.optimizer._target_={node['_target_']}: builds a {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer"
        )
    prime_state(optimizer)
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    factor = functools.partial(
        lr_factor, warmup=warmup, total=total_steps, schedule=cfg.schedule, min_ratio=cfg.min_lr_ratio
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
