"""What a run trains, built in order from the config and the objects `fit` passes in:
data -> task -> precision -> model -> (batch-size search) -> loaders -> optimizer and schedule.

Each step receives only its own config node and the objects it depends on, and lives in the
module its name points to; this module calls them in order and checks that they fit each
other (the data and the image-only options, a last batch BatchNorm cannot train on).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from saturate.config.registration import set_data_info
from saturate.config.schema import RunConfig, given_text
from saturate.data import Data, DataSpec, build_datasets, describe
from saturate.data.augment import build_transforms
from saturate.data.base import stack
from saturate.data.loader import Loaders, build_loaders, build_pipeline, device_augment, room_for_resident
from saturate.errors import ConfigError, Problem, UserError
from saturate.loop.faults import NonFiniteGuard
from saturate.loop.step import TrainStep
from saturate.observe.costs import COST_SAMPLES, scaling, step_cost
from saturate.observe.environment import cpu_name
from saturate.parts.batch_size import Trial, choose
from saturate.parts.model import Models, build, data_arguments, setup_model
from saturate.parts.optim import prime_state, setup_optimizer
from saturate.parts.precision import Precision, setup_precision
from saturate.scale.distributed import Dist
from saturate.tasks import DATA_ARGUMENTS as TASK_ARGUMENTS

log = logging.getLogger("saturate")


@dataclass
class Given:
    """Objects `fit` passes in, where `train` builds them from the config's nodes."""

    model: Any = None  # an nn.Module, or a factory building one after seeding
    data: Data | None = None
    task: Any = None  # a task object (saturate.tasks.base)
    loss: Callable | None = None
    callbacks: dict[str, Any] = field(default_factory=dict)  # {name: object}
    loggers: dict[str, Any] = field(default_factory=dict)
    overrides: Sequence[str] = ()  # as fit was given them, for the record

    def nodes(self) -> tuple[str, ...]:
        """The config nodes these objects stand in for (not validated, not built)."""
        return tuple(name for name, obj in (("model", self.model), ("data", self.data), ("task", self.task)) if obj is not None)


@dataclass
class Parts:
    """What a run trains: data, task, precision, model, batches, optimizer and schedule."""

    data: Data
    spec: DataSpec
    task: Any
    precision: Precision
    models: Models
    loaders: Loaders
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    global_batch: int
    trials: list[Trial] | None = None  # batch-size search, when loader.batch_size=auto searched
    search_s: float = 0.0  # how long it took (0 when the cache had the answer)
    transforms: Any = None  # the user's augmentation modules (augmentation.transforms)
    notes: dict = field(default_factory=dict)
    cost: Any = None  # saturate.observe.costs.StepCost: FLOPs and launches of one step (None: not counted)
    scaling: tuple | None = None  # CPU: forward and backward timed on one sample and on COST_SAMPLES (saturate.observe.costs.scaling)


def data_name(run: RunConfig, given: Given) -> str:
    if given.data is not None:
        return type(given.data.train).__name__
    if HydraConfig.initialized() and HydraConfig.get().runtime.choices.get("data"):
        return HydraConfig.get().runtime.choices["data"]
    return run.data["_target_"].rsplit(".", 1)[-1].removeprefix("load_").removeprefix("make_")


def task_class(cfg: DictConfig, given: Given):
    """The task's class, before the data is described (it says whether targets are classes)."""
    if given.task is not None:
        return type(given.task)
    return get_method(cfg.task["_target_"])


def resolved_node(cfg: DictConfig, key: str) -> dict:
    """A node with its interpolations resolved now (`${data_info:...}` once the data is described)."""
    try:
        return OmegaConf.to_container(cfg[key], resolve=True)
    except OmegaConfBaseException as e:  # e.g. ${data_info:input_shape.3} of a 2-d input
        full = getattr(e, "full_key", None) or key
        why = str(e).splitlines()[0].removeprefix("ValueError raised while resolving interpolation: ")
        raise ConfigError([Problem(full, given_text(cfg, full), f"a value that resolves ({why})")]) from None


def build_task(cfg: DictConfig, spec: DataSpec, data: Data, given: Given):
    """The task: the object passed in, or built from its node with the data-derived
    arguments its constructor names; a loss passed to fit replaces the task's."""
    if given.task is not None:
        return given.task
    node = resolved_node(cfg, "task")
    values = {"num_classes": spec.num_classes, "num_outputs": spec.num_outputs, "target_inverse": data.target_inverse,
              "class_names": list(getattr(data.train, "classes", None) or []) or None}  # fmt: skip
    arguments = data_arguments(get_method(node["_target_"]), node, values, TASK_ARGUMENTS)
    if given.loss is not None:
        arguments["loss"] = given.loss
    if data.target_inverse is not None and "target_inverse" not in arguments and "target_inverse" not in node:
        log.warning("data: target_inverse given, but task %s does not take one: metrics stay in the model's units", node["_target_"])
    task = build(node, "task", **arguments)
    for method in ("forward", "metrics", "update", "better"):
        if not callable(getattr(task, method, None)):
            raise UserError(f"task: {type(task).__name__} has no {method}(); a task has forward, metrics, update and better "
                            "(saturate.tasks.base)")  # fmt: skip
    return task


def check_fits_data(run: RunConfig, spec: DataSpec) -> None:
    """Options that only make sense for images."""
    problems = []
    if not spec.image:
        what = f"image inputs (C, H, W), uint8 or float in [0, 1]; the data gives {spec.describe()}"
        if run.augmentation.placement != "none":
            problems.append(Problem("augmentation.placement", run.augmentation.placement, f"none: augmentation works on {what}"))
        if run.trainer.channels_last:
            problems.append(Problem("trainer.channels_last", True, f"false: channels_last is a layout of {what}"))
    if run.trainer.accumulate > 1 and spec.collate:
        log.info("trainer.accumulate=%d: micro-batches cut every tensor of a batch along its first dimension", run.trainer.accumulate)
    if problems:
        raise ConfigError(problems)


def check_last_batch(run: RunConfig, model: nn.Module, train_set, d: Dist) -> None:
    """BatchNorm cannot train on one sample: a last training batch of one (drop_last=false)
    would fail at the end of the first epoch, after minutes of training. Say so now."""
    per_rank = len(train_set) // d.world_size if d.world_size > 1 else len(train_set)
    one_left = not run.loader.drop_last and per_rank % run.loader.batch_size == 1 and run.trainer.limit_train_batches < 0
    if one_left and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        why = f"the last training batch would hold 1 sample ({per_rank} samples, batch {run.loader.batch_size})"
        allowed = f"true: {why}, which BatchNorm cannot train on; or another loader.batch_size"
        raise ConfigError([Problem("loader.drop_last", False, allowed)])


def host_batch(data: Data, indices) -> Any:
    """A host batch of the training samples at `indices`, as the loader makes it."""
    dataset, indices = data.train, list(indices)
    if getattr(dataset, "returns_batches", False):
        return dataset.__getitems__(indices)
    samples = [dataset[i] for i in indices]
    return (data.collate or stack)(samples)


def make_step(run: RunConfig, models: Models, optimizer, precision: Precision, task, device: torch.device, d: Dist, *,
              search: bool = False) -> TrainStep:  # fmt: skip
    """The step the run trains with, and (search=True) the one the batch-size search times:
    no out-of-memory recovery (an out-of-memory is the search's answer) and a guard that
    reads nothing per step."""
    if search:
        guard = NonFiniteGuard(skip=False, check_grads=False, max_consecutive=1, device=device)
        model = models.train if d.world_size == 1 else models.eval  # the trials are each rank's own
        return TrainStep(model, optimizer, precision, guard, loss=lambda m, b: task.forward(m, b)[0], grad_clip=0.0, recover_oom=False)
    guard = NonFiniteGuard(skip=run.trainer.skip_nonfinite, check_grads=not precision.scaler.is_enabled(),
                           max_consecutive=run.trainer.max_nonfinite_steps, device=device, agree=d.agree)  # fmt: skip
    return TrainStep(models.train, optimizer, precision, guard, loss=lambda m, b: task.forward(m, b)[0], grad_clip=run.trainer.grad_clip,
                     micro_batches=run.trainer.accumulate, dist=d)  # fmt: skip


def search_batch_size(run: RunConfig, models: Models, precision: Precision, task, data: Data, spec: DataSpec, device, d: Dist,
                      transforms) -> tuple[int, list[Trial]]:  # fmt: skip
    """loader.batch_size=auto: saturate.parts.batch_size.choose, keyed by what decides the size."""
    cfg = run.batch_search
    key = {
        "model": {
            "node": run.model,
            "class": f"{type(models.raw).__module__}.{type(models.raw).__qualname__}",
            "parameters": sum(p.numel() for p in models.raw.parameters()),
        },  # fmt: skip
        "input": [*spec.input_shape, str(spec.input_dtype)],
        "task": getattr(task, "name", type(task).__name__),
        "precision": precision.name,
        "compile": run.trainer.compile,
        "channels_last": run.trainer.channels_last,
        "augmentation": run.augmentation.placement,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu: {cpu_name()}",
        "world_size": d.world_size,
        "memory_fraction": run.device.memory_fraction,  # what memory the sizes had to fit in
        "resident": run.loader.resident,  # resident data takes device memory beside the batch
    }
    optimizer = build({**run.optim.optimizer}, "optim.optimizer")(models.raw.parameters())  # the run's kind, thrown away afterwards
    prime_state(optimizer)  # fp16's first trial step may overflow: fused SGD's momentum must not read garbage
    augment = device_augment(run.augmentation, run.trainer.seed, transforms)
    pipeline = build_pipeline(run.loader, spec, device, run.trainer, augment=augment)
    order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(run.trainer.seed))
    return choose(cfg, key=key, samples=len(data.train), world_size=d.world_size, optimizer=optimizer, pipeline=pipeline,
                  make_step=lambda: make_step(run, models, optimizer, precision, task, device, d, search=True),
                  fetch=lambda size: host_batch(data, order[:size].tolist()), device=device, model=models.raw, dist=d,
                  compiled=run.trainer.compile)  # fmt: skip


def build_parts(cfg: DictConfig, run: RunConfig, d: Dist, device: torch.device, show_images, given: Given) -> Parts:
    """data -> task -> precision -> model -> (batch-size search) -> loaders -> optimizer and schedule."""
    data = given.data if given.data is not None else build_datasets(run.data)
    cls = task_class(cfg, given)
    source = given.task if given.task is not None else cfg.task  # where the input and the target are in a dict sample
    get = (lambda k, d: getattr(source, k, d)) if given.task is not None else (lambda k, d: source.get(k, d))
    keys = {"input_key": get("input_key", "input"), "target_key": get("target_key", "target")}
    spec = describe(data.train, data.val, test=data.test, name=data_name(run, given), classes=bool(getattr(cls, "class_targets", False)),
                    collate=data.collate is not None, **keys)  # fmt: skip
    splits = " / ".join(f"{len(s)} {n}" for n, s in (("train", data.train), ("val", data.val), ("test", data.test)) if s is not None)
    log.info("data: %s: %s; %s samples", spec.name, spec.describe(), splits)
    check_fits_data(run, spec)
    set_data_info({"in_channels": spec.input_shape[0] if spec.input_shape else 1, "in_features": spec.input_shape[-1] if spec.input_shape
                   else 1, "input_shape": list(spec.input_shape), "num_classes": spec.num_classes, "num_outputs": spec.num_outputs,
                   "class_names": list(getattr(data.train, "classes", None) or [])})  # fmt: skip
    task = build_task(cfg, spec, data, given)
    precision = setup_precision(run.precision, device)
    transforms = build_transforms(run.augmentation.transforms)
    # real samples for the start-up check (2) and the compile warm-up (the size the run, or the search, starts with)
    size = (run.loader.batch_size if run.loader.batch_size != "auto" else run.batch_search.min) if run.trainer.compile else 2
    example = build_pipeline(run.loader, spec, device, run.trainer)(host_batch(data, range(min(len(data.train), size))))
    node = resolved_node(cfg, "model") if given.model is None else None
    models = setup_model(node, spec, task, precision, device=device, trainer=run.trainer, dist=d, batch=example, given=given.model)
    del example  # not held on the device through the batch-size search
    trials, started = None, time.perf_counter()
    if run.loader.batch_size == "auto":
        samples = sum(len(s) for s in (data.train, data.val) if s is not None)
        with room_for_resident(run.loader, spec, samples, device):  # resident data is placed after the search: its room is kept
            chosen, trials = search_batch_size(run, models, precision, task, data, spec, device, d, transforms)
        run.loader = dataclasses.replace(run.loader, batch_size=chosen)
    loaders = build_loaders(run.loader, run.augmentation, data, spec, device=device, trainer=run.trainer, show_images=show_images,
                            rank=d.rank, world_size=d.world_size, transforms=transforms)  # fmt: skip
    check_last_batch(run, models.raw, data.train, d)
    cost, fixed = None, None
    if run.monitor.costs:  # counted on up to COST_SAMPLES real samples, scaled to the batch (conv and matmul FLOPs are linear in it)
        counted = build_pipeline(run.loader, spec, device, run.trainer)(host_batch(data, range(min(len(data.train), COST_SAMPLES))))
        cost = step_cost(models.raw, counted, task, precision, batch=run.loader.batch_size)
        fixed = scaling(models.raw, counted, task, precision, device)
    total_steps = len(loaders.train) * run.trainer.max_epochs
    if run.trainer.max_steps > 0:
        total_steps = min(total_steps, run.trainer.max_steps)
    global_batch = run.loader.batch_size * d.world_size
    optimizer, scheduler = setup_optimizer(run.optim, models.raw, steps_per_epoch=len(loaders.train), total_steps=total_steps,
                                           global_batch=global_batch)  # fmt: skip
    search_s = time.perf_counter() - started if trials is not None else 0.0
    return Parts(data, spec, task, precision, models, loaders, optimizer, scheduler, total_steps, global_batch, trials, search_s,
                 transforms, cost=cost, scaling=fixed)  # fmt: skip
