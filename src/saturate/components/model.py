"""The model of a run: built from its node (or given, or made by a factory), checked on real
samples, placed on the device, maybe converted to SyncBatchNorm, wrapped in DDP and compiled.

The data-derived arguments a constructor names (and its node does not set) are filled in
(saturate.config.data_info): `in_channels` (the input's first dimension: C of (C, H, W)),
`in_features` (its last: F of (T, F)), `input_shape`, `num_classes`, `num_outputs`, ...
Any other name takes a value from the data by interpolation in the node
(`input_size: ${data_info:in_features}`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from hydra.utils import get_method
from torch import nn

from saturate.components.device import untouched_rng
from saturate.components.operators import Operators
from saturate.config.data_info import arguments
from saturate.config.instantiate import build
from saturate.errors import CheckpointError, ConfigError, DataError, Problem, UserError, named_parts

log = logging.getLogger(__name__)


@dataclass
class Models:
    train: nn.Module  # what the loop calls: DDP-wrapped and/or compiled
    eval: nn.Module  # what the evaluator calls: never DDP (ranks evaluate different numbers of batches), never compiled
    raw: nn.Module  # the plain module: optimizer, checkpoints


def make(node: dict | None, values: dict[str, Any], given: nn.Module | Callable | None, pretrained=None) -> nn.Module:
    """The model: built from its node with the data-derived arguments it names; or the one
    passed in; or built by the factory passed in (called now, after seeding, with the
    data-derived arguments it names). Then the pretrained weights and the frozen layers
    (`pretrained`: a PretrainedConfig), if any."""
    if isinstance(given, nn.Module):
        log.info(
            "model: given as an object: its initial weights were drawn before trainer.seed was applied; pass a factory "
            "(saturate.fit(lambda: Model(...), ...)) to have them seeded"
        )
        raw = given
    elif given is not None:
        raw = given(**arguments(given, {}, values))
    else:
        assert node is not None, "make: a model node, a model or a factory"
        raw = build(node, "model", **arguments(get_method(node["_target_"]), node, values))
    if not isinstance(raw, nn.Module):
        raise UserError(f"model: {type(raw).__name__} is not a torch.nn.Module")
    if pretrained is not None:
        load_pretrained(raw, pretrained)
        freeze(raw, pretrained.freeze)
    return raw


def load_pretrained(model: nn.Module, cfg) -> None:
    """pretrained.path: a state dict (a checkpoint of saturate's: its `model`), read as data
    only, its key prefixes renamed; missing and unexpected keys named in one message (an
    error with pretrained.strict, else a warning)."""
    if not cfg.path:
        return
    from pathlib import Path

    from saturate.checkpoint.files import read, weights_problem

    path = Path(cfg.path).expanduser()
    try:
        state = read(path, "pretrained.path")  # a regular file, read as data: a payload is refused, never run
    except FileNotFoundError:
        raise ConfigError([Problem("pretrained.path", cfg.path, "a file that exists")]) from None
    state = state.get("model", state) if isinstance(state, dict) and "step" in state else state
    problem = weights_problem(state)
    if problem:
        raise ConfigError([Problem("pretrained.path", cfg.path, f"a state dict {{name: tensor}} (this {problem})")])
    for old, new in (cfg.rename or {}).items():
        state = {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in state.items()}
    own = model.state_dict()
    wrong = [
        f"{k} {tuple(v.shape)} (the model's {tuple(own[k].shape)})"
        for k, v in state.items()
        if k in own and v.shape != own[k].shape
    ]
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if wrong or ((missing or unexpected) and cfg.strict):
        raise UserError(f"pretrained.path={cfg.path}: {_mismatch(missing, unexpected, wrong)}")
    model.load_state_dict(state, strict=False)
    log.info(
        "pretrained: %d tensors from %s%s",
        len(state) - len(unexpected),
        path,
        f"; {_mismatch(missing, unexpected, [])}" if missing or unexpected else "",
    )


def _differences(missing: list[str], unexpected: list[str], wrong: list[str]) -> str:
    def few(keys: list[str]) -> str:
        return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")

    said = [
        f"{what}: {few(keys)}"
        for what, keys in (("shapes differ", wrong), ("missing", missing), ("unexpected", unexpected))
        if keys
    ]
    return "; ".join(said)


def _mismatch(missing: list[str], unexpected: list[str], wrong: list[str]) -> str:
    fix = "; pretrained.rename maps key prefixes ({'old.': 'new.'}), pretrained.strict=false loads what matches"
    return _differences(missing, unexpected, wrong) + fix


def load_weights(model: nn.Module, state: dict, source: str, *, node: dict | None = None) -> None:
    """Every weight of a checkpoint's `model` into `model`, or one line saying that `source`
    holds another model's (the shapes, missing and unexpected names that differ), or that
    it holds no state dict at all."""
    from saturate.checkpoint.files import weights_problem

    problem = weights_problem(state)
    if problem:
        raise CheckpointError(f"{source}: its model {problem}; not a checkpoint of saturate's")
    own = model.state_dict()
    wrong = [
        f"{k} {tuple(v.shape)} (the model's {tuple(own[k].shape)})"
        for k, v in state.items()
        if k in own and isinstance(v, torch.Tensor) and v.shape != own[k].shape
    ]
    missing, unexpected = [k for k in own if k not in state], [k for k in state if k not in own]
    if wrong or missing or unexpected:
        target = (node or {}).get("_target_", type(model).__name__)
        raise UserError(
            f"{source} holds the weights of another model than the config's (model._target_={target}): "
            f"{_differences(missing, unexpected, wrong)}; give the model=... (and its settings) it was trained with"
        )
    model.load_state_dict(state)


def freeze(model: nn.Module, patterns: list[str]) -> None:
    """pretrained.freeze: parameters whose names match a pattern keep their values (no
    gradient, no optimizer state)."""
    import fnmatch

    for i, pattern in enumerate(patterns):
        hit = [p for n, p in model.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
        if not hit:
            names = ", ".join(n for n, _ in model.named_parameters())
            allowed = f"a pattern matching some of {type(model).__name__}'s parameters ({names[:300]})"
            raise ConfigError([Problem(f"pretrained.freeze[{i}]", pattern, allowed)])
        for p in hit:
            p.requires_grad_(False)
    if patterns:
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        log.info("pretrained: %d parameters frozen (%s)", frozen, ", ".join(patterns))


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
            result = task.forward(model, batch)
    except RuntimeError as e:  # torch's shape and dtype mismatches; anything else is a bug, with its traceback
        raise UserError(
            f"model: {type(model).__name__} does not fit the data ({spec.describe()}) and task {task.name}: "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        what = (
            f"a {type(result).__name__} of {len(result)}"
            if isinstance(result, (tuple, list))
            else type(result).__name__
        )
        raise UserError(f"task: {type(task).__name__}.forward() returns {what}; expected (loss, outputs)")
    loss, outputs = result
    check_loss(loss, task)
    check_finite(loss, batch, task)
    check_metrics(task, outputs, batch, next(model.parameters()).device)


def check_metrics(task, outputs, batch, device: torch.device) -> None:
    """The task's metrics take the start-up batch's outputs (on fresh metrics, thrown away):
    outputs they cannot take fail now, naming the metric, not at the first evaluation."""
    for name, metric in task.metrics().items():
        metric = metric.to(device) if isinstance(metric, nn.Module) else metric
        try:
            task.update({name: metric}, outputs, batch)
        except (ValueError, RuntimeError, TypeError, IndexError) as e:  # torchmetrics' argument checks, torch's shapes
            target = batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
            described = lambda t: f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
            given = (
                f" ({described(outputs)} for targets {described(target)})"
                if isinstance(outputs, torch.Tensor) and isinstance(target, torch.Tensor)
                else ""
            )
            kind = type(metric).__name__
            raise UserError(
                f"task: {type(task).__name__}'s metrics cannot take its outputs{given}: {name} ({kind}) "
                f"raised {type(e).__name__}: {' '.join(str(e).split())[:250]}"
            ) from None


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
    bad = [
        name.replace("inputs", "input", 1).replace("targets", "target", 1)
        for name, v in named_parts(batch)
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
    raw = raw.to(device=device, memory_format=memory_format)  # type: ignore[call-overload]  # Module.to takes memory_format; torch's overloads omit it
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


def compiled(model: nn.Module, raw: nn.Module, batch, precision, task, last: int = 0) -> nn.Module:
    """torch.compile, warmed up on one forward/backward so that a failure shows now (and the
    run goes on in eager mode with one warning) and the compile time is reported apart. `last`:
    the size of an epoch's short last batch (loader.drop_last=false), warmed up too, so that its
    recompilation is not inside the first epoch (nor inside a tune trial's timed window)."""
    saved = copy.deepcopy(raw.state_dict())  # the warm-up must not move BatchNorm statistics
    out = cast(nn.Module, torch.compile(model))  # a compiled Module is still a Module
    log.info(
        "torch.compile: compiling the model (one forward and backward; tens of seconds, minutes for large models) ..."
    )
    start = time.perf_counter()
    try:
        for piece in [batch, *([first_samples(batch, last)] if last > 0 else [])]:
            with precision.autocast():
                loss, _ = task.forward(out, piece)
            loss.backward()
        log.info("torch.compile: compiled in %.1fs", time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 (any compile failure falls back to eager)
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


def setup_model(
    raw: nn.Module, spec, task, precision, *, device: torch.device, trainer, dist, batch, last: int = 0
) -> Models:
    """The model (`make`'s), checked on two real samples of the device `batch`, on the device,
    maybe SyncBN, DDP and compiled. Evaluated uncompiled: the compiled graph is for
    training steps of one batch shape; eval mode, no gradients and a short last batch would
    each compile it again."""
    from saturate.scale.distributed import wrap

    raw = place(raw, device=device, trainer=trainer, dist=dist)
    two = _first_two(batch)
    with untouched_rng(task):  # the checks run the user's model and task: training's streams stay where they were
        try:
            check(raw, two, task, precision, spec)
        except UserError as e:
            raise _cause(raw, two, task, precision, trainer) or e from None
    n_params = sum(p.numel() for p in raw.parameters())
    log.info(
        "model: %s, %.2fM parameters%s",
        type(raw).__name__,
        n_params / 1e6,
        ", channels_last" if trainer.channels_last else "",
    )
    wrapped = wrap(raw, dist, device)
    with untouched_rng(task):  # the compile warm-up
        trained = compiled(wrapped, raw, batch, precision, task, last) if trainer.compile else wrapped
    return Models(trained, raw, raw)


def takes_advice(model: nn.Module, batch, task, precision, *, image: bool, trainer, device: torch.device):
    """(channels_last_ok, amp_ok): what the report and tune may propose. The layout where the
    model has 2-D convolutions (which channels-last changes; a linear model's or an LSTM's
    operators run as they did) and computes two samples of `batch` in it; precision=amp where
    autocast computes some of its operators in bf16/fp16 (kernels for it exist: a matmul, a
    convolution, oneDNN's LSTM on a CPU; a model of embeddings and elementwise operators runs as
    in fp32) and the model computes under it (the CPU's own bf16 kernels are a fact of their
    own: RunFacts.cpu_bf16). Both True where already chosen (nothing to propose); the layout
    False for inputs that are not images. Asked after training, for the report: nothing on the
    way to the first step depends on it. Every generator is left as it was."""
    two = _first_two(batch)
    with untouched_rng(task):
        layout, lowered = Operators(), Operators()
        layout_ok = bool(trainer.channels_last)
        if not layout_ok and image:  # images only: the layout is an image option (RunFacts.image)
            with layout:
                fits = accepts(model, two, task, autocast=precision.autocast(), channels_last=True, convert=True)
            layout_ok = fits and layout.convolves
        amp_ok = precision.dtype is not None
        if not amp_ok:
            with lowered:
                amp_ok = accepts(model, two, task, autocast=_amp_autocast(device)) and lowered.lowered
    return layout_ok, amp_ok


def _cause(model, batch, task, precision, trainer) -> UserError | None:
    """A model that fails only in the layout or the precision it was asked to run in: the
    key to change, named (not the data)."""
    plain = trainer.channels_last and accepts(
        model, batch, task, autocast=precision.autocast(), channels_last=False, convert=True
    )
    if plain:  # it runs in the default layout
        return UserError(
            f"trainer.channels_last=true: {type(model).__name__} does not take channels-last inputs (a .view of a "
            "permuted tensor: use .reshape, or .flatten); leave trainer.channels_last=false"
        )
    if precision.dtype is not None and accepts(model, batch, task):
        dtype = str(precision.dtype).removeprefix("torch.")
        return UserError(
            f"precision.mode: {type(model).__name__} fails under autocast to {dtype} and runs in fp32 (an operation "
            "mixing its dtypes); use precision=fp32, or cast inside the model"
        )
    return None


def _amp_autocast(device: torch.device):
    from saturate.components.precision import _DTYPES, resolve_mode

    return torch.autocast(device.type, dtype=_DTYPES[resolve_mode("amp", device)])


def accepts(model: nn.Module, batch, task, *, autocast=None, channels_last=None, convert=False) -> bool:
    """Whether the model computes two samples of `batch` another way than the run's: under
    `autocast` (None: full precision), with its images (and the model, if `convert`) in
    channels-last layout (True) or in the default one (False; None: as they are). Eval mode,
    no gradients; a converted model is put back in the other layout after (the run's). A
    RuntimeError (torch's shape and dtype errors; a `.view` of a permuted tensor) is a no."""
    image = batch[0] if isinstance(batch, (tuple, list)) else None
    if channels_last and not (isinstance(image, torch.Tensor) and image.ndim == 4):
        return True
    layout = torch.channels_last if channels_last else torch.contiguous_format
    if channels_last is not None and isinstance(image, torch.Tensor) and image.ndim == 4:
        batch = type(batch)([image.contiguous(memory_format=layout), *batch[1:]])
    was_training = model.training
    model.eval()
    try:
        if convert:
            model.to(memory_format=layout)  # type: ignore[call-overload]  # as above
        with torch.no_grad(), autocast or contextlib.nullcontext():
            task.forward(model, batch)
        return True
    except RuntimeError:
        return False
    finally:
        if convert:
            model.to(memory_format=torch.contiguous_format if channels_last else torch.channels_last)  # type: ignore[call-overload]  # as above
        model.train(was_training)


def _first_two(batch):
    """The first two samples of a batch (any structure)."""
    return first_samples(batch, 2)


def first_samples(batch, size: int):
    """`batch` cut to its first `size` samples along the batch dimension: the tensors whose
    first dimension is the batch's sample count (its first tensor's); anything else as it is."""
    from torch.utils._pytree import tree_leaves, tree_map

    n = next((len(t) for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.ndim), 0)
    if n <= size:
        return batch
    return tree_map(lambda t: t[:size] if isinstance(t, torch.Tensor) and t.ndim and len(t) == n else t, batch)
