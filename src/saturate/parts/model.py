"""The model of a run: built from its node (or given, or made by a factory), checked on real
samples, placed on the device, maybe converted to SyncBatchNorm, wrapped in DDP and compiled.

The data-derived arguments a constructor names (and its node does not set) are filled in
(saturate.config.data_info): `in_channels` (the input's first dimension: C of (C, H, W)),
`in_features` (its last: F of (T, F)), `input_shape`, `num_classes`, `num_outputs`, ...
Any other name takes a value from the data by interpolation in the node
(`input_size: ${data_info:in_features}`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import get_method
from torch import nn

from saturate.config.data_info import arguments
from saturate.config.instantiate import build
from saturate.errors import DataError, UserError

log = logging.getLogger(__name__)


@dataclass
class Models:
    train: nn.Module  # what the loop calls: DDP-wrapped and/or compiled
    eval: nn.Module  # what the evaluator calls: never DDP (ranks evaluate different numbers of batches), never compiled
    raw: nn.Module  # the plain module: optimizer, checkpoints


def make(node: dict | None, values: dict[str, Any], given: nn.Module | Callable | None) -> nn.Module:
    """The model: built from its node with the data-derived arguments it names; or the one
    passed in; or built by the factory passed in (called now, after seeding, with the
    data-derived arguments it names)."""
    if isinstance(given, nn.Module):
        log.info(
            "model: given as an object: its initial weights were drawn before trainer.seed was applied; pass a "
            "factory (saturate.fit(lambda: Model(...), ...)) to have them seeded"
        )
        return given
    if given is not None:
        raw = given(**arguments(given, {}, values))
    else:
        raw = build(node, "model", **arguments(get_method(node["_target_"]), node, values))
    if not isinstance(raw, nn.Module):
        raise UserError(f"model: {type(raw).__name__} is not a torch.nn.Module")
    return raw


def check(model: nn.Module, batch, task, precision, spec) -> None:
    """Two real samples through the task's forward (eval mode: nothing moves), so a model
    that does not fit the data fails now, with the shapes, not in the first step; the loss
    must be one number with a gradient, and something must be trainable."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not trainable:
        count = sum(p.numel() for p in model.parameters())
        why = f"none of its {count} parameters requires a gradient (all frozen)" if count else "it has no parameters"
        raise UserError(f"model: {type(model).__name__} cannot be trained: {why}")
    was_training = model.training
    model.eval()
    try:
        with precision.autocast():
            loss, _ = task.forward(model, batch)
    except RuntimeError as e:  # torch's shape and dtype mismatches; anything else is a bug, with its traceback
        raise UserError(
            f"model: {type(model).__name__} does not fit the data ({spec.describe()}) and task {task.name}: "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        ) from None
    finally:
        model.train(was_training)
    check_loss(loss, task)
    check_finite(loss, batch, task)


def check_loss(loss, task) -> None:
    """A loss is one number with a gradient: a vector, a Python float or a detached value
    would fail (or silently not train) at step 1."""
    fn = getattr(task, "loss_fn", None)
    what = f"task.loss: {getattr(fn, '__name__', type(fn).__name__)}" if fn is not None else f"task {task.name}'s loss"
    if not isinstance(loss, torch.Tensor):
        raise UserError(
            f"{what} returns a {type(loss).__name__}, not a tensor; compute it from the model's outputs with torch "
            "operations, so that it has a gradient"
        )
    if loss.numel() != 1 or not loss.is_floating_point():
        raise UserError(
            f"{what} returns a {str(loss.dtype).removeprefix('torch.')} tensor of shape {tuple(loss.shape)} for a "
            "batch of 2; a loss is one number: reduce it (.mean() or .sum())"
        )
    if not loss.requires_grad:
        raise UserError(
            f"{what} returns a value with no gradient (detached, or not computed from the model's outputs); nothing "
            "would train"
        )


def check_finite(loss, batch, task) -> None:
    """A loss that is NaN or inf before any training: the data's values (named) or the loss."""
    if torch.isfinite(loss.detach()).all():  # one read, at start-up
        return
    pairs = zip(("input", "target"), batch, strict=False) if isinstance(batch, (tuple, list)) else ()
    entries = batch.items() if isinstance(batch, dict) else pairs
    bad = [
        str(name)
        for name, v in entries
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all()
    ]
    if bad:
        raise DataError(
            f"data: the first batch holds NaN or inf in its {', '.join(bad)}: the loss is {float(loss.detach()):g} "
            "before any training; remove or fill those values"
        )
    fn = getattr(task, "loss_fn", None)
    what = f"task.loss: {getattr(fn, '__name__', type(fn).__name__)}" if fn is not None else f"task {task.name}'s loss"
    raise UserError(
        f"{what} is {float(loss.detach()):g} on two samples of the first batch, before any training, with finite "
        "inputs and targets: the loss (or the model) cannot be computed on them"
    )


def place(raw: nn.Module, *, device: torch.device, trainer, dist) -> nn.Module:
    """On the device (channels_last if asked), converted to SyncBatchNorm if asked."""
    memory_format = torch.channels_last if trainer.channels_last else torch.preserve_format
    raw = raw.to(device=device, memory_format=memory_format)
    if trainer.sync_batchnorm:
        if dist.world_size == 1:
            log.warning("trainer.sync_batchnorm=true in a single process: nothing to synchronise, ignored")
        elif device.type != "cuda":
            raise UserError(
                "trainer.sync_batchnorm=true: SyncBatchNorm works only on CUDA devices; leave it false on the CPU"
            )
        else:
            raw = nn.SyncBatchNorm.convert_sync_batchnorm(raw)
    return raw


def compiled(model: nn.Module, raw: nn.Module, batch, precision, task) -> nn.Module:
    """torch.compile, warmed up on one forward/backward so that a failure shows now (and the
    run goes on in eager mode with one warning) and the compile time is reported apart."""
    saved = copy.deepcopy(raw.state_dict())  # the warm-up must not move BatchNorm statistics
    out = torch.compile(model)
    log.info(
        "torch.compile: compiling the model (one forward and backward; tens of seconds, minutes for large models) ..."
    )
    start = time.perf_counter()
    try:
        with precision.autocast():
            loss, _ = task.forward(out, batch)
        loss.backward()
        log.info("torch.compile: compiled in %.1fs", time.perf_counter() - start)
    except Exception as e:
        log.warning(
            "torch.compile failed (%s: %s); training in eager mode",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        out = model
    finally:
        raw.zero_grad(set_to_none=True)
        raw.load_state_dict(saved)
    return out


def setup_model(raw: nn.Module, spec, task, precision, *, device: torch.device, trainer, dist, batch) -> Models:
    """The model (`make`'s), checked on two real samples of the device `batch`, on the device,
    maybe SyncBN, DDP and compiled. Evaluated uncompiled: the compiled graph is for
    training steps of one batch shape; eval mode, no gradients and a short last batch would
    each compile it again."""
    from saturate.scale.distributed import wrap

    raw = place(raw, device=device, trainer=trainer, dist=dist)
    check(raw, _first_two(batch), task, precision, spec)
    n_params = sum(p.numel() for p in raw.parameters())
    log.info(
        "model: %s, %.2fM parameters%s",
        type(raw).__name__,
        n_params / 1e6,
        ", channels_last" if trainer.channels_last else "",
    )
    wrapped = wrap(raw, dist, device)
    if not trainer.compile:
        return Models(wrapped, raw, raw)
    return Models(compiled(wrapped, raw, batch, precision, task), raw, raw)


def _first_two(batch):
    """The first two samples of a batch (any structure)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t[:2] if isinstance(t, torch.Tensor) and t.ndim else t, batch)
