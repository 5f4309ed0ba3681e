"""The names of what a run measures: the same in TensorBoard's tags, metrics.json, the report,
the sweep report and every logger. Written here once; code names them by these constants.

A task's metrics are `<split>/<name>` (`val/acc`, `test/rmse`); a per-class value is
`<split>/<name>/<class>`.
"""

from __future__ import annotations

# -- training
TRAIN_LOSS = "train/loss"  # mean loss of the steps since the last log step
TRAIN_LR = "train/lr"  # the first parameter group's learning rate
NONFINITE_STEPS = "train/nonfinite_steps"  # steps skipped as non-finite, so far
MICRO_BATCHES = "train/micro_batches"  # pieces each batch is computed in (accumulation, out-of-memory)
LOSS_SCALE = "train/loss_scale"  # fp16: GradScaler's scale
VAL_LOSS = "val/loss"
TRAIN_EST = "train_est"  # trainer.train_est_batches: training batches evaluated as validation is (train_est/loss)
EPOCH = "progress/epoch"  # epochs done, fractional
STEP = "progress/step"  # optimizer steps done

# -- speed: one step = data wait + copy and device-side preparation + compute
SAMPLES_PER_S = "perf/samples_per_s"  # summed over ranks
STEP_MS = "perf/step_ms"
DATA_WAIT_MS = "perf/data_wait_ms"  # waiting for the loader
DATA_WAIT_FRAC = "perf/data_wait_frac"  # of the step time
COPY_MS = "perf/copy_ms"  # host to device, augmentation and normalisation on the device
COMPUTE_MS = "perf/compute_ms"  # forward, backward, optimizer
ENQUEUE_MS = "perf/enqueue_ms"  # CUDA: the host's time launching a step's work
GPU_IDLE_FRAC = "perf/gpu_idle_frac"  # CUDA: the device idle between steps
GPU_IDLE_DATA_FRAC = "perf/gpu_idle_data_frac"  # ... waiting for data
GPU_IDLE_HOST_FRAC = "perf/gpu_idle_host_frac"  # ... waiting for the host's own work
LAUNCH_BOUND_FRAC = "perf/launch_bound_frac"  # CUDA: steps the host's launches paced

# -- time and memory
WALL_S = "time/wall_s"  # the whole run, start-up included
LOOP_S = "time/loop_s"  # the training loop: steps, evaluation, checkpoints, logging
# from the start: train.py's process start (the interpreter and imports count), or saturate.fit's call
FIRST_STEP_S = "time/first_step_s"  # the end of the first optimizer step
EVAL_AT_S = "time/eval_at_s"  # each evaluation's end
TO_TARGET_S = "time/to_target_s"  # the end of the evaluation that first met target.metric's target.value
TO_TARGET_STEP = "progress/target_step"  # the step of that evaluation
# train.py's first start-up spans: the interpreter to its call of the Hydra app, Hydra's work to the task (the config
# composed twice, the run dir, logging), the imports to the run; one span where those points are not known
# (one tuple: bare words other modules use in their own sense, which the one-place check of names would flag)
INTERPRETER_SPAN, HYDRA_SPAN, IMPORTS_SPAN = "interpreter", "hydra", "imports"
PROCESS_SPAN = "interpreter and imports"  # startup/interpreter_and_imports_s
IMPORTS_PREFIX = "imports/"  # imports/<module>_s: what train.py timed of IMPORTS_SPAN (or PROCESS_SPAN)
PEAK_MB = "memory/peak_mb"  # device (CUDA) or process (CPU) peak memory

# -- resources, sampled in the background (the window's mean at log steps; *_mean over the run)
GPU_UTIL = "gpu/util"
GPU_UTIL_MEAN = "gpu/util_mean"
GPU_UTIL_MIN = "gpu/util_min"
GPU_UTIL_STD = "gpu/util_std"
GPU_UTIL_UNDER_50 = "gpu/util_under_50_frac"
GPU_MEM_USED_MB = "gpu/mem_used_mb"
SM_ACTIVE = "gpu/sm_active"  # NVML GPM, where offered
SM_ACTIVE_MEAN = "gpu/sm_active_mean"
TENSOR_ACTIVE = "gpu/tensor_active"
TENSOR_ACTIVE_MEAN = "gpu/tensor_active_mean"
CPU_UTIL = "cpu/util"  # the host
CPU_UTIL_MEAN = "cpu/util_mean"
PROCESS_UTIL = "cpu/process_util"  # the main process, % of one core
RUN_UTIL = "cpu/run_util"  # the run's process tree (main process and workers)
RUN_UTIL_MEAN = "cpu/run_util_mean"
WORKERS_UTIL = "cpu/workers_util"
WORKERS_UTIL_MEAN = "cpu/workers_util_mean"
OTHER_UTIL = "cpu/other_util"  # other processes on the host
OTHER_UTIL_MEAN = "cpu/other_util_mean"
RSS_MB = "cpu/rss_mb"
WORKERS_RSS_MB = "cpu/workers_rss_mb"

# -- a step's cost, counted once after training (saturate.diagnostics.costs)
FLOPS_PER_STEP = "cost/flops_per_step"
LAUNCHES_PER_STEP = "cost/launches_per_step"
FLOPS_PER_LAUNCH = "cost/flops_per_launch"
ACHIEVED_TFLOPS = "cost/achieved_tflops"
PEAK_TFLOPS = "cost/peak_tflops"
MFU = "cost/mfu"
FIXED_FRAC = "cost/fixed_frac"  # CPU: the share of a step that does not grow with the batch
PER_SAMPLE_MS = "cost/per_sample_ms"
COST_DEVICE = "cost/device"
COST_PROBE_S = "time/cost_probes_s"  # counting them, after training (off the way to the first step)
PROBES_SKIPPED = "cost/probes_skipped"  # the probes that did not fit in their share of the loop's time

# -- other records
SKIPPED_FILES = "data/skipped_files"  # broken files an image folder skipped
PARAMS_IDENTICAL = "distributed/params_identical"  # 1.0: every rank ended with the same weights
BATCH_SEARCH_SAMPLES_PER_S = "batch_search/samples_per_s"  # loader.batch_size=auto's trials, by size
TUNE_SPEEDUP = "tune/speedup"
TUNE_CONFIRMED = "tune/confirmed"
TUNE_TRIALS = "tune/trials"
TUNE_FAILED = "tune/failed"


def split_metric(split: str, name: str) -> str:
    """`<split>/<name>`: a task's metric of one split (val/acc, test/rmse)."""
    return f"{split}/{name}"
