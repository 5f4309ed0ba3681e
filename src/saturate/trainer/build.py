"""What a run trains, built in order from its config and the objects a caller passed in:
data -> task -> precision -> model -> (batch-size search) -> loaders -> optimizer and schedule.

Each step receives only its own config node and the objects it depends on, and lives in the
module its name points to; this module calls them in order and checks that they fit each
other (the data and the image-only options, a last batch BatchNorm cannot train on). What a
builder chooses (the batch size a search found) comes back in `Parts`; the config is never
written to.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_method
from torch import nn

from saturate.checkpoint.checkpointer import Checkpointer
from saturate.components.batch_size import Trial, TrialSetup, choose
from saturate.components.device import autotune_convolutions, untouched_rng
from saturate.components.model import Models, make, setup_model
from saturate.components.optim import prime_state
from saturate.components.optimizers import check_steps, setup_optimizers
from saturate.components.precision import Precision, setup_precision
from saturate.components.schedule import Schedule
from saturate.config import data_info
from saturate.config.instantiate import build
from saturate.config.invocation import Invocation
from saturate.config.schema import CheckpointConfig, RunConfig
from saturate.data import Data, DataSpec, build_datasets, describe
from saturate.data.augment import build_transforms, check_transforms
from saturate.data.base import stack
from saturate.data.loader import Loaders, Shard, build_loaders, build_pipeline, device_augment, room_for_resident
from saturate.data.mix import BatchMix
from saturate.diagnostics.environment import cpu_name
from saturate.diagnostics.timing import Startup
from saturate.errors import ConfigError, Problem, UserError
from saturate.loop.faults import NonFiniteGuard
from saturate.loop.step import TrainStep
from saturate.loop.target import Target
from saturate.scale.distributed import Dist
from saturate.tasks.base import TaskProtocol, TaskState

log = logging.getLogger("saturate")


@dataclass
class UserObjects:
    """The objects a caller passes in (saturate.fit) where train.py's config names them."""

    model: Any = None  # an nn.Module, or a factory building one after seeding
    data: Data | None = None
    task: TaskProtocol | None = None  # a task object (saturate.tasks.base)
    loss: Callable | None = None
    callbacks: dict[str, Any] = field(default_factory=dict)  # {name: object}
    loggers: dict[str, Any] = field(default_factory=dict)

    def nodes(self) -> tuple[str, ...]:
        """The config nodes these objects stand in for (not validated, not built)."""
        given = (("model", self.model), ("data", self.data), ("task", self.task))
        return tuple(name for name, obj in given if obj is not None)


@dataclass
class Parts:
    """What a run trains: data, task, precision, model, batches, optimizer and schedule, and
    what the builders chose on the way."""

    data: Data
    spec: DataSpec
    task: TaskProtocol
    precision: Precision
    models: Models
    loaders: Loaders
    optimizer: torch.optim.Optimizer
    scheduler: Schedule
    batch_size: int  # per device: the config's, or what loader.batch_size=auto chose
    total_steps: int
    nodes: dict[str, dict]  # the model and task nodes as built (the data's values bound), for the record
    trials: list[Trial] | None = None  # batch-size search, when loader.batch_size=auto searched
    search_s: float = 0.0  # how long it took (0 when the cache had the answer)
    checkpointing: Any = None  # checkpoint.monitor and mode resolved for this task and data (CheckpointConfig)


@dataclass
class Ingredients:
    """What the builders after the task read: the config, the data and what one look at it
    said, the task, the precision policy, the device and the ranks."""

    run: RunConfig
    data: Data
    spec: DataSpec
    task: TaskProtocol
    precision: Precision
    device: torch.device
    dist: Dist


def data_name(run: RunConfig, invocation: Invocation, objects: UserObjects) -> str:
    if objects.data is not None:
        return type(objects.data.train).__name__
    chosen = invocation.choices.get("data")
    if chosen:
        return chosen
    return run.data["_target_"].rsplit(".", 1)[-1].removeprefix("load_").removeprefix("make_")


def build_task(node: dict | None, values: dict, objects: UserObjects):
    """The task: the object passed in, or built from its node with the data-derived
    arguments its constructor names; a loss passed to fit replaces the task's."""
    if objects.task is not None:
        _check_directions(objects.task)
        return objects.task
    assert node is not None, "build_task: a task node, or a task object"
    arguments = data_info.arguments(get_method(node["_target_"]), node, values)
    if objects.loss is not None:
        arguments["loss"] = objects.loss
    if values["target_inverse"] is not None and "target_inverse" not in arguments and "target_inverse" not in node:
        log.warning(
            "data: target_inverse given, but task %s does not take one: metrics stay in the model's units",
            node["_target_"],
        )
    task = build(node, "task", **arguments)
    for method in ("forward", "metrics", "update", "better", "names"):
        if not callable(getattr(task, method, None)):
            raise UserError(
                f"task: {type(task).__name__} has no {method}(); a task has forward, metrics, update, better and names "
                "(saturate.tasks.base)"
            )
    _check_directions(task)
    return task


def _check_directions(task) -> None:
    """metrics() is a dict and better() says "max" or "min" for each of its names: a direction
    that is neither would make best.pt the worst checkpoint, silently."""
    kind = type(task).__name__
    try:
        metrics = task.metrics()
    except Exception as e:  # noqa: BLE001 (the user's task: one line)
        raise UserError(f"task: {kind}.metrics() raised {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(metrics, dict):
        raise UserError(
            f"task: {kind}.metrics() returned a {type(metrics).__name__}; expected a dict {{name: torchmetrics metric}}"
        )
    for name in metrics:
        said = task.better(name)
        if said not in ("max", "min"):
            raise UserError(
                f"task: {kind}.better({name!r}) returned {said!r}; expected 'max' or 'min' (which way {name} improves)"
            )


def check_fits_data(run: RunConfig, spec: DataSpec) -> None:
    """Options that only make sense for images."""
    problems = []
    if not spec.image:
        what = f"image inputs (C, H, W), uint8 or float in [0, 1]; the data gives {spec.describe()}"
        if run.augmentation.placement != "none":
            problems.append(
                Problem("augmentation.placement", run.augmentation.placement, f"none: augmentation works on {what}")
            )
        if run.trainer.channels_last:
            problems.append(Problem("trainer.channels_last", True, f"false: channels_last is a layout of {what}"))
    if run.trainer.accumulate > 1 and spec.collate:
        log.info(
            "trainer.accumulate=%d: micro-batches cut every tensor of a batch along its first dimension",
            run.trainer.accumulate,
        )
    if problems:
        raise ConfigError(problems)


def batch_mix(run: RunConfig, spec: DataSpec, task, rank: int) -> BatchMix | None:
    """mix: mixup, CutMix or the user's batch transform, for training batches; None when off.
    Mixed targets are soft: class indices need a task whose loss takes probabilities. Each
    rank draws its own (as its augmentation does)."""
    cfg = run.mix
    if not cfg.mixup and not cfg.cutmix and cfg.transform is None:
        return None
    transform = build(cfg.transform, "mix.transform") if cfg.transform is not None else None
    if cfg.transform is not None and not callable(transform):
        built = "None" if transform is None else f"a {type(transform).__name__}"
        allowed = (
            f"a node that builds a callable taking the batch (it built {built}): a function's node needs "
            "`_partial_: true`, so that it is called with each batch, not once without it"
        )
        raise ConfigError([Problem("mix.transform._target_", cfg.transform.get("_target_"), allowed)])
    if transform is None and not (spec.classes or not spec.target_shape or spec.target_shape == (spec.num_outputs,)):
        key = "mix.mixup" if cfg.mixup else "mix.cutmix"
        allowed = f"0: mixing needs class indices or real-valued targets; task {getattr(task, 'name', '?')} has others"
        raise ConfigError([Problem(key, cfg.mixup or cfg.cutmix, allowed)])
    classes = spec.num_classes if spec.classes else None
    seed = run.trainer.seed + 1_000_003 * (rank + 7_919)  # a stream apart from the augmentation's
    return BatchMix(cfg, num_classes=classes, seed=seed, transform=transform)


def check_last_batch(run: RunConfig, batch_size: int, model: nn.Module, train_set, dist: Dist) -> None:
    """BatchNorm cannot train on one sample: a last training batch of one (drop_last=false)
    would fail at the end of the first epoch, after minutes of training. Say so now."""
    per_rank = len(train_set) // dist.world_size if dist.world_size > 1 else len(train_set)
    one_left = not run.loader.drop_last and per_rank % batch_size == 1 and run.trainer.limit_train_batches < 0
    if one_left and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        why = f"the last training batch would hold 1 sample ({per_rank} samples, batch {batch_size})"
        allowed = f"true: {why}, which BatchNorm cannot train on; or another loader.batch_size"
        raise ConfigError([Problem("loader.drop_last", False, allowed)])


def host_batch(data: Data, indices) -> Any:
    """A host batch of the training samples at `indices`, as the loader makes it."""
    dataset, indices = data.train, list(indices)
    if getattr(dataset, "returns_batches", False):
        return dataset.__getitems__(indices)
    samples = [dataset[i] for i in indices]
    return (data.collate or stack)(samples)


def make_step(
    run: RunConfig,
    models: Models,
    optimizer,
    precision: Precision,
    task,
    device: torch.device,
    dist: Dist,
    *,
    search: bool = False,
) -> TrainStep:
    """The step the run trains with, and (search=True) the one the batch-size search times:
    no out-of-memory recovery (an out-of-memory is the search's answer) and a guard that
    reads nothing per step."""
    if search:
        guard = NonFiniteGuard(skip=False, check_grads=False, max_consecutive=1, device=device)
        model = models.train if dist.world_size == 1 else models.eval  # the trials are each rank's own
        return TrainStep(
            model,
            optimizer,
            precision,
            guard,
            loss=lambda m, b: task.forward(m, b)[0],
            grad_clip=0.0,
            recover_oom=False,
        )
    guard = NonFiniteGuard(
        skip=run.trainer.skip_nonfinite,
        check_grads=not precision.scaler.is_enabled(),
        max_consecutive=run.trainer.max_nonfinite_steps,
        device=device,
        agree=dist.agree,
    )
    return TrainStep(
        models.train,
        optimizer,
        precision,
        guard,
        loss=lambda m, b: task.forward(m, b)[0],
        grad_clip=run.trainer.grad_clip,
        micro_batches=run.trainer.accumulate,
        dist=dist,
        summed=getattr(task, "loss_reduction", "mean") == "sum",
    )


def search_batch_size(ingredients: Ingredients, models: Models, transforms) -> tuple[int, list[Trial]]:
    """loader.batch_size=auto: saturate.components.batch_size.choose, keyed by what decides the size."""
    run, data, spec, task = ingredients.run, ingredients.data, ingredients.spec, ingredients.task
    precision, device, dist = ingredients.precision, ingredients.device, ingredients.dist
    cfg = run.batch_search
    key = {
        "model": {
            "node": run.model,
            "class": f"{type(models.raw).__module__}.{type(models.raw).__qualname__}",
            "parameters": sum(p.numel() for p in models.raw.parameters()),
        },
        "input": [*spec.input_shape, str(spec.input_dtype)],
        "task": getattr(task, "name", type(task).__name__),
        "precision": precision.name,
        "compile": run.trainer.compile,
        "channels_last": run.trainer.channels_last,
        "augmentation": run.augmentation.placement,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu: {cpu_name()}",
        "world_size": dist.world_size,
        "memory_fraction": run.device.memory_fraction,  # what memory the sizes had to fit in
        "resident": run.loader.resident,  # resident data takes device memory beside the batch
    }
    # the run's kind, thrown away afterwards
    optimizer = build({**run.optim.optimizer}, "optim.optimizer")(models.raw.parameters())
    prime_state(optimizer)  # fp16's first trial step may overflow: fused SGD's momentum must not read garbage
    augment = device_augment(run.augmentation, run.trainer.seed, transforms)
    pipeline = build_pipeline(run.loader, spec, device, run.trainer, augment=augment)
    order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(run.trainer.seed))
    own = precision.detached()  # the trials' loss-scale updates stay theirs
    trial = TrialSetup(
        make_step=lambda: make_step(run, models, optimizer, own, task, device, dist, search=True),
        optimizer=optimizer,
        pipeline=pipeline,
        fetch=lambda size: host_batch(data, order[:size].tolist()),
        device=device,
    )
    samples = len(data.train)
    return choose(cfg, key=key, samples=samples, trial=trial, model=models.raw, dist=dist, compiled=run.trainer.compile)


def _describe(run: RunConfig, invocation: Invocation, data: Data, objects: UserObjects) -> DataSpec:
    """What the run learns from one look at the data (saturate.data.base.describe), logged."""
    cls: Callable[..., Any]
    get: Callable[[str, Any], Any]
    if objects.task is not None:
        cls, get = type(objects.task), functools.partial(getattr, objects.task)
    else:
        cls, get = get_method(run.task["_target_"]), run.task.get
    keys = {"input_key": get("input_key", "input"), "target_key": get("target_key", "target")}
    spec = describe(
        data.train,
        data.val,
        test=data.test,
        name=data_name(run, invocation, objects),
        classes=bool(getattr(cls, "class_targets", False)),
        collate=data.collate is not None,
        **keys,
    )
    splits = " / ".join(
        f"{len(s)} {n}" for n, s in (("train", data.train), ("val", data.val), ("test", data.test)) if s is not None
    )
    log.info("data: %s: %s; %s; %s samples", spec.name, spec.describe(), spec.normalisation, splits)
    return spec


def _check_predict(run: RunConfig, spec: DataSpec) -> None:
    """trainer.predict names a split the data has."""
    split_there = {"val": spec.has_val, "test": spec.has_test}
    if run.trainer.predict is not None and not split_there[run.trainer.predict]:
        there = [s for s, has in split_there.items() if has]
        allowed = f"{' or '.join(there) or 'unset'}: the data has no {run.trainer.predict} split"
        raise ConfigError([Problem("trainer.predict", run.trainer.predict, allowed)])


def _total_steps(trainer, steps_per_epoch: int) -> int:
    total = steps_per_epoch * trainer.max_epochs
    return min(total, trainer.max_steps) if trainer.max_steps > 0 else total


def _unmarked(name: str) -> None:
    """No start-up clock (a caller that builds parts alone)."""


def _search(ingredients: Ingredients, models: Models, transforms):
    """loader.batch_size=auto: (the size chosen, the trials, seconds); else (the size, None, 0)."""
    run = ingredients.run
    if run.loader.batch_size != "auto":
        return run.loader.batch_size, None, 0.0
    started = time.perf_counter()
    samples = sum(len(s) for s in (ingredients.data.train, ingredients.data.val) if s is not None)
    # resident data is placed after the search: its room is kept
    # the trials run the task: a state it carries is put back afterwards
    with room_for_resident(run.loader, ingredients.spec, samples, ingredients.device), untouched_rng(ingredients.task):
        chosen, trials = search_batch_size(ingredients, models, transforms)
    return chosen, trials, time.perf_counter() - started


def _model(ingredients: Ingredients, node: dict | None, values: dict, given):
    """The model, checked on real samples (saturate.components.model.setup_model)."""
    run, data = ingredients.run, ingredients.data
    # real samples for the start-up check (2) and the compile warm-up (the size the run, or the search, starts with)
    size = 2
    if run.trainer.compile:
        size = run.loader.batch_size if run.loader.batch_size != "auto" else run.batch_search.min
    with untouched_rng():  # a dataset or augmentation that draws: the same whatever the size
        example = build_pipeline(run.loader, ingredients.spec, ingredients.device, run.trainer)(
            host_batch(data, range(min(len(data.train), size)))
        )
    raw = make(node, values, given, run.pretrained)
    trainer, device = run.trainer, ingredients.device
    whole = run.trainer.limit_train_batches == -1 and ingredients.dist.world_size == 1 and size > 2  # one reader
    last = len(data.train) % size if run.trainer.compile and not run.loader.drop_last and whole else 0  # warmed too
    return setup_model(
        raw,
        ingredients.spec,
        ingredients.task,
        ingredients.precision,
        device=device,
        trainer=trainer,
        dist=ingredients.dist,
        batch=example,
        last=last,
    )


def data_and_task(run: RunConfig, invocation: Invocation, objects: UserObjects, device: torch.device):
    """The data (the caller's, or built now), what one look at it said, its values for the
    model and task nodes, the nodes as bound, and the task."""
    data = objects.data if objects.data is not None else build_datasets(run.data)
    spec = _describe(run, invocation, data, objects)
    check_fits_data(run, spec)
    autotune_convolutions(run.device, fixed_shapes=spec.fixed, device=device)
    values = data_info.derive(spec, data)
    nodes = {
        key: data_info.bind(getattr(run, key), values, key) for key in ("model", "task") if key not in objects.nodes()
    }
    task = build_task(nodes.get("task"), values, objects)
    check_steps(run.optim, task)  # one optimizer, or several with a task that takes its own steps
    spec = dataclasses.replace(spec, host_keys=tuple(getattr(task, "host_keys", ())))  # CTC's lengths
    return data, spec, values, nodes, task


def build_parts(
    run: RunConfig,
    invocation: Invocation,
    objects: UserObjects,
    dist: Dist,
    device: torch.device,
    show_images,
    *,
    startup: Startup | None = None,
) -> Parts:
    """data -> task -> precision -> model -> (batch-size search) -> loaders -> optimizer and
    schedule; each marked on `startup`."""
    mark = startup.mark if startup is not None else _unmarked
    data, spec, values, nodes, task = data_and_task(run, invocation, objects, device)
    mark("data")
    checkpointing = run.checkpoint.resolved(task, spec.has_val)  # the monitored metric, its direction
    _check_predict(run, spec)
    precision = setup_precision(run.precision, device)
    transforms = build_transforms(run.augmentation.transforms)
    if spec.image:  # (other data: augmentation is refused with its reason in check_fits_data)
        check_transforms(transforms, spec.input_shape)
    ingredients = Ingredients(run, data, spec, task, precision, device, dist)
    models = _model(ingredients, nodes.get("model"), values, objects.model)
    mark("model and its checks")
    batch_size, trials, search_s = _search(ingredients, models, transforms)
    mark("batch-size search")  # none: 0 s
    loaders = build_loaders(
        dataclasses.replace(run.loader, batch_size=batch_size),
        run.augmentation,
        data,
        spec,
        device=device,
        trainer=run.trainer,
        shard=Shard(run.trainer.seed, dist.rank, dist.world_size),
        show_images=show_images,
        transforms=transforms,
        mix=batch_mix(run, spec, task, dist.rank),
    )
    check_last_batch(run, batch_size, models.raw, data.train, dist)
    mark("loaders")
    total_steps = _total_steps(run.trainer, len(loaders.train))
    optimizer, scheduler = setup_optimizers(
        run.optim,
        models.raw,
        task,
        steps_per_epoch=len(loaders.train),
        total_steps=total_steps,
        global_batch=batch_size * dist.world_size,
        monitor=(checkpointing.monitor, checkpointing.mode),
    )
    mark("optimizer")  # torch.optim's first optimizer imports torch._dynamo: a second, in any loop
    parts = Parts(data, spec, task, precision, models, loaders, optimizer, scheduler, batch_size, total_steps, nodes)
    chosen = {"trials": trials, "search_s": search_s, "checkpointing": checkpointing}
    return dataclasses.replace(parts, **chosen)


def build_target(run: RunConfig, parts: Parts) -> Target | None:
    """target.metric and target.value, checked against what the evaluations log, or None."""
    aim = run.target.resolved(parts.task, parts.spec.has_val)
    if not aim or run.target.value is None:
        return None
    return Target(aim[0], float(run.target.value), aim[1], run.target.stop)


def build_checkpointer(
    run: RunConfig, checkpointing: CheckpointConfig, parts: Parts, observers, config: dict, env: dict, dist: Dist
) -> Checkpointer:
    """The run's checkpointer: what it saves (the model, the optimizer, the schedule, the
    scaler, the observers' states) and where (run_dir/checkpoints)."""
    return Checkpointer(
        Path(run.run_dir) / "checkpoints",
        checkpointing,
        interval=run.trainer.checkpoint_interval,
        model=parts.models.raw,
        stateful={
            "optimizer": parts.optimizer,
            "scheduler": parts.scheduler,
            "scaler": parts.precision.scaler,
            "observers": observers,
            "order": parts.loaders.train.sampler,  # the epoch's drawn seed (loader.order=global)
            "task": TaskState(parts.task, dist.world_size),  # a state the task carries (task.carry)
        },
        config=config,
        fingerprint=env,
        enabled=dist.is_main,
        agree=dist.any if dist.world_size > 1 else None,  # checkpoint_interval=auto: rank 0's clock decides
    )
