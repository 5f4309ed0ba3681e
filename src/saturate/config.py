"""Typed schemas for every config group, and the one place they are checked.

The YAML files under conf/ hold values only; the types live here. `RunConfig` is registered
in Hydra's ConfigStore as `base_config` and heads conf/config.yaml's defaults list, so Hydra
checks the type of every value and override while it composes. What a type cannot say
(ranges, choices, combinations) each schema says in `problems()`, and `validate()` collects
every problem into one ConfigError before any data or model work starts.

`data`, `model` and `optim.optimizer` are typed `Any` because their fields depend on the
option chosen: data nodes are checked against the schema named by `data.name`, model and
optimizer nodes against the signature of their `_target_`.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import get_method
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from saturate.distributed import rank_zero, shared_value
from saturate.errors import ConfigError, Problem

# A schema's problems(): (field, bad value, what is allowed), keyed relative to its node.
Issues = Iterator[tuple[str, Any, str]]


def _choice(key: str, value: Any, allowed: tuple) -> Issues:
    if value not in allowed:
        yield key, value, "one of " + ", ".join(map(str, allowed))


def _at_least(key: str, value: Any, low: int | float, extra: str = "") -> Issues:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
        kind = "an integer" if isinstance(low, int) else "a number"
        yield key, value, f"{kind} >= {low}{extra}"


def _int_or_auto(key: str, value: Any, low: int) -> Issues:
    if value != "auto":
        yield from _at_least(key, value, low, " or 'auto'")


def _unit_interval(key: str, value: float, *, open_low: bool = False) -> Issues:
    ok = (0 < value <= 1) if open_low else (0 <= value <= 1)
    if not ok:
        yield key, value, "a number in (0, 1]" if open_low else "a probability in [0, 1]"


@dataclass
class DeviceConfig:
    type: str = "auto"  # auto: CUDA when present, else CPU
    index: int = 0  # CUDA device index, counted within CUDA_VISIBLE_DEVICES
    tf32: bool = True  # TF32 matmuls and convolutions on Ampere and newer
    cudnn_benchmark: bool = True
    memory_fraction: float = 1.0  # cap on this process's share of device memory

    def problems(self) -> Issues:
        yield from _choice("type", self.type, ("auto", "cpu", "cuda"))
        yield from _at_least("index", self.index, 0)
        yield from _unit_interval("memory_fraction", self.memory_fraction, open_low=True)


@dataclass
class PrecisionConfig:
    mode: str = "auto"

    def problems(self) -> Issues:
        yield from _choice("mode", self.mode, ("auto", "amp", "bf16", "fp16", "fp32"))


@dataclass
class LoaderConfig:
    batch_size: Any = 128  # per device: an integer, or "auto" (see batch_search)
    num_workers: Any = "auto"  # an integer, or "auto" (see README: loader)
    pin_memory: Any = "auto"  # true/false, or "auto": when the device is CUDA
    persistent_workers: bool = False
    prefetch_factor: int = 2  # batches each worker keeps ready
    non_blocking: bool = True  # asynchronous host-to-device copies
    drop_last: bool = True  # training only; evaluation sees every sample
    timeout_s: float = 300.0  # a worker that delivers no batch for this long is an error (0: wait forever)
    resident: bool = False  # hold the whole data set on the device; batches are index slices
    resident_memory_fraction: float = 0.5  # most of the device's free memory the data may take

    def problems(self) -> Issues:
        yield from _int_or_auto("batch_size", self.batch_size, 1)
        yield from _int_or_auto("num_workers", self.num_workers, 0)
        if self.pin_memory not in (True, False, "auto"):
            yield "pin_memory", self.pin_memory, "true, false or 'auto'"
        yield from _at_least("prefetch_factor", self.prefetch_factor, 1)
        yield from _unit_interval("resident_memory_fraction", self.resident_memory_fraction, open_low=True)
        yield from _at_least("timeout_s", self.timeout_s, 0.0, " (0: no timeout)")


@dataclass
class StageConfig:
    from_epoch: int = 0
    preset: str = "standard"


@dataclass
class AugmentationConfig:
    placement: str = "none"  # none | cpu (per sample, in the workers) | gpu (batched, on the device)
    preset: str = "standard"  # minimal | standard | strong (see saturate.augment.PRESETS)
    schedule: list[StageConfig] = field(default_factory=list)  # by epoch; replaces `preset`
    # Set any of these to override the preset (every stage of a schedule):
    hflip: float | None = None  # probability
    rotation: float | None = None  # degrees
    brightness: float | None = None  # offset range, [0, 1]
    contrast: float | None = None  # factor range, [0, 1]
    translate: float | None = None  # shift range as a share of the size, [0, 0.5]
    erasing: float | None = None  # probability
    preview_images: int = 32  # augmented training images shown in TensorBoard per policy

    def problems(self) -> Issues:
        from saturate.augment import PRESETS  # noqa: PLC0415 (keeps kornia out of config imports)

        yield from _choice("placement", self.placement, ("none", "cpu", "gpu"))
        yield from _choice("preset", self.preset, tuple(PRESETS))
        for key in ("hflip", "erasing"):
            if getattr(self, key) is not None:
                yield from _unit_interval(key, getattr(self, key))
        if self.rotation is not None:
            yield from _at_least("rotation", self.rotation, 0.0, " (degrees)")
        for key, high in (("brightness", 1.0), ("contrast", 1.0), ("translate", 0.5)):
            value = getattr(self, key)
            if value is not None and not 0 <= value <= high:
                yield key, value, f"a number in [0, {high}]"
        for i, stage in enumerate(self.schedule):
            yield from _choice(f"schedule[{i}].preset", stage.preset, tuple(PRESETS))
        starts = [stage.from_epoch for stage in self.schedule]
        if starts and (starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts))):
            yield "schedule", [f"from_epoch={e}" for e in starts], "stages ordered by from_epoch, strictly increasing, the first at 0"
        yield from _at_least("preview_images", self.preview_images, 0)


@dataclass
class OptimConfig:
    optimizer: Any = MISSING  # a `_partial_: true` node, called with the parameters
    schedule: str = "cosine"  # cosine (to min_lr_ratio) or constant, after the warmup
    warmup_epochs: float = 1.0  # linear warmup from 0.1 x lr
    min_lr_ratio: float = 0.0
    lr_scaling: str = "none"  # none | linear | sqrt: lr x (global batch / base_batch_size) ^ (1 or 1/2)
    base_batch_size: int = 128  # the global batch size the optimizer's lr is meant for

    def problems(self) -> Issues:
        yield from _choice("schedule", self.schedule, ("cosine", "constant"))
        yield from _choice("lr_scaling", self.lr_scaling, ("none", "linear", "sqrt"))
        yield from _at_least("base_batch_size", self.base_batch_size, 1)
        yield from _at_least("warmup_epochs", self.warmup_epochs, 0.0)
        yield from _unit_interval("min_lr_ratio", self.min_lr_ratio)


@dataclass
class TrainerConfig:
    max_epochs: int = 30
    max_steps: int = -1  # optimizer steps; -1: no limit
    eval_interval: int = 1  # epochs; the last epoch is always evaluated
    checkpoint_interval: int = 1  # epochs; the last epoch is always saved
    log_interval: int = 10  # steps between logged (host-synchronised) metrics
    seed: int = 0
    deterministic: bool = False  # deterministic kernels; bit-exact resume on CPU
    compile: bool = False  # torch.compile; falls back to eager with one warning
    channels_last: bool = False
    grad_clip: float = 0.0  # max gradient norm; 0: no clipping
    accumulate: int = 1  # compute each batch in this many micro-batches (same optimizer batch, less memory)
    limit_train_batches: int = -1  # per epoch; -1: all (debugging)
    limit_val_batches: int = -1
    detect_anomaly: bool = False  # autograd anomaly detection (slow; debugging)
    progress: bool = True  # progress bar
    log_level: str = "INFO"
    resume: str | None = None  # "auto" (newest checkpoint in this run dir), a .pt file or a run dir
    skip_nonfinite: bool = True  # skip steps with a non-finite loss/gradient (one host read per step)
    max_nonfinite_steps: int = 10  # this many in a row stop the run
    sync_batchnorm: bool = False  # under DDP on GPUs: BatchNorm statistics over the global batch
    profile: bool = False  # record a torch.profiler trace of a few steady-state steps
    profile_wait: int = 5  # steps before the trace (warm-up: compilation, workers, caches)
    profile_steps: int = 5  # steps in the trace

    def problems(self) -> Issues:
        yield from _at_least("max_epochs", self.max_epochs, 1)
        if self.max_steps != -1:
            yield from _at_least("max_steps", self.max_steps, 1, " or -1")
        for key in ("eval_interval", "checkpoint_interval", "log_interval"):
            yield from _at_least(key, getattr(self, key), 1)
        yield from _at_least("grad_clip", self.grad_clip, 0.0)
        yield from _at_least("accumulate", self.accumulate, 1)
        for key in ("limit_train_batches", "limit_val_batches"):
            if getattr(self, key) != -1:
                yield from _at_least(key, getattr(self, key), 1, " or -1")
        yield from _choice("log_level", self.log_level, ("DEBUG", "INFO", "WARNING", "ERROR"))
        yield from _at_least("max_nonfinite_steps", self.max_nonfinite_steps, 1)
        yield from _at_least("profile_wait", self.profile_wait, 0)
        yield from _at_least("profile_steps", self.profile_steps, 1)


@dataclass
class MonitorConfig:
    enabled: bool = True  # sample GPU (NVML) and CPU (psutil) use in a background thread
    interval_s: float = 1.0

    def problems(self) -> Issues:
        if self.interval_s <= 0:
            yield "interval_s", self.interval_s, "a number of seconds > 0"


@dataclass
class BatchSearchConfig:
    """How loader.batch_size=auto searches (see saturate.batch_size)."""

    min: int = 16  # first candidate
    max: int = 4096  # never above this, nor above the training set
    steps: int = 3  # timed training steps per candidate, after one warm-up step
    min_gain: float = 0.05  # stop growing when samples/s improves by this share or less
    safety: float = 0.9  # after an out-of-memory: at most this share of the largest size that fit
    cache: str = "outputs/batch_size_cache.json"  # earlier choices, reused for the same key; "" disables

    def problems(self) -> Issues:
        yield from _at_least("min", self.min, 1)
        if self.max < self.min:
            yield "max", self.max, f"an integer >= batch_search.min ({self.min})"
        yield from _at_least("steps", self.steps, 1)
        yield from _at_least("min_gain", self.min_gain, 0.0)
        yield from _unit_interval("safety", self.safety, open_low=True)


@dataclass
class CheckpointConfig:
    monitor: str = "val/acc"  # the metric best.pt (and top_k) is chosen by
    mode: str = "max"  # max or min
    top_k: int = 1  # > 1: also keep the k best as top-<epoch>-<step>.pt
    every_n_steps: int = 0  # > 0: also save last.pt every n steps (mid-epoch resume points)

    def problems(self) -> Issues:
        yield from _choice("monitor", self.monitor, ("val/acc", "val/loss", "train/loss"))
        yield from _choice("mode", self.mode, ("max", "min"))
        yield from _at_least("top_k", self.top_k, 1)
        yield from _at_least("every_n_steps", self.every_n_steps, 0)


# --- data: one schema per option, chosen by `data.name` ---------------------------------


@dataclass
class DigitsData:
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes)."""

    name: str = "digits"
    val_fraction: float = 0.2  # stratified; the split is fixed by split_seed
    split_seed: int = 0

    def problems(self) -> Issues:
        if not 0 < self.val_fraction < 1:
            yield "val_fraction", self.val_fraction, "a number in (0, 1)"


@dataclass
class SyntheticData:
    """Random images with a learnable class signal, for throughput work only."""

    name: str = "synthetic"
    num_train: int = 8192
    num_val: int = 1024
    channels: int = 3
    height: int = 32
    width: int = 32
    num_classes: int = 10
    seed: int = 0

    def problems(self) -> Issues:
        for key in ("num_train", "num_val", "channels", "height", "width"):
            yield from _at_least(key, getattr(self, key), 1)
        yield from _at_least("num_classes", self.num_classes, 2)


@dataclass
class Cifar10Data:
    """CIFAR-10's python-pickle batches, read from a local folder (never downloaded)."""

    name: str = "cifar10"
    root: str = "data/cifar-10-batches-py"  # relative paths start at the working directory

    def problems(self) -> Issues:
        return iter(())  # whether the files are there is checked when they are read


@dataclass
class ImageFolderData:
    """Class sub-folders of image files, decoded with PIL (per sample, in the workers)."""

    name: str = "image_folder"
    root: str = "data/images"
    image_size: int = 32  # every image is resized to image_size x image_size
    channels: int = 3  # 3: RGB, 1: greyscale
    val_fraction: float = 0.2  # when root has no train/ and val/ sub-folders
    split_seed: int = 0
    strict: bool = False  # true: the first unreadable file is an error, not a warning

    def problems(self) -> Issues:
        yield from _at_least("image_size", self.image_size, 1)
        yield from _choice("channels", self.channels, (1, 3))
        if not 0 < self.val_fraction < 1:
            yield "val_fraction", self.val_fraction, "a number in (0, 1)"


DATA_SCHEMAS: dict[str, type] = {"digits": DigitsData, "synthetic": SyntheticData, "cifar10": Cifar10Data, "image_folder": ImageFolderData}


@dataclass
class RunConfig:
    device: DeviceConfig = field(default_factory=DeviceConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    augmentation: AugmentationConfig = field(default_factory=AugmentationConfig)
    model: Any = MISSING  # `_target_` node: built with in_channels and num_classes
    data: Any = MISSING  # checked against DATA_SCHEMAS[data.name]
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    batch_search: BatchSearchConfig = field(default_factory=BatchSearchConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    run_dir: str = MISSING  # Hydra's output dir for this job


ConfigStore.instance().store(name="base_config", node=RunConfig)


def _run_stamp() -> str:
    """The run directory's name below outputs/runs: date/time to the microsecond, so two runs
    started in the same second still get directories of their own. Under torchrun, rank 0's
    (every rank resolves it before the run starts): one directory per run."""
    return shared_value(lambda: datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f"))


def _rank_suffix() -> str:
    """ "" on rank 0, ".rank<r>" on the others (their log files in the shared run dir)."""
    return "" if rank_zero() else f".rank{os.environ.get('RANK')}"


OmegaConf.register_new_resolver("saturate_stamp", _run_stamp, use_cache=True, replace=True)
OmegaConf.register_new_resolver("saturate_rank_suffix", _rank_suffix, use_cache=True, replace=True)
OmegaConf.register_new_resolver("saturate_hydra_subdir", lambda: ".hydra" if rank_zero() else None, use_cache=True, replace=True)

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _typed_node(schema: type, node: dict, prefix: str, problems: list[Problem]) -> Any:
    """Build `schema` from a plain dict, recording unknown keys and wrong types."""
    typed = OmegaConf.structured(schema)
    fields = typing.get_type_hints(schema)
    for key, value in node.items():
        if key not in fields:
            problems.append(Problem(f"{prefix}.{key}", value, "one of the keys " + ", ".join(fields)))
            continue
        try:
            typed[key] = value  # OmegaConf's own conversion: "3" -> 3, "true" -> True
        except OmegaConfBaseException:
            problems.append(Problem(f"{prefix}.{key}", value, _TYPE_WORDS[fields[key]]))
    return OmegaConf.to_object(typed)


def _check_target(node: dict, prefix: str, given: tuple[str, ...]) -> Iterator[Problem]:
    """A `_target_` node: the target imports, and every key is one of its parameters."""
    target = node.get("_target_")
    try:
        fn = get_method(target) if isinstance(target, str) else None
    except Exception:
        fn = None
    if fn is None:
        yield Problem(f"{prefix}._target_", target, "an importable class or function")
        return
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    allowed = [name for name in params if name not in given and name != "params"]
    for key, value in node.items():
        if not key.startswith("_") and key not in params:
            yield Problem(f"{prefix}.{key}", value, f"an argument of {target}: " + ", ".join(allowed))


def validate(cfg: DictConfig) -> RunConfig:
    """Check the whole composed config; raise one ConfigError that lists every problem."""
    problems: list[Problem] = []
    run: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    for group in ("device", "precision", "loader", "augmentation", "optim", "trainer", "checkpoint", "batch_search", "monitor"):
        fields = [f.name for f in dataclasses.fields(getattr(run, group))]
        for key in cfg[group]:  # `+group.key=...` gets past Hydra; a typo should not
            if key not in fields:
                problems.append(Problem(f"{group}.{key}", cfg[group][key], "one of the keys " + ", ".join(fields)))
        for key, value, allowed in getattr(run, group).problems():
            problems.append(Problem(f"{group}.{key}", value, allowed))

    data = dict(run.data)
    schema = DATA_SCHEMAS.get(data.get("name"))
    if schema is None:
        problems.append(Problem("data.name", data.get("name"), "one of " + ", ".join(DATA_SCHEMAS)))
    else:
        run.data = _typed_node(schema, data, "data", problems)
        problems += [Problem(f"data.{k}", v, a) for k, v, a in run.data.problems()]

    if run.loader.resident and run.augmentation.placement == "cpu":
        problems.append(
            Problem(
                "augmentation.placement", "cpu", "gpu or none with loader.resident=true (a resident loader has no workers to augment in)"
            )
        )
    problems += _check_target(dict(run.model), "model", given=("in_channels", "num_classes"))
    problems += _check_target(dict(run.optim.optimizer), "optim.optimizer", given=("params",))

    if problems:
        raise ConfigError(problems)
    return run
