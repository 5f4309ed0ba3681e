"""The run's typed schema (`RunConfig`: the groups of saturate.config.groups, the `_target_`
nodes, the run dir), and the one place a composed config is checked.

The YAML files under conf/ hold values only; the types live in Python. `RunConfig` is registered
in Hydra's ConfigStore as `base_config` and heads conf/config.yaml's defaults list, so Hydra
checks the type of every value and override while it composes. What a type cannot say
(ranges, choices, combinations) each schema says in `problems()`, and `validate()` collects
every problem into one ConfigError before any data or model work starts.

`data`, `model` and `optim.optimizer` are `_target_` nodes typed `Any`, because their
fields are the parameters of the callable they name: each key is checked against that
callable's signature, and the callable checks its own values.

Nothing here runs at import: `saturate.register()` stores the schema and the resolvers
(train.py and `saturate.fit` call it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from saturate.config.data_info import DATA_ARGUMENTS
from saturate.config.groups import (
    AugmentationConfig,
    BatchSearchConfig,
    CheckpointConfig,
    DeviceConfig,
    LoaderConfig,
    MixConfig,
    MonitorConfig,
    OptimConfig,
    PrecisionConfig,
    PretrainedConfig,
    TargetConfig,
    TrainerConfig,
    TuneConfig,
)
from saturate.config.optim_values import optimizer_problems, scheduler_problems
from saturate.config.targets import check_target
from saturate.errors import ConfigError, Problem
from saturate.started import import_timed


@dataclass
class RunConfig:
    device: DeviceConfig = field(default_factory=DeviceConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    augmentation: AugmentationConfig = field(default_factory=AugmentationConfig)
    model: Any = MISSING  # `_target_` node: an nn.Module, given the data-derived arguments its constructor names
    data: Any = MISSING  # `_target_` node: a callable returning (train_dataset, val_dataset)
    # `_target_` node: a task (saturate.tasks), given the data-derived arguments its constructor names
    task: Any = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    pretrained: PretrainedConfig = field(default_factory=PretrainedConfig)
    mix: MixConfig = field(default_factory=MixConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    batch_search: BatchSearchConfig = field(default_factory=BatchSearchConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    # {name: `_target_` node}: the logger group's options, or yours (rank 0)
    logger: dict[str, Any] = field(default_factory=dict)
    # {name: `_target_` node} with hooks of saturate.callbacks.Callback
    callbacks: dict[str, Any] = field(default_factory=dict)
    run_dir: str = MISSING  # Hydra's output dir for this job
    # ends the run dir's name (TensorBoard's run name); default: the overrides (a sweep's swept ones)
    name: str | None = None


GROUPS = (
    "device",
    "precision",
    "loader",
    "augmentation",
    "optim",
    "pretrained",
    "mix",
    "trainer",
    "checkpoint",
    "target",
    "batch_search",
    "monitor",
    "tune",
)
# keys that existed once: a config that sets one is told what became of it, not that the key is unknown
REMOVED = {
    "loader.build_ahead": "no such key: it was removed (the data is built in the run's process); drop it",
}


def _floats(node: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every float in a plain config tree, with its dotted key."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _floats(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _floats(value, f"{prefix[:-1]}[{i}].")
    elif isinstance(node, float):
        yield prefix[:-1], node


def given_text(cfg: DictConfig, key: str) -> Any:
    """What the config holds at `key`, unresolved (an interpolation's text)."""
    try:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
        held = OmegaConf.to_container(node, resolve=False) if node is not None else None
        return held.get(leaf, "(removed)") if isinstance(held, dict) else "(removed)"
    except Exception:  # noqa: BLE001 (for a message only, whatever the config holds)
        return "?"


def validate(cfg: DictConfig, *, given: tuple[str, ...] = ()) -> RunConfig:
    """Check the whole composed config, once; return it typed, or raise one ConfigError that
    lists every problem. `given`: nodes whose objects the caller passes in (saturate.fit:
    "model", "data"), not checked here. The values and their combinations come first and
    import nothing, so that a mistaken number is answered at once; the `_target_` nodes, whose
    check imports their modules (torch with the data's), only once the values are right."""
    try:
        run: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]  # a structured config's object: its dataclass
    except OmegaConfBaseException as e:  # an interpolation that does not resolve, a node removed with ~
        key = getattr(e, "full_key", None) or "config"
        raise ConfigError(
            [Problem(key, given_text(cfg, key), f"a value that resolves ({str(e).splitlines()[0]})")]
        ) from None
    problems = [*_group_problems(cfg, run), *_combination_problems(run)]
    if problems:
        raise ConfigError(problems)
    # the heavy dependencies that the targets' modules import, each timed for the run's start-up line
    import_timed("torch", *(["torchmetrics"] if _builds_metrics(run.task) else []))
    problems = list(_node_problems(run, given))
    if problems:
        raise ConfigError(problems)
    return run


# the built-in tasks whose metrics can all be set to null (task.metrics), with those metrics
NULLABLE_METRICS = {
    "saturate.tasks.Regression": {"mae", "rmse", "r2"},
    "saturate.tasks.regression.Regression": {"mae", "rmse", "r2"},
    "saturate.tasks.Classification": {"acc"},
    "saturate.tasks.classification.Classification": {"acc"},
}


def _builds_metrics(task: dict) -> bool:
    """Whether the run's task will build a torchmetrics metric (then torchmetrics is imported,
    and timed, with torch): all but a built-in regression or classification task whose metrics
    are all set to null (no top_k, no confusion matrix), which never imports it."""
    given = dict(task.get("metrics") or {})
    own = NULLABLE_METRICS.get(str(task.get("_target_")))
    if own is None or any(v is not None for v in given.values()) or task.get("confusion_matrix"):
        return True
    return not own <= set(given) or task.get("top_k", 0) not in (0, None)


def _group_problems(cfg: DictConfig, run: RunConfig) -> Iterator[Problem]:
    """Unknown top-level keys, non-finite numbers, and each group's keys and values."""
    known = [f.name for f in dataclasses.fields(RunConfig)]
    yield from (
        Problem(str(key), cfg[key], "one of the top-level keys " + ", ".join(known)) for key in cfg if key not in known
    )
    floats = _floats(OmegaConf.to_container(cfg, resolve=True))
    yield from (Problem(key, value, "a finite number") for key, value in floats if not math.isfinite(value))
    for group in GROUPS:
        fields = [f.name for f in dataclasses.fields(getattr(run, group))]
        if group not in cfg:  # ~group on the command line
            yield Problem(group, "(removed)", f"the {group} node: it cannot be removed; override its keys instead")
            continue
        for key in cfg[group]:  # `+group.key=...` gets past Hydra; a typo should not
            if f"{group}.{key}" in REMOVED:
                yield Problem(f"{group}.{key}", cfg[group][key], REMOVED[f"{group}.{key}"])
            elif key not in fields:
                yield Problem(f"{group}.{key}", cfg[group][key], "one of the keys " + ", ".join(fields))
        for key, value, allowed in getattr(run, group).problems():
            yield Problem(f"{group}.{key}", value, allowed)
    yield from _extra_problems(cfg, run)


NOT_A_TRIALS = ("hydra.", "tune.", "run_dir", "trainer.resume", "trainer.restart")  # where and how a run starts


def _extra_problems(cfg: DictConfig, run: RunConfig) -> Iterator[Problem]:
    """tune.extra: overrides of keys this config has (a new one with +), of what a trial
    measures; never where or how a run starts (hydra.*, run_dir, resume, restart, tune.*),
    which a trial would silently not take."""
    if "tune" not in cfg or not isinstance(run.tune.extra, list):
        return
    for i, text in enumerate(run.tune.extra):
        for part in str(text).split():
            key = part.split("=", 1)[0]
            bare = key.lstrip("+~")
            if bare.startswith(NOT_A_TRIALS):
                allowed = "overrides of what a trial measures; not hydra.*, tune.*, run_dir, trainer.resume or .restart"
                yield Problem(f"tune.extra[{i}]", text, allowed)
            elif not key.startswith("+") and OmegaConf.select(cfg, bare, default=_ABSENT) is _ABSENT:
                yield Problem(
                    f"tune.extra[{i}]", text, f"overrides of keys the config has ({bare} is not one; +{bare} adds it)"
                )


_ABSENT = object()


def _node_problems(run: RunConfig, given: tuple[str, ...]) -> Iterator[Problem]:
    """The `_target_` nodes: each target imports and takes the keys its node gives."""
    if "data" not in given:
        yield from check_target(run.data, "data", given=())
    if "task" not in given:
        yield from check_target(run.task, "task", given=DATA_ARGUMENTS)
    if "model" not in given:
        yield from check_target(run.model, "model", given=DATA_ARGUMENTS)
    for name, entries in (("logger", run.logger), ("callbacks", run.callbacks)):
        for key, entry in entries.items():
            yield from check_target(entry, f"{name}.{key}", given=())
    for i, node in enumerate(run.augmentation.transforms):
        yield from check_target(node, f"augmentation.transforms[{i}]", given=())
    yield from _optimizer_problems(dict(run.optim.optimizer), list(run.optim.param_groups))
    yield from _optimizers_problems(run.optim.optimizers, run.optim.param_groups)
    if run.optim.scheduler is not None:
        yield from check_target(run.optim.scheduler, "optim.scheduler", given=("optimizer",))
        yield from scheduler_problems(run.optim.scheduler)
    if run.mix.transform is not None:
        yield from check_target(run.mix.transform, "mix.transform", given=())


def _optimizer_problems(node: dict, groups: list) -> Iterator[Problem]:
    """optim.optimizer's keys (one that the chosen class does not take most often came with the
    preset the node started from: nesterov with optim.optimizer._target_=torch.optim.RMSprop);
    then its values and each parameter group's, as its class judges them."""
    found = False
    for problem in check_target(node, "optim.optimizer", given=("params",)):
        found = True
        if "an argument of" in problem.allowed:
            problem = Problem(
                problem.key,
                problem.value,
                problem.allowed + "; a key of the preset it came from: choose the optimizer's own preset "
                "(optim=adam|adamw|rmsprop|sgd), or optim=custom optim.optimizer._target_=<class>",
            )
        yield problem
    if not found:
        yield from optimizer_problems(node, groups)


def _optimizers_problems(optimizers, groups: list) -> Iterator[Problem]:
    """optim.optimizers: null, or each a name with `params` (a submodule or parameter
    patterns), an `optimizer` node and maybe a `scheduler` node."""
    if optimizers is None:
        return
    if not isinstance(optimizers, dict):
        yield Problem("optim.optimizers", optimizers, "null, or a mapping {name: {params, optimizer, scheduler}}")
        return
    allowed = "{params: <a submodule or a parameter pattern, or a list of them>, optimizer: <a node>, scheduler}"
    for name, spec in optimizers.items():
        key = f"optim.optimizers.{name}"
        if not isinstance(spec, dict) or "params" not in spec or "optimizer" not in spec:
            yield Problem(key, spec, allowed)
            continue
        unknown = sorted(set(spec) - {"params", "optimizer", "scheduler"})
        if unknown:
            yield Problem(f"{key}.{unknown[0]}", spec[unknown[0]], "params, optimizer or scheduler")
        params = spec["params"]
        if not (isinstance(params, str) and params or isinstance(params, list) and params):
            yield Problem(f"{key}.params", params, "a submodule's name or a parameter pattern, or a list of them")
        yield from check_target(spec["optimizer"], f"{key}.optimizer", given=("params",))
        if spec.get("scheduler") is not None:
            yield from check_target(spec["scheduler"], f"{key}.scheduler", given=("optimizer",))
    if optimizers and groups:
        yield Problem("optim.param_groups", groups, "[] with optim.optimizers (each optimizer names its params)")


def _combination_problems(run: RunConfig) -> Iterator[Problem]:
    """Settings that are each valid but not together."""
    if run.optim.optimizers:  # a task's own steps: no micro-batches, no ranks, no trial steps
        several = "1 with optim.optimizers (the task takes its own steps: {})"
        if run.trainer.accumulate > 1:
            yield Problem("trainer.accumulate", run.trainer.accumulate, several.format("no micro-batches"))
        if run.trainer.devices not in (1, "auto"):
            yield Problem("trainer.devices", run.trainer.devices, several.format("one process"))
        if run.loader.batch_size == "auto":
            yield Problem("loader.batch_size", "auto", "an integer with optim.optimizers (no trial steps)")
    if run.loader.resident is True and run.augmentation.placement == "cpu":
        allowed = "gpu or none with loader.resident=true (a resident loader has no workers to augment in)"
        yield Problem("augmentation.placement", "cpu", allowed)
    scheduler = (run.optim.scheduler or {}).get("_target_", "") if isinstance(run.optim.scheduler, dict) else ""
    plateau = [k for k, node in run.callbacks.items() if str(node.get("_target_", "")).endswith(".Plateau")]
    if scheduler.endswith("ReduceLROnPlateau") and plateau:
        allowed = f"one plateau rule: optim.scheduler={scheduler} lowers the LR on a plateau already; drop it"
        yield Problem(f"callbacks.{plateau[0]}", "plateau", allowed)
    if run.loader.order == "global" and isinstance(run.trainer.devices, int) and run.trainer.devices > 1:
        allowed = "seeded with trainer.devices > 1 (each rank would draw its own order; their shares could overlap)"
        yield Problem("loader.order", "global", allowed)
    if run.loader.order == "sequential" and run.trainer.limit_val_random:
        allowed = "false with loader.order=sequential (its evaluation reads whole streams in order)"
        yield Problem("trainer.limit_val_random", True, allowed)
    if isinstance(run.loader.batch_size, int) and 1 <= run.loader.batch_size < run.trainer.accumulate:
        allowed = f"at most loader.batch_size ({run.loader.batch_size}): each micro-batch needs a sample"
        yield Problem("trainer.accumulate", run.trainer.accumulate, allowed)
