"""An exponential moving average of the weights, evaluated and checkpointed as the run's
weights: timm's ModelEmaV3 (decay, warm-up, update every N steps), written against saturate's
public callback protocol.

    python train.py callbacks=[ema] callbacks.ema.decay=0.999

The average is updated on the device after each optimizer step (one fused lerp over every
parameter and buffer: no host read). It is what is evaluated, what `best.pt` holds as
`model` (the weights that scored) and what the report's metrics are of; the trained weights
are kept beside it in each checkpoint (`train_model`) so that a resumed run continues them.
"""

from __future__ import annotations

import copy

import torch

from saturate.errors import ConfigError, Problem, is_integer, is_number


class EMA:
    """decay: the average's decay per update; warmup: ramp it up as timm does,
    1 - (1 + updates) ** -power (power 2/3), so that early averages are not dominated by the
    random initial weights; every: update after every N-th optimizer step."""

    def __init__(self, decay: float = 0.999, warmup: bool = True, warmup_power: float = 2 / 3, every: int = 1):
        problems = []
        if not is_number(decay, 0, 1, open_low=True, open_high=True):
            problems.append(Problem("callbacks.ema.decay", decay, "a number in (0, 1)"))
        if not is_integer(every, 1):
            problems.append(Problem("callbacks.ema.every", every, "an integer >= 1 (optimizer steps)"))
        if not is_number(warmup_power, 0, open_low=True):
            problems.append(Problem("callbacks.ema.warmup_power", warmup_power, "a number > 0"))
        if problems:
            raise ConfigError(problems)
        self.decay, self.warmup, self.power, self.every = float(decay), warmup, float(warmup_power), every
        self.updates = 0
        self.model: torch.nn.Module | None = None

    def decay_at(self, updates: int) -> float:
        """The decay of update number `updates` (from 0): a host number, no device read."""
        if not self.warmup:
            return self.decay
        return min(self.decay, 1 - (1 + updates) ** -self.power)

    def on_run_start(self, run) -> None:
        self.model = model = copy.deepcopy(run.model).eval().requires_grad_(False)
        run.eval_model = model  # evaluated and checkpointed as the run's weights
        ema, trained = model.state_dict(), run.model.state_dict()
        floats = [k for k, v in ema.items() if v.is_floating_point()]
        self.ema, self.trained = [ema[k] for k in floats], [trained[k] for k in floats]
        others = [k for k, v in ema.items() if not v.is_floating_point()]  # counters (BatchNorm's batches seen): copied
        self.ema_rest, self.trained_rest = [ema[k] for k in others], [trained[k] for k in others]

    def on_after_optimizer_step(self, run) -> None:
        if run.step % self.every:
            return
        weight = 1.0 - self.decay_at(self.updates)
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, self.trained, weight)
            if self.ema_rest:
                torch._foreach_copy_(self.ema_rest, self.trained_rest)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"updates": self.updates}  # the averaged weights themselves are the checkpoint's `model`

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
