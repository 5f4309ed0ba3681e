"""The typed schema of each config group (device, precision, loader, ... tune), with what a
type cannot say (ranges, choices) in its `problems()`. saturate.config.schema puts them
together as the RunConfig and checks them all at once."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from saturate import names
from saturate.config.checks import Issues, at_least, choice, int_or_auto, unit_interval
from saturate.config.policy import PRESETS
from saturate.errors import ConfigError, Problem, UserError, is_number

MAX_SEED = 2**32 - 1


@dataclass
class DeviceConfig:
    type: str = "auto"  # auto: CUDA when present, else CPU
    index: int = 0  # CUDA device index, counted within CUDA_VISIBLE_DEVICES
    tf32: bool = True  # TF32 matmuls and convolutions on Ampere and newer
    cudnn_benchmark: Any = "auto"  # true/false, or "auto": when the samples have fixed shapes (no retuning per length)
    memory_fraction: float = 1.0  # cap on this process's share of device memory
    # glibc malloc keeps freed blocks up to 32 MiB (no page faults per step; saturate.components.device)
    keep_host_memory: bool = True
    threads: Any = "auto"  # torch's intra-op CPU threads: an integer, or auto (SLURM's CPUs per task, else torch's)

    def problems(self) -> Issues:
        yield from choice("type", self.type, ("auto", "cpu", "cuda"))
        yield from int_or_auto("threads", self.threads, 1)
        yield from at_least("index", self.index, 0)
        yield from unit_interval("memory_fraction", self.memory_fraction, open_low=True)
        if self.cudnn_benchmark not in (True, False, "auto"):
            yield "cudnn_benchmark", self.cudnn_benchmark, "true, false or 'auto' (when the samples have fixed shapes)"


@dataclass
class PrecisionConfig:
    mode: str = "auto"
    init_scale: float = 65536.0  # fp16: GradScaler's first loss scale (halved after each overflowing step, skipped)

    def problems(self) -> Issues:
        yield from choice("mode", self.mode, ("auto", "amp", "bf16", "fp16", "fp32"))
        if self.init_scale < 1:  # inf and NaN: every float key's own check
            yield "init_scale", self.init_scale, "a finite number >= 1"


ORDERS = ("seeded", "global", "sequential")  # loader.order (saturate.data.samplers)


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
    # DataLoader(shuffle=True) draws it: with the same seed, model and optimizer, a port of a plain loop reproduces it.
    # sequential: batch_size streams read in order, each batch the next sample of each (a data set of consecutive
    # windows, `stream = True`: truncated BPTT, stateful RNNs), evaluation likewise with eval_batch_size streams
    order: str = "seeded"
    eval_batch_size: int | None = None  # validation and test; null: batch_size

    def problems(self) -> Issues:
        yield from int_or_auto("batch_size", self.batch_size, 1)
        yield from choice("order", self.order, ORDERS)
        if self.eval_batch_size is not None:
            yield from at_least("eval_batch_size", self.eval_batch_size, 1, " or null (batch_size)")
        yield from int_or_auto("num_workers", self.num_workers, 0)
        if self.pin_memory not in (True, False, "auto"):
            yield "pin_memory", self.pin_memory, "true, false or 'auto'"
        if self.resident not in (True, False, "auto"):
            yield "resident", self.resident, "true, false or 'auto'"
        yield from at_least("prefetch_factor", self.prefetch_factor, 1)
        yield from unit_interval("resident_memory_fraction", self.resident_memory_fraction, open_low=True)
        yield from at_least("timeout_s", self.timeout_s, 0.0, " (0: no timeout)")


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
        yield from choice("placement", self.placement, ("none", "cpu", "gpu"))
        yield from choice("preset", self.preset, presets)
        for key in ("hflip", "erasing"):
            if getattr(self, key) is not None:
                yield from unit_interval(key, getattr(self, key))
        if self.rotation is not None and not 0 <= self.rotation <= 180:  # the same limit for both placements
            yield "rotation", self.rotation, "a number of degrees in [0, 180]"
        for key, high in (("brightness", 1.0), ("contrast", 1.0), ("translate", 0.5)):
            value = getattr(self, key)
            if value is not None and not 0 <= value <= high:
                yield key, value, f"a number in [0, {high}]"
        for i, stage in enumerate(self.schedule):
            yield from choice(f"schedule[{i}].preset", stage.preset, presets)
        starts = [stage.from_epoch for stage in self.schedule]
        if starts and (starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts))):
            yield (
                "schedule",
                [f"from_epoch={e}" for e in starts],
                "stages ordered by from_epoch, strictly increasing, the first at 0",
            )
        yield from at_least("preview_images", self.preview_images, 0)


@dataclass
class OptimConfig:
    optimizer: Any = MISSING  # a `_partial_: true` node, called with the parameters
    schedule: str = "cosine"  # cosine (to min_lr_ratio) or constant, after the warmup
    # any torch.optim.lr_scheduler class as a `_partial_: true` node (called with the optimizer); replaces `schedule`
    scheduler: Any = None
    scheduler_interval: str = "epoch"  # epoch | step: when optim.scheduler steps (ReduceLROnPlateau: each evaluation)
    # a linear warm-up over this many epochs (on top of optim.scheduler too); null: 1 epoch, unless warmup_steps is set
    warmup_epochs: float | None = None
    warmup_steps: int | None = None  # the warm-up counted in optimizer steps instead (not beside warmup_epochs)
    warmup_start_factor: float = 0.1  # the LR's factor at the warm-up's first step, rising linearly to 1
    decay_steps: int | None = None  # the cosine reaches min_lr_ratio at this optimizer step and stays; null: the end
    min_lr_ratio: float = 0.0
    lr_scaling: str = "none"  # none | linear | sqrt: lr x (global batch / base_batch_size) ^ (1 or 1/2)
    base_batch_size: int = 128  # the global batch size the optimizer's lr is meant for
    # [{params: "backbone.*", lr: 1e-4, ...}]: parameters by name pattern and their own hyperparameters; the rest
    # (and a group's norms and biases, unless it sets weight_decay) as the optimizer node says
    param_groups: list[Any] = field(default_factory=list)
    # several optimizers, for a task with training_step (a GAN): {name: {params, optimizer, scheduler}} (schema.py);
    # null: one, optim.optimizer
    optimizers: Any = None

    def problems(self) -> Issues:
        yield from choice("schedule", self.schedule, ("cosine", "constant"))
        yield from choice("scheduler_interval", self.scheduler_interval, ("epoch", "step"))
        yield from choice("lr_scaling", self.lr_scaling, ("none", "linear", "sqrt"))
        yield from at_least("base_batch_size", self.base_batch_size, 1)
        if self.warmup_epochs is not None:
            yield from at_least("warmup_epochs", self.warmup_epochs, 0.0)
        yield from self.recipe_problems()
        yield from unit_interval("min_lr_ratio", self.min_lr_ratio)
        for i, group in enumerate(self.param_groups):
            patterns = group.get("params") if isinstance(group, dict) else None
            if not (isinstance(patterns, str) or (isinstance(patterns, list) and patterns)):
                allowed = "a mapping with `params` (a name pattern or a list of them) and the group's hyperparameters"
                yield f"param_groups[{i}]", group, allowed

    def recipe_problems(self) -> Issues:
        """The warm-up in steps (not beside one in epochs), its start factor, and the cosine's
        length (the built-in cosine's only, past the warm-up)."""
        if self.warmup_steps is not None:
            yield from at_least("warmup_steps", self.warmup_steps, 0)
            if self.warmup_epochs:  # 0: no warm-up in epochs
                allowed = f"unset beside optim.warmup_epochs={self.warmup_epochs} (one warm-up: in steps or in epochs)"
                yield "warmup_steps", self.warmup_steps, allowed
        if not 0 <= self.warmup_start_factor <= 1:
            yield "warmup_start_factor", self.warmup_start_factor, "a number in [0, 1] (the LR's factor at step 0)"
        if self.decay_steps is None:
            return
        yield from at_least("decay_steps", self.decay_steps, 1)
        if self.scheduler is not None:
            yield "decay_steps", self.decay_steps, "unset: optim.scheduler is set, and has its own length"
        elif self.schedule == "constant":
            yield "decay_steps", self.decay_steps, "unset: optim.schedule=constant does not decay"
        elif isinstance(self.warmup_steps, int) and 0 < self.decay_steps <= self.warmup_steps:
            allowed = f"an optimizer step after the warm-up's {self.warmup_steps} (optim.warmup_steps)"
            yield "decay_steps", self.decay_steps, allowed


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
        yield from unit_interval("prob", self.prob)
        yield from unit_interval("switch_prob", self.switch_prob)


@dataclass
class TrainerConfig:
    max_epochs: int = 30
    max_steps: int = -1  # optimizer steps; -1: no limit
    eval_interval: int = 1  # epochs; the last epoch is always evaluated
    # inside the epoch: every N optimizer steps (an integer), or a fraction of an epoch (0 < x < 1); 0: by epochs
    eval_every: float = 0
    eval_test: bool = False  # also evaluate the test split at every evaluation (test/* at each step)
    # last.pt at the end of every N-th epoch, or "auto": at an epoch's end once a minute of wall time has passed since
    # the last save (saturate.checkpoint.checkpointer.Cadence); the last epoch and a stop always save, and best.pt
    # always holds the best evaluation
    checkpoint_interval: Any = "auto"
    log_interval: int = 10  # steps between logged (host-synchronised) metrics
    seed: int = 0
    deterministic: bool = False  # deterministic kernels; bit-exact resume on CPU
    compile: bool = False  # torch.compile; falls back to eager with one warning
    channels_last: bool = False
    grad_clip: float = 0.0  # max gradient norm; 0: no clipping
    accumulate: int = 1  # compute each batch in this many micro-batches (same optimizer batch, less memory)
    limit_train_batches: int = -1  # per epoch; -1: all (debugging)
    limit_val_batches: int = -1
    # the limit_val_batches batches drawn at random from the split at each evaluation (nanoGPT's estimate_loss),
    # instead of its first ones
    limit_val_random: bool = False
    # at each evaluation, this many batches drawn at random from the training set, evaluated as validation is
    # (no augmentation) and logged as train_est/*; 0: none
    train_est_batches: int = 0
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
        yield from at_least("max_epochs", self.max_epochs, 1)
        if not 0 <= self.seed <= MAX_SEED:
            yield "seed", self.seed, f"an integer in [0, {MAX_SEED}] (what every generator accepts)"
        if self.max_steps != -1:
            yield from at_least("max_steps", self.max_steps, 1, " or -1")
        for key in ("eval_interval", "log_interval"):
            yield from at_least(key, getattr(self, key), 1)
        every = self.checkpoint_interval
        if every != "auto" and not (is_number(every, 1) and float(every).is_integer()):
            yield "checkpoint_interval", every, "an integer >= 1 (every N-th epoch) or 'auto' (by wall time)"
        every = self.eval_every
        if not (every == 0 or 0 < every < 1 or (every >= 1 and float(every).is_integer())):
            yield (
                "eval_every",
                every,
                "0 (by epochs), a whole number of steps >= 1, or a fraction of an epoch in (0, 1)",
            )
        yield from at_least("grad_clip", self.grad_clip, 0.0)
        yield from at_least("accumulate", self.accumulate, 1)
        for key in ("limit_train_batches", "limit_val_batches"):
            if getattr(self, key) != -1:
                yield from at_least(key, getattr(self, key), 1, " or -1")
        if self.limit_val_random and self.limit_val_batches == -1:
            yield "limit_val_random", True, "false, or true with trainer.limit_val_batches=N (the batches drawn)"
        yield from at_least("train_est_batches", self.train_est_batches, 0, " (0: none)")
        yield from choice("log_level", self.log_level, ("DEBUG", "INFO", "WARNING", "ERROR"))
        yield from at_least("max_nonfinite_steps", self.max_nonfinite_steps, 1)
        yield from int_or_auto("devices", self.devices, 1)
        yield from at_least("profile_wait", self.profile_wait, 0)
        yield from at_least("profile_steps", self.profile_steps, 1)
        if self.predict is not None:
            yield from choice("predict", self.predict, ("val", "test"))
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
    """How loader.batch_size=auto searches (see saturate.components.batch_size)."""

    min: int = 16  # first candidate
    max: int = 4096  # never above this, nor above the training set
    steps: int = 3  # timed training steps per candidate, after one warm-up step
    repeats: int = 3  # each size that fits is measured this many times, interleaved: the median decides
    min_gain: float = 0.05  # stop growing when samples/s improves by this share or less
    safety: float = 0.9  # after an out-of-memory: at most this share of the largest size that fit
    cache: str = "outputs/batch_size_cache.json"  # earlier choices, reused for the same key; "" disables

    def problems(self) -> Issues:
        yield from at_least("min", self.min, 1)
        if self.max < self.min:
            yield "max", self.max, f"an integer >= batch_search.min ({self.min})"
        yield from at_least("steps", self.steps, 1)
        yield from at_least("repeats", self.repeats, 1)
        yield from at_least("min_gain", self.min_gain, 0.0)
        yield from unit_interval("safety", self.safety, open_low=True)


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
    # the whole tune, trials and their set-up included; auto: 120 s, or 600 s with a target (the runs to it over seeds)
    budget_s: Any = "auto"
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
        if self.budget_s != "auto":
            yield from at_least("budget_s", self.budget_s, 1.0, " or 'auto'")
        if not self.trial_s > 0:
            yield "trial_s", self.trial_s, "a number of seconds > 0"
        yield from at_least("min_gain", self.min_gain, 0.0)
        yield from at_least("target_seeds", self.target_seeds, 1)
        for i, name in enumerate(self.allow):
            yield from choice(f"allow[{i}]", name, TUNABLE)
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
        yield from choice("mode", self.mode, ("auto", "max", "min"))
        if self.monitor in (names.TRAIN_LOSS, names.VAL_LOSS) and self.mode == "max":
            yield "mode", self.mode, f"min or auto for checkpoint.monitor={self.monitor} (lower is better)"
        yield from at_least("top_k", self.top_k, 1)
        yield from at_least("every_n_steps", self.every_n_steps, 0)

    def resolved(self, task, has_val: bool) -> CheckpointConfig:
        """monitor and mode with `auto` replaced by what the task and the data decide; a
        metric the task does not log, or a mode against its direction, is a ConfigError."""
        if self.monitor == "auto":
            monitor = names.TRAIN_LOSS if not has_val else (f"val/{task.main}" if task.main else names.VAL_LOSS)
        else:
            monitor = self.monitor
        logged = (names.TRAIN_LOSS, *((f"val/{name}" for name in ("loss", *evaluated(task))) if has_val else ()))
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
        logged = tuple(f"val/{name}" for name in ("loss", *evaluated(task))) if has_val else ()
        if self.metric not in logged:
            allowed = (
                f"a metric an evaluation logs: {', '.join(logged)}" if logged else "none: there is no validation set"
            )
            raise ConfigError([Problem("target.metric", self.metric, allowed)])
        return self.metric, "min" if self.metric.endswith("/loss") else task.better(self.metric.split("/", 1)[1])


def evaluated(task) -> tuple[str, ...]:
    """The bare names an evaluation logs for `task` (a per-class metric as its elements): its
    `logged()`, or its `names()` where a user's task has no `logged`."""
    logged = getattr(task, "logged", None)
    return tuple(logged()) if callable(logged) else tuple(task.names())
