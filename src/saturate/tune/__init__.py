"""`saturate train tune=true [overrides]` (python train.py in the checkout): saturate applies its own advice.

Starting from the user's config, short trials are measured one after another in this
process: each is a real run (`saturate.train`) in `<run dir>/trials/`, stopped once it has
`tune.trial_s` seconds of steady state (every log window after the first) over at least
report.MIN_STEPS steps. The best trial's verdict picks what is tried next, one setting
(a "dimension") at a time, greedily:

- input-bound (or CPU-saturated), balanced, not judged: the input side first (augmentation
  on the device, the data resident, loader workers, persistent workers, prefetch, pinned
  memory), then the compute side;
- compute-bound: the compute side only (on a CPU torch's intra-op thread counts, tried for
  every verdict; channels_last, and on CUDA compile, TF32/cuDNN autotuning; precision and
  batch size when `tune.allow` names them).

A trial's timed window holds no compilation: a log window in which torch.compile compiled a
graph is left out with those before it. A candidate is kept when its samples/s beat the best
so far by more than `tune.min_gain` (the batch search's rule) and by more than the spread of
the two trials' timed windows; one within that spread is measured again, and if still within
it, reported undecided and not kept. An ordered dimension (worker counts) stops at the first
value that does not pay. A trial that fails, diverges or runs out of memory is recorded and
skipped. At the end the start and the winner are measured again back to back, and the
speed-up claimed is the median of the pairs' ratios (a winner that does not hold up, or that
a round measured no faster, is dropped). With a target (`target.metric`,
`target.value`), the start and the leading candidates (the winner, the next by samples/s, and
one that changes the numerics: batch size, precision, compile) are then each trained to it,
with the user's own epochs and evaluations, once per seed of `tune.target_seeds`, and the one
with the shortest median time to it, if shorter than the start's, is kept: more samples/s (a
larger batch, bf16) can take longer to a figure, fewer can take less, and the time to a figure
moves with the seed. The search then has half the budget, the runs to the target the rest
(`tune.budget_s=auto`: 120 s, 600 s with a target). An interrupt (Ctrl-C, SIGTERM) keeps
the best so far. The result: a table (console, tune.md, TensorBoard text; each trial's run
has its HParams entry), and a preset `experiment/tuned_<name>.yaml` holding the user's
overrides and the winner's, so that `python train.py experiment=tuned_<name>` reproduces
it. Tunes are cached per (config, hardware) in `tune.cache`.

The modules, by concern: options (what a verdict asks to try, as overrides), trials (one
trial run and read back), rules (how a trial's figures decide: spread, undecided, the runs to
the target), search (the Tuner, and `tune()` that runs it), cache (the key and
what a cached entry must hold), preset (the yaml a tune writes and how to reproduce it),
outputs (the table, tune.md, tune.json and the TensorBoard text).
"""

# what other modules and the tests import from saturate.tune
from saturate.tune.cache import valid_entry
from saturate.tune.options import COMPUTE, candidates, merged, side_order
from saturate.tune.outputs import _to_target_lines, render
from saturate.tune.preset import check_overwritable, preset_path, preset_text, reproduce
from saturate.tune.search import Tuner, tune
from saturate.tune.trials import Measured, Result, fresh_compile_state

__all__ = [
    "COMPUTE",
    "Measured",
    "Result",
    "Tuner",
    "_to_target_lines",
    "candidates",
    "fresh_compile_state",
    "merged",
    "check_overwritable",
    "preset_path",
    "preset_text",
    "render",
    "reproduce",
    "side_order",
    "tune",
    "valid_entry",
]
