"""Time to target: the wall time at which an evaluation first met the user's figure
(`target.metric` at `target.value`), on the clock of time/wall_s; `target.stop` ends the run
there, as a success."""

from __future__ import annotations

import math
from dataclasses import dataclass

from saturate import names


@dataclass
class Target:
    metric: str  # as evaluations log it: val/acc
    value: float
    mode: str  # max: met at value or above; min: at value or below
    stop: bool = False
    reached_s: float | None = None
    reached_step: int | None = None

    def met(self, evaluated: dict[str, float], step: int, seconds: float) -> bool:
        """Whether this evaluation meets the target for the first time (then kept)."""
        value = evaluated.get(self.metric)
        if self.reached_s is not None or value is None or not math.isfinite(value):
            return False
        if value >= self.value if self.mode == "max" else value <= self.value:
            self.reached_s, self.reached_step = seconds, step
            return True
        return False

    def __str__(self) -> str:
        """The aim in words: `val/acc >= 0.95`."""
        return f"{self.metric} {'>=' if self.mode == 'max' else '<='} {self.value:g}"

    def metrics(self) -> dict[str, float]:
        if self.reached_s is None or self.reached_step is None:
            return {}
        return {names.TO_TARGET_S: self.reached_s, names.TO_TARGET_STEP: float(self.reached_step)}
