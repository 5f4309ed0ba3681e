"""A trial whose spread is wider than the difference it decides on is measured again, and if
it still is, reported undecided (never as a ratio) and not kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from saturate.tune.rules import judge, paired_noise, spread
from tests.test_tune import scripted_tuner


def test_the_spread_is_the_middle_of_the_windows_not_their_outliers():
    assert spread([100.0] * 8) == 0.0
    assert spread([100.0]) == 0.0  # one window tells nothing of its noise
    assert spread([90.0, 95.0, 100.0, 105.0, 110.0]) == pytest.approx(0.12)  # p20 94, p80 106 over 100
    one_slow = [100.0] * 9 + [2.0]  # one window that recompiled: the middle holds
    assert spread(one_slow) == 0.0


@pytest.mark.parametrize(
    ("ratio", "noise", "said"),
    [
        (1.5, 0.1, "faster"),
        (1.08, 0.2, "undecided"),  # faster by the rule, within the noise
        (1.25, 0.25, "undecided"),  # a spread as wide as the difference decides nothing
        (0.5, 0.2, "slower"),
        (0.8, 0.3, "undecided"),
        (1.03, 0.5, "no gain"),  # within min_gain: not kept, whatever the noise
        (0.97, 0.0, "slower"),
    ],
)
def test_a_difference_within_the_spread_is_undecided(ratio, noise, said):
    assert judge(ratio, noise, min_gain=0.05) == said


def test_a_speed_up_is_claimed_only_when_every_paired_round_measured_it_faster():
    assert paired_noise([1.2]) == 0.0
    assert judge(1.1, paired_noise([1.3, 1.1, 0.98]), 0.05) == "undecided"  # one round measured it slower
    assert judge(1.1, paired_noise([1.05, 1.3, 1.1]), 0.05) == "faster"
    # a busy machine: one thread 35x, 20x and 5x the oversubscribed default, then 5.9x, 2.5x, 1.85x
    assert judge(19.8, paired_noise([34.6, 19.8, 5.2]), 0.05) == "faster"
    assert judge(2.49, paired_noise([5.9, 1.85, 2.49]), 0.05) == "faster"


def with_windows(tuner, windows: list[list[float]]):
    """Each next trial of the script also reports these timed windows' samples/s."""
    scripted = tuner.trial

    def trial(*args, **kwargs):
        result = scripted(*args, **kwargs)
        result.rates = windows.pop(0)
        return result

    trial.calls = scripted.calls
    tuner.trial = trial
    return tuner


NOISY = [60.0, 90.0, 110.0, 140.0, 150.0]  # a spread of 0.55 around 110


def test_a_noisy_candidate_is_measured_again_then_reported_undecided_and_not_kept():
    from saturate.tune import render

    tuner = with_windows(scripted_tuner([110.0, 100.0, 112.0]), [NOISY, [100.0] * 5, NOISY])
    tuner.try_dimension("threads", [["device.threads=1"]])
    assert len(tuner.trial.calls) == 3  # measured, then again beside the best
    assert tuner.changes == [] and tuner.results[1].outcome == "undecided"
    tuner.confirmed, tuner.searchpath, tuner.rate, tuner.speedup = False, [], 100.0, 1.0
    for r in tuner.results:
        r.data_wait, r.verdict, r.outcome = 0.0, "compute-bound", r.outcome or "start"
    row = next(line for line in render(tuner, preset=Path("t.yaml")).splitlines() if line.startswith("| 1 |"))
    assert "undecided" in row and "1.10x" not in row  # never as a ratio


def test_a_noisy_candidate_that_holds_clearly_when_measured_again_is_kept():
    tuner = with_windows(scripted_tuner([110.0, 100.0, 150.0]), [NOISY, [100.0] * 5, [150.0] * 5])
    tuner.try_dimension("threads", [["device.threads=1"]])
    assert tuner.changes == ["device.threads=1"] and tuner.results[1].outcome == "kept"


def test_a_quiet_candidate_is_decided_as_before():
    tuner = with_windows(scripted_tuner([150.0, 100.0, 140.0]), [[150.0] * 5, [100.0] * 5, [140.0] * 5])
    tuner.try_dimension("threads", [["device.threads=1"]])
    assert tuner.changes == ["device.threads=1"]


def test_a_confirmation_with_a_round_that_measured_no_gain_keeps_the_start():
    from saturate.tune import Result

    tuner = scripted_tuner([100.0, 130.0, 100.0, 98.0])  # ratios 1.5 (the search), 1.3, 0.98
    tuner.changes, tuner.confirmed = ["device.threads=1"], False
    tuner.best = Result(1, ["device.threads=1"], samples_per_s=150.0)
    tuner.results.append(tuner.best)
    tuner.confirm()
    assert tuner.changes == [] and tuner.results[1].outcome == "undecided when measured again"
    assert tuner.speedup == 1.0
