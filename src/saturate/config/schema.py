"""Typed schemas for every config group, and the one place they are checked.

The YAML files under conf/ hold values only; the types live here. `RunConfig` is registered
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
import inspect
import itertools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hydra.utils import get_method
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from saturate import names
from saturate.config.data_info import DATA_ARGUMENTS, PLACEHOLDER
from saturate.config.policy import PRESETS
from saturate.errors import ConfigError, Problem, UserError
from saturate.started import import_timed

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
    cudnn_benchmark: Any = "auto"  # true/false, or "auto": when the samples have fixed shapes (no retuning per length)
    memory_fraction: float = 1.0  # cap on this process's share of device memory
    # glibc malloc keeps freed blocks up to 32 MiB (no page faults per step; saturate.parts.device)
    keep_host_memory: bool = True
    threads: Any = "auto"  # torch's intra-op CPU threads: an integer, or auto (SLURM's CPUs per task, else torch's)

    def problems(self) -> Issues:
        yield from _choice("type", self.type, ("auto", "cpu", "cuda"))
        yield from _int_or_auto("threads", self.threads, 1)
        yield from _at_least("index", self.index, 0)
        yield from _unit_interval("memory_fraction", self.memory_fraction, open_low=True)
        if self.cudnn_benchmark not in (True, False, "auto"):
            yield "cudnn_benchmark", self.cudnn_benchmark, "true, false or 'auto' (when the samples have fixed shapes)"


@dataclass
class PrecisionConfig:
    mode: str = "auto"
    init_scale: float = 65536.0  # fp16: GradScaler's first loss scale (halved after each overflowing step, skipped)

    def problems(self) -> Issues:
        yield from _choice("mode", self.mode, ("auto", "amp", "bf16", "fp16", "fp32"))
        if self.init_scale < 1:  # inf and NaN: every float key's own check
            yield "init_scale", self.init_scale, "a finite number >= 1"


ORDERS = ("seeded", "global")  # loader.order (saturate.data.loader.ResumableSampler)


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
    # hold the whole data set on the device, batches as index slices; auto: on a CPU run, for data
    # that is read, not computed (saturate.data.loader.resident_for)
    resident: Any = "auto"
    resident_memory_fraction: float = 0.5  # most of the device's free memory the data may take
    # each epoch's sample order. seeded: a function of trainer.seed and the epoch, whatever else draws random numbers
    # (resumable inside an epoch). global: drawn from torch's global generator as the epoch starts, as a plain
    # DataLoader(shuffle=True) draws it: with the same seed, model and optimizer, a port of a plain loop reproduces it
    order: str = "seeded"

    def problems(self) -> Issues:
        yield from _int_or_auto("batch_size", self.batch_size, 1)
        yield from _choice("order", self.order, ORDERS)
        yield from _int_or_auto("num_workers", self.num_workers, 0)
        if self.pin_memory not in (True, False, "auto"):
            yield "pin_memory", self.pin_memory, "true, false or 'auto'"
        if self.resident not in (True, False, "auto"):
            yield "resident", self.resident, "true, false or 'auto'"
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
    # your own augmentation: `_target_` nodes of Kornia modules; replaces the policy
    transforms: list[Any] = field(default_factory=list)
    preset: str = "standard"  # minimal | standard | strong (see saturate.data.augment.PRESETS)
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
        presets = tuple(PRESETS)
        yield from _choice("placement", self.placement, ("none", "cpu", "gpu"))
        yield from _choice("preset", self.preset, presets)
        for key in ("hflip", "erasing"):
            if getattr(self, key) is not None:
                yield from _unit_interval(key, getattr(self, key))
        if self.rotation is not None and not 0 <= self.rotation <= 180:  # the same limit for both placements
            yield "rotation", self.rotation, "a number of degrees in [0, 180]"
        for key, high in (("brightness", 1.0), ("contrast", 1.0), ("translate", 0.5)):
            value = getattr(self, key)
            if value is not None and not 0 <= value <= high:
                yield key, value, f"a number in [0, {high}]"
        for i, stage in enumerate(self.schedule):
            yield from _choice(f"schedule[{i}].preset", stage.preset, presets)
        starts = [stage.from_epoch for stage in self.schedule]
        if starts and (starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts))):
            yield (
                "schedule",
                [f"from_epoch={e}" for e in starts],
                "stages ordered by from_epoch, strictly increasing, the first at 0",
            )
        yield from _at_least("preview_images", self.preview_images, 0)


@dataclass
class OptimConfig:
    optimizer: Any = MISSING  # a `_partial_: true` node, called with the parameters
    schedule: str = "cosine"  # cosine (to min_lr_ratio) or constant, after the warmup
    # any torch.optim.lr_scheduler class as a `_partial_: true` node (called with the optimizer); replaces `schedule`
    scheduler: Any = None
    scheduler_interval: str = "epoch"  # epoch | step: when optim.scheduler steps (ReduceLROnPlateau: each evaluation)
    warmup_epochs: float = 1.0  # linear warmup from 0.1 x lr (on top of optim.scheduler too)
    min_lr_ratio: float = 0.0
    lr_scaling: str = "none"  # none | linear | sqrt: lr x (global batch / base_batch_size) ^ (1 or 1/2)
    base_batch_size: int = 128  # the global batch size the optimizer's lr is meant for
    # [{params: "backbone.*", lr: 1e-4, ...}]: parameters by name pattern and their own hyperparameters; the rest
    # (and a group's norms and biases, unless it sets weight_decay) as the optimizer node says
    param_groups: list[Any] = field(default_factory=list)

    def problems(self) -> Issues:
        yield from _choice("schedule", self.schedule, ("cosine", "constant"))
        yield from _choice("scheduler_interval", self.scheduler_interval, ("epoch", "step"))
        yield from _choice("lr_scaling", self.lr_scaling, ("none", "linear", "sqrt"))
        yield from _at_least("base_batch_size", self.base_batch_size, 1)
        yield from _at_least("warmup_epochs", self.warmup_epochs, 0.0)
        yield from _unit_interval("min_lr_ratio", self.min_lr_ratio)
        for i, group in enumerate(self.param_groups):
            patterns = group.get("params") if isinstance(group, dict) else None
            if not (isinstance(patterns, str) or (isinstance(patterns, list) and patterns)):
                allowed = "a mapping with `params` (a name pattern or a list of them) and the group's hyperparameters"
                yield f"param_groups[{i}]", group, allowed


@dataclass
class PretrainedConfig:
    """Weights to start from, and layers to keep as they are."""

    path: str | None = None  # a state dict (a .pt of saturate's, or a plain state dict), read as data only
    # key prefixes to replace: {module.: '', net.: encoder.} (a mapping: set whole, as pretrained.rename={...})
    rename: Any = None
    strict: bool = True  # false: missing and unexpected keys are named in a warning, not an error
    freeze: list[str] = field(default_factory=list)  # parameter name patterns to freeze: ["encoder.*"]

    def problems(self) -> Issues:
        if self.rename is not None and not isinstance(self.rename, dict):
            yield "rename", self.rename, "a mapping of key prefixes, {old.: new.} ('' drops a prefix)"
            return
        for old, new in (self.rename or {}).items():
            if not isinstance(new, str):
                yield f"rename.{old}", new, "a key prefix (a string; '' to drop the prefix)"


@dataclass
class MixConfig:
    """Batch transforms of training batches only, on the device: mixup and CutMix (soft
    targets), or your own `(inputs, targets) -> (inputs, targets)`."""

    mixup: float = 0.0  # Beta(alpha, alpha) of the mixing weight; 0: off
    cutmix: float = 0.0  # Beta(alpha, alpha) of the pasted box's area; 0: off
    prob: float = 1.0  # share of training batches mixed
    switch_prob: float = 0.5  # with both on: the share of mixed batches that take CutMix
    transform: Any = None  # your own: a `_target_` node of a callable (inputs, targets) -> (inputs, targets)

    def problems(self) -> Issues:
        for key in ("mixup", "cutmix"):
            value = getattr(self, key)
            if value != 0 and not (isinstance(value, (int, float)) and value > 0):
                yield key, value, "0 (off) or an alpha > 0 (the Beta distribution's parameter)"
        yield from _unit_interval("prob", self.prob)
        yield from _unit_interval("switch_prob", self.switch_prob)


@dataclass
class TrainerConfig:
    max_epochs: int = 30
    max_steps: int = -1  # optimizer steps; -1: no limit
    eval_interval: int = 1  # epochs; the last epoch is always evaluated
    # inside the epoch: every N optimizer steps (an integer), or a fraction of an epoch (0 < x < 1); 0: by epochs
    eval_every: float = 0
    eval_test: bool = False  # also evaluate the test split at every evaluation (test/* at each step)
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
    # a fresh run into a run dir holding an earlier run's checkpoints: delete them first (else refused)
    restart: bool = False
    # val | test: write that split's predictions (best.pt's) to <run dir>/predictions/<split>.npz
    predict: str | None = None
    # skip non-finite steps (decided on the device by a fused optimizer, else one host read per step)
    skip_nonfinite: bool = True
    max_nonfinite_steps: int = 10  # this many in a row stop the run
    sync_batchnorm: bool = False  # under DDP on GPUs: BatchNorm statistics over the global batch
    profile: bool = False  # record a torch.profiler trace of a few steady-state steps
    profile_wait: int = 5  # steps before the trace (warm-up: compilation, workers, caches)
    profile_steps: int = 5  # steps in the trace
    # processes: "auto" (every visible CUDA device; 1 on a CPU) or a number (saturate.scale.launch)
    devices: Any = "auto"

    def problems(self) -> Issues:
        yield from _at_least("max_epochs", self.max_epochs, 1)
        if not 0 <= self.seed <= MAX_SEED:
            yield "seed", self.seed, f"an integer in [0, {MAX_SEED}] (what every generator accepts)"
        if self.max_steps != -1:
            yield from _at_least("max_steps", self.max_steps, 1, " or -1")
        for key in ("eval_interval", "checkpoint_interval", "log_interval"):
            yield from _at_least(key, getattr(self, key), 1)
        every = self.eval_every
        if not (every == 0 or 0 < every < 1 or (every >= 1 and float(every).is_integer())):
            yield (
                "eval_every",
                every,
                "0 (by epochs), a whole number of steps >= 1, or a fraction of an epoch in (0, 1)",
            )
        yield from _at_least("grad_clip", self.grad_clip, 0.0)
        yield from _at_least("accumulate", self.accumulate, 1)
        for key in ("limit_train_batches", "limit_val_batches"):
            if getattr(self, key) != -1:
                yield from _at_least(key, getattr(self, key), 1, " or -1")
        yield from _choice("log_level", self.log_level, ("DEBUG", "INFO", "WARNING", "ERROR"))
        yield from _at_least("max_nonfinite_steps", self.max_nonfinite_steps, 1)
        yield from _int_or_auto("devices", self.devices, 1)
        yield from _at_least("profile_wait", self.profile_wait, 0)
        yield from _at_least("profile_steps", self.profile_steps, 1)
        if self.predict is not None:
            yield from _choice("predict", self.predict, ("val", "test"))
        if self.restart and self.resume:
            yield (
                "restart",
                True,
                f"false with trainer.resume={self.resume} (resume continues a run, restart starts it over)",
            )


@dataclass
class MonitorConfig:
    enabled: bool = True  # sample GPU (NVML) and CPU (psutil) use in a background thread
    interval_s: float = 1.0
    # count a step's FLOPs and launches, and time its batch scaling, after training (a few passes on 8 samples)
    costs: bool = True

    def problems(self) -> Issues:
        if self.interval_s <= 0:
            yield "interval_s", self.interval_s, "a number of seconds > 0"


@dataclass
class BatchSearchConfig:
    """How loader.batch_size=auto searches (see saturate.parts.batch_size)."""

    min: int = 16  # first candidate
    max: int = 4096  # never above this, nor above the training set
    steps: int = 3  # timed training steps per candidate, after one warm-up step
    repeats: int = 3  # each size that fits is measured this many times, interleaved: the median decides
    min_gain: float = 0.05  # stop growing when samples/s improves by this share or less
    safety: float = 0.9  # after an out-of-memory: at most this share of the largest size that fit
    cache: str = "outputs/batch_size_cache.json"  # earlier choices, reused for the same key; "" disables

    def problems(self) -> Issues:
        yield from _at_least("min", self.min, 1)
        if self.max < self.min:
            yield "max", self.max, f"an integer >= batch_search.min ({self.min})"
        yield from _at_least("steps", self.steps, 1)
        yield from _at_least("repeats", self.repeats, 1)
        yield from _at_least("min_gain", self.min_gain, 0.0)
        yield from _unit_interval("safety", self.safety, open_low=True)


# settings that change the optimisation: tune tries them only when tune.allow names them
TUNABLE = (
    "batch_size",
    "precision",
)


@dataclass
class TuneConfig:
    """`tune=true` (shorthand for tune.enabled=true): short measured trials of the settings
    the bottleneck report would suggest, the fastest written as a preset (saturate.tune)."""

    enabled: bool = False
    budget_s: float = 120.0  # the whole tune, trials and their set-up included
    trial_s: float = 4.0  # steady-state seconds each trial measures (after a warm-up of one log window)
    min_gain: float = 0.05  # a setting is kept when samples/s improves by more than this share
    # also try these optimisation-changing settings: batch_size, precision
    allow: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # your own candidates, each "key=value [key=value ...]", tried last
    preset: str = "auto"  # the preset written; auto: <your config dir>/experiment/tuned_<name>.yaml
    cache: str = "outputs/tune_cache.json"  # earlier tunes, reused for the same config and hardware; "" disables
    # with a target: the start and the fastest each trained to it with this many seeds (trainer.seed, +1, ...)
    target_seeds: int = 3

    def problems(self) -> Issues:
        yield from _at_least("budget_s", self.budget_s, 1.0)
        if not self.trial_s > 0:
            yield "trial_s", self.trial_s, "a number of seconds > 0"
        yield from _at_least("min_gain", self.min_gain, 0.0)
        yield from _at_least("target_seeds", self.target_seeds, 1)
        for i, name in enumerate(self.allow):
            yield from _choice(f"allow[{i}]", name, TUNABLE)
        for i, text in enumerate(self.extra):
            if not isinstance(text, str) or not text.strip() or any("=" not in part for part in text.split()):
                yield f"extra[{i}]", text, "overrides as on the command line: 'key=value' or 'key=value key2=value2'"


@dataclass
class CheckpointConfig:
    # the metric best.pt (and top_k) is chosen by; auto: val/acc (classification), val/loss (regression)
    monitor: str = "auto"
    mode: str = "auto"  # max | min | auto: from the metric (max for accuracy and r2, min for losses and errors)
    top_k: int = 1  # > 1: also keep the k best as top-<epoch>-<step>.pt
    every_n_steps: int = 0  # > 0: also save last.pt every n steps (mid-epoch resume points)
    # the saves during training written by a thread beside it (the loop waits only for a copy of the state)
    background: bool = True

    def problems(self) -> Issues:
        if self.monitor != "auto" and not re.fullmatch(r"(train|val)/[\w./-]+", self.monitor):
            yield (
                "monitor",
                self.monitor,
                "auto, or a metric the run logs: train/loss, val/loss or val/<a metric of the task>",
            )
        yield from _choice("mode", self.mode, ("auto", "max", "min"))
        if self.monitor in (names.TRAIN_LOSS, names.VAL_LOSS) and self.mode == "max":
            yield "mode", self.mode, f"min or auto for checkpoint.monitor={self.monitor} (lower is better)"
        yield from _at_least("top_k", self.top_k, 1)
        yield from _at_least("every_n_steps", self.every_n_steps, 0)

    def resolved(self, task, has_val: bool) -> CheckpointConfig:
        """monitor and mode with `auto` replaced by what the task and the data decide; a
        metric the task does not log, or a mode against its direction, is a ConfigError."""
        if self.monitor == "auto":
            monitor = names.TRAIN_LOSS if not has_val else (f"val/{task.main}" if task.main else names.VAL_LOSS)
        else:
            monitor = self.monitor
        logged = (names.TRAIN_LOSS, *((f"val/{name}" for name in ("loss", *task.names())) if has_val else ()))
        removed = getattr(task, "extra", {}).get(monitor.split("/", 1)[-1], "kept") is None
        if monitor not in logged and removed:
            raise ConfigError(
                [
                    Problem(
                        "checkpoint.monitor",
                        monitor,
                        f"a metric the run logs ({', '.join(logged)}): task.metrics.{monitor.split('/', 1)[-1]}=null "
                        "removed it; keep it, or monitor another",
                    )
                ]
            )
        if monitor not in logged and self.monitor == "auto" and has_val:  # the task's own main metric is not logged
            raise UserError(
                f"task: {type(task).__name__}'s main metric {task.main!r} is not among its metrics "
                f"({', '.join(task.names()) or 'none'}); give the task a main it logs, or set checkpoint.monitor"
            )
        if monitor not in logged:
            why = "" if has_val else " (there is no validation set)"
            raise ConfigError(
                [Problem("checkpoint.monitor", monitor, f"auto or a metric the run logs{why}: {', '.join(logged)}")]
            )
        direction = "min" if monitor.endswith("/loss") else task.better(monitor.split("/", 1)[1])
        if self.mode not in ("auto", direction):
            better = "higher" if direction == "max" else "lower"
            allowed = f"{direction} or auto for checkpoint.monitor={monitor} ({better} is better)"
            raise ConfigError([Problem("checkpoint.mode", self.mode, allowed)])
        return dataclasses.replace(self, monitor=monitor, mode=direction)


@dataclass
class TargetConfig:
    """The figure a user trains for: the run records the wall time at which an evaluation
    first met it (time/to_target_s), and may stop there."""

    metric: str | None = None  # a metric an evaluation logs: val/acc, val/loss, val/<a metric of the task>
    value: float | None = None  # met when the metric is at least this (higher is better) or at most this
    stop: bool = False  # stop the run once the target is met (a success: last.pt and best.pt saved)

    def problems(self) -> Issues:
        if self.metric is None and self.value is not None:
            yield "metric", None, f"the metric target.value={self.value:g} is for, e.g. target.metric=val/acc"
        if self.value is None and self.metric is not None:
            yield "value", None, f"the value of {self.metric} to reach, e.g. target.value=0.95"
        elif self.value is not None and not (isinstance(self.value, (int, float)) and math.isfinite(self.value)):
            yield "value", self.value, "a finite number"
        if self.stop and self.metric is None:
            yield "stop", self.stop, "false, or true with target.metric and target.value set"

    def resolved(self, task, has_val: bool) -> tuple[str, str] | None:
        """(the metric, its direction: max or min), or None without a target; a metric no
        evaluation logs is a ConfigError."""
        if self.metric is None:
            return None
        logged = tuple(f"val/{name}" for name in ("loss", *task.names())) if has_val else ()
        if self.metric not in logged:
            allowed = (
                f"a metric an evaluation logs: {', '.join(logged)}" if logged else "none: there is no validation set"
            )
            raise ConfigError([Problem("target.metric", self.metric, allowed)])
        return self.metric, "min" if self.metric.endswith("/loss") else task.better(self.metric.split("/", 1)[1])


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


MAX_SEED = 2**32 - 1
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


def _check_target(node: Any, prefix: str, given: tuple[str, ...]) -> Iterator[Problem]:
    """A `_target_` node: the target imports, and every key is one of its parameters."""
    if not isinstance(node, dict):
        yield Problem(prefix, node, "a node with a `_target_` (an importable callable) and its keyword arguments")
        return
    target = node.get("_target_")
    try:
        fn = get_method(target) if isinstance(target, str) else None
    except Exception:  # noqa: BLE001 (a target that cannot be imported is reported by its own check)
        fn = None
    if fn is None:
        yield Problem(f"{prefix}._target_", target, "an importable class or function")
        return
    try:
        params = _signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return
    allowed = [name for name in params if name not in given and name != "params"]
    if not node.get("_partial_"):  # a complete call: every required argument is in the node
        for name, p in params.items():
            required = p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            if required and name not in node and name not in given:
                yield Problem(f"{prefix}.{name}", "(missing)", f"a value: {target} requires it")
    for key, value in node.items():
        yield from _nested_targets(value, f"{prefix}.{key}")
        if key in params and not key.startswith("_") and not (isinstance(value, str) and value.startswith(PLACEHOLDER)):
            expected = _plain_type(params[key].annotation)
            if expected is not None and not _is(value, expected):
                name = getattr(fn, "__qualname__", None) or str(target)
                yield Problem(
                    f"{prefix}.{key}",
                    value,
                    f"{_A[expected[0]]}{' or null' if None in expected else ''} ({name}'s {key})",
                )
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for key, value in node.items():
        if not key.startswith("_") and key not in params:
            yield Problem(f"{prefix}.{key}", value, f"an argument of {target}: " + ", ".join(allowed))


def _nested_targets(value: Any, prefix: str) -> Iterator[Problem]:
    """`_target_` nodes inside a node's arguments (a task's loss and metrics), checked too."""
    if isinstance(value, dict) and "_target_" in value:
        yield from _check_target(value, prefix, given=())
    elif isinstance(value, dict):
        for key, inner in value.items():
            yield from _nested_targets(inner, f"{prefix}.{key}")
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from _nested_targets(inner, f"{prefix}[{i}]")


_A = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _signature(fn) -> inspect.Signature:
    """fn's signature with its annotations evaluated where they can be (`from __future__
    import annotations` makes them strings)."""
    try:
        return inspect.signature(fn, eval_str=True)
    except Exception:  # noqa: BLE001 (an annotation that does not evaluate: the names alone)
        return inspect.signature(fn)


def _plain_type(annotation) -> tuple | None:
    """(type, maybe None) for an annotation of int, float, bool or str, optionally `| None`;
    None for anything else (not checked here: the callable checks its own values)."""
    import types
    import typing

    if annotation in _A:
        return (annotation,)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = typing.get_args(annotation)
        plain = [m for m in members if m is not type(None)]
        if len(plain) == 1 and plain[0] in _A and len(members) == 2:
            return (plain[0], None)
    return None


def _is(value, expected: tuple) -> bool:
    if value is None:
        return None in expected
    kind = expected[0]
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


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
        run: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as e:  # an interpolation that does not resolve, a node removed with ~
        key = getattr(e, "full_key", None) or "config"
        raise ConfigError(
            [Problem(key, given_text(cfg, key), f"a value that resolves ({str(e).splitlines()[0]})")]
        ) from None
    problems = [*_group_problems(cfg, run), *_combination_problems(run)]
    if problems:
        raise ConfigError(problems)
    # the heavy dependencies that the targets' modules import, each timed for the run's start-up line
    import_timed("torch", "torchmetrics")
    problems = list(_node_problems(run, given))
    if problems:
        raise ConfigError(problems)
    return run


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
        yield from _check_target(run.data, "data", given=())
    if "task" not in given:
        yield from _check_target(run.task, "task", given=DATA_ARGUMENTS)
    if "model" not in given:
        yield from _check_target(run.model, "model", given=DATA_ARGUMENTS)
    for name, entries in (("logger", run.logger), ("callbacks", run.callbacks)):
        for key, entry in entries.items():
            yield from _check_target(entry, f"{name}.{key}", given=())
    for i, node in enumerate(run.augmentation.transforms):
        yield from _check_target(node, f"augmentation.transforms[{i}]", given=())
    yield from _optimizer_problems(dict(run.optim.optimizer))
    if run.optim.scheduler is not None:
        yield from _check_target(run.optim.scheduler, "optim.scheduler", given=("optimizer",))
    if run.mix.transform is not None:
        yield from _check_target(run.mix.transform, "mix.transform", given=())


def _optimizer_problems(node: dict) -> Iterator[Problem]:
    """optim.optimizer's keys; one that the chosen class does not take most often came with the
    preset the node started from (nesterov with optim.optimizer._target_=torch.optim.RMSprop)."""
    for problem in _check_target(node, "optim.optimizer", given=("params",)):
        if "an argument of" in problem.allowed:
            problem = Problem(
                problem.key,
                problem.value,
                problem.allowed + "; a key of the preset it came from: choose the optimizer's own preset "
                "(optim=adam|adamw|rmsprop|sgd), or optim=custom optim.optimizer._target_=<class>",
            )
        yield problem


def _combination_problems(run: RunConfig) -> Iterator[Problem]:
    """Settings that are each valid but not together."""
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
    if isinstance(run.loader.batch_size, int) and 1 <= run.loader.batch_size < run.trainer.accumulate:
        allowed = f"at most loader.batch_size ({run.loader.batch_size}): each micro-batch needs a sample"
        yield Problem("trainer.accumulate", run.trainer.accumulate, allowed)
