"""One optimizer step as such: micro-batches give the whole batch's update, clipping caps
the gradient's norm, and a non-finite step is skipped leaving weights and buffers alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from saturate.config.schema import PrecisionConfig
from saturate.loop.faults import NonFiniteGuard
from saturate.loop.step import TrainStep
from saturate.parts.precision import setup_precision

CPU = torch.device("cpu")


def model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    return model, (torch.randn(16, 6), torch.randint(0, 2, (16,)))


def step_of(model, *, micro_batches: int = 1, grad_clip: float = 0.0, loss=None) -> TrainStep:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    guard = NonFiniteGuard(skip=True, check_grads=True, max_consecutive=3, device=CPU)
    loss = loss or (lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    precision = setup_precision(PrecisionConfig(mode="fp32"), CPU)
    return TrainStep(model, optimizer, precision, guard, loss=loss, grad_clip=grad_clip, micro_batches=micro_batches)


def test_micro_batches_give_the_whole_batchs_update():
    whole, batch = model_and_batch()
    pieces, _ = model_and_batch()
    pieces.load_state_dict(whole.state_dict())
    for net in (whole, pieces):  # no BatchNorm statistics per piece: eval mode keeps the comparison exact
        net[1].eval()
    step_of(whole)(batch, 1)
    step_of(pieces, micro_batches=4)(batch, 1)
    for a, b in zip(whole.parameters(), pieces.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_clipping_caps_the_gradients_norm():
    model, batch = model_and_batch()
    step = step_of(model, grad_clip=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    step.optimizer.zero_grad()
    step(batch, 1)
    moved = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters(), strict=True)])
    assert torch.linalg.vector_norm(moved).item() <= 0.5 * 0.01 * (1 + 1e-4)  # lr x the clipped norm


def test_a_non_finite_step_is_skipped_leaving_weights_and_buffers_alone():
    model, batch = model_and_batch()
    step = step_of(model, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]) * float("nan"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    loss, applied, stepped = step(batch, 1)
    assert applied is False and stepped is False and loss.item() == 0.0
    assert step.guard.count == 1
    for key, value in model.state_dict().items():  # BatchNorm's running statistics too
        torch.testing.assert_close(value, weights[key], rtol=0, atol=0)
