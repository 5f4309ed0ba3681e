"""The after-training cost probes are bounded by the run: they count samples, not data-set
items (an item may be a whole batch), and they stop at their share of the loop's time."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset
from torch.utils.flop_counter import FlopCounterMode

import saturate
from saturate.components.precision import setup_precision
from saturate.config.schema import PrecisionConfig
from saturate.diagnostics import costs
from saturate.tasks.classification import Classification
from saturate.trainer import outcome

CPU = torch.device("cpu")


class WholeBatches(Dataset):
    """Each item is a whole batch of 20 samples (a language model's batchified streams, say)."""

    def __init__(self, items: int):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(items, 20, 4, generator=generator)
        self.y = torch.randint(0, 3, (items, 20), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def concatenated(items):
    return torch.cat([x for x, _ in items]), torch.cat([y for _, y in items])


class Seen(nn.Linear):
    """A linear model that records the batch size of every forward it runs, and (a callback)
    where training's last evaluation ended: what follows are the after-training probes."""

    def __init__(self):
        super().__init__(4, 3)
        self.sizes: list[int] = []
        self.evaluated = 0

    def forward(self, x):
        self.sizes.append(len(x))
        return super().forward(x)

    def on_eval_end(self, run, metrics) -> None:
        self.evaluated = len(self.sizes)


def test_the_probes_count_samples_where_a_data_set_item_is_a_whole_batch(tmp_path):
    model = Seen()
    metrics = saturate.fit(
        model,
        WholeBatches(12),
        WholeBatches(2),
        collate=concatenated,
        run_dir=tmp_path,
        callbacks=[model],
        overrides=["loader.batch_size=1", "trainer.max_epochs=1", "trainer.progress=false", "device=cpu"],
    )
    assert set(model.sizes[1 : model.evaluated]) == {20}  # training and validation: an item of 20 per step
    probes = model.sizes[model.evaluated :]
    assert max(probes) <= costs.COST_SAMPLES and costs.COST_SAMPLES in probes
    with FlopCounterMode(display=False) as counter:  # one step of 20 samples
        nn.functional.cross_entropy(nn.Linear(4, 3)(torch.randn(20, 4)), torch.randint(0, 3, (20,))).backward()
    assert metrics["cost/flops_per_step"] == counter.get_total_flops()


class Clocked(nn.Module):
    """A model whose forward advances the test's clock: 0.2 s for one sample, 1 s for more."""

    def __init__(self, clock: list[float]):
        super().__init__()
        self.layer, self.clock = nn.Linear(4, 3), clock

    def forward(self, x):
        self.clock[0] += 0.2 if len(x) == 1 else 1.0
        return self.layer(x)


def timed_scaling(seconds: float):
    now = [0.0]
    budget = costs.Budget(seconds, clock=lambda: now[0])
    precision = setup_precision(PrecisionConfig(mode="fp32"), CPU)
    sample = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    scaled = costs.scaling(Clocked(now), sample, Classification(num_classes=3), precision, CPU, budget, guess=1.0)
    return scaled, budget, now[0]


@pytest.mark.parametrize(
    ("seconds", "scaled", "skipped"),
    [
        (100.0, (0.2, 1.0, 8), []),  # the whole probe: a warm-up and 3 timings of each size
        (3.0, (0.2, 1.0, 8), ["batch scaling's further repeats"]),  # fewer repeats, still a result
        (1.0, None, ["batch scaling"]),  # not even one timing of each size fits
    ],
)
def test_the_batch_scaling_stops_where_its_next_pass_would_pass_the_budget(seconds, scaled, skipped):
    result, budget, spent = timed_scaling(seconds)
    assert result == (pytest.approx(scaled) if scaled else None) and budget.skipped == skipped
    assert spent <= seconds


def test_a_run_whose_probes_do_not_fit_their_share_of_the_loop_says_so_in_its_metrics(make_cfg, monkeypatch):
    monkeypatch.setattr(outcome, "PROBE_SHARE", 0.0)
    monkeypatch.setattr(outcome, "PROBE_FLOOR_S", 0.0)
    metrics = saturate.train(make_cfg("device=cpu"))
    assert metrics["cost/probes_skipped"] == "the FLOP count" and "cost/flops_per_step" not in metrics
