"""How a tune decides: how far a trial's figure can be trusted (the spread of its timed
windows), whether a candidate beats its rival by more than that, and which candidate trained
to the target is kept."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# the settings that change what the model computes, not only how fast: their figures to the
# target can differ, not only their samples/s
NUMERICS = ("loader.batch_size", "precision.mode", "trainer.compile")


def changes_numerics(config: Sequence[str]) -> bool:
    """Whether a candidate's overrides change the numerics (batch size, precision, compile)."""
    return any(o.partition("=")[0] in NUMERICS for o in config)


def spread(rates: Sequence[float]) -> float:
    """How much a trial's timed windows disagree, as a share of their median samples/s: the
    20th to the 80th percentile (one outlier window does not widen it); 0 with fewer than two
    windows (nothing to tell by)."""
    if len(rates) < 2:
        return 0.0
    low, *_, high = statistics.quantiles(rates, n=5, method="inclusive")
    return (high - low) / max(statistics.median(rates), 1e-12)


def judge(ratio: float, noise: float, min_gain: float) -> str:
    """A candidate measured at `ratio` times its rival's samples/s, with `noise` the wider of
    the two trials' spreads: faster (by more than `min_gain` and more than the noise), slower,
    no gain (within `min_gain` and not slower), or undecided (the difference it would decide on
    is within the noise: neither kept nor given as a ratio)."""
    gain = ratio - 1
    if abs(gain) <= min_gain:
        return "slower" if gain < 0 else "no gain"
    if noise >= abs(gain):
        return "undecided"
    return "faster" if gain > 0 else "slower"


def paired_noise(ratios: Sequence[float]) -> float:
    """How far paired ratios (the same two configs measured back to back, round after round)
    fall below their median: the median less the smallest. Judged against the median's gain,
    a claim of "faster" holds only when every round measured it faster (ratios of 5x, 2x and
    1.9x all say faster, however far apart; 1.3x, 1.1x and 0.98x do not say 1.1x). One-sided:
    a round far above the median does not weaken the claim."""
    return statistics.median(ratios) - min(ratios) if len(ratios) > 1 else 0.0


def median_time(times: Sequence[float | None]) -> float | None:
    """The median of times to a target, a run that never met it (None) counting as longer than
    any that did; None when the median is such a run."""
    middle = statistics.median(math.inf if t is None else t for t in times)
    return middle if math.isfinite(middle) else None


def choose_by_target(
    start: Sequence[float | None], rivals: Sequence[Sequence[float | None]], *, first_is_fastest: bool
) -> int | None:
    """Which of the candidates trained to the target is kept (its index in `rivals`), or None
    for the starting config: the one with the shortest median time (over the seeds, a seed
    that never met the target counting as never) among those that met it sooner than the
    start. When neither the start nor any candidate met it at the median, samples/s decide:
    the fastest (the first, when `first_is_fastest`)."""
    start_s = median_time(start)
    medians = [median_time(times) for times in rivals]
    sooner = [(m, i) for i, m in enumerate(medians) if m is not None and (start_s is None or m < start_s)]
    if sooner:
        return min(sooner)[1]
    if start_s is None and first_is_fastest and rivals:
        return 0
    return None
