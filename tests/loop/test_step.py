"""One optimizer step as such: micro-batches give the whole batch's update, clipping caps
the gradient's norm, and a non-finite step is skipped leaving weights and buffers alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from saturate.components.precision import setup_precision
from saturate.config.schema import PrecisionConfig
from saturate.loop.faults import NonFiniteGuard
from saturate.loop.step import TrainStep

CPU = torch.device("cpu")


def model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    return model, (torch.randn(16, 6), torch.randint(0, 2, (16,)))


def step_of(model, *, micro_batches: int = 1, grad_clip: float = 0.0, loss=None, skip: bool = True) -> TrainStep:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    guard = NonFiniteGuard(skip=skip, check_grads=True, max_consecutive=3, device=CPU)
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


@pytest.mark.parametrize("skip", [True, False])
def test_a_step_retried_after_out_of_memory_moves_batchnorm_statistics_once(skip):
    """The whole batch ran out of memory after BatchNorm's forward had moved its running
    statistics and counter; the retry in two micro-batches moved them again: the buffers
    differed from a step split in two from the start. CUDA's out-of-memory error is raised by
    the loss, after the model ran (a GPU cannot exist here)."""

    def loss(m, b):
        out = m(b[0])
        if len(b[0]) > 8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return F.cross_entropy(out, b[1])

    retried, batch = model_and_batch()
    split, _ = model_and_batch()
    step = step_of(retried, loss=loss, skip=skip)
    step(batch, 1)
    step_of(split, micro_batches=2, skip=skip)(batch, 1)
    assert step.micro_batches == 2
    for (name, a), b in zip(retried.named_buffers(), split.buffers(), strict=True):
        assert torch.equal(a, b), name


class Dispatched(TorchDispatchMode):
    """The aten operators dispatched while active (each a kernel launch or more on a GPU), and
    the dtypes of every foreach copy's list."""

    def __init__(self):
        super().__init__()
        self.ops, self.foreach_dtypes = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func.overloadpacket.__name__ == "_foreach_copy_":
            self.foreach_dtypes.append({t.dtype for t in args[0]})
        return func(*args, **(kwargs or {}))


def test_the_device_decided_guard_adds_a_handful_of_operators_on_a_batchnorm_model():
    """ResNet-18 holds 60 BatchNorm buffers (float32 statistics, int64 counters). The guard
    kept them with one foreach copy over the mixed list (which torch runs one copy per buffer)
    and put them back with a `where` and a `copy_` per buffer: about 180 launches per step
    on a GPU. Counted here with a dispatch mode: the operators a guarded step adds to an
    unguarded one, and that every foreach copy holds one dtype (the fused kernel's condition)."""
    from saturate.models import ResNet18

    counts = {}
    for skip in (False, True):
        torch.manual_seed(0)
        model = ResNet18(in_channels=3, num_classes=10)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        guard = NonFiniteGuard(skip=skip, check_grads=True, max_consecutive=3, device=CPU)
        precision = setup_precision(PrecisionConfig(mode="fp32"), CPU)
        loss = lambda m, b: F.cross_entropy(m(b[0]), b[1])
        step = TrainStep(model, optimizer, precision, guard, loss=loss, grad_clip=0.0, recover_oom=False)
        assert step.on_device is skip
        batch = (torch.randn(2, 3, 32, 32), torch.tensor([1, 2]))
        step(batch, 1)  # the optimizer's state is made at its first step
        with Dispatched() as counted:
            step(batch, 2)
        counts[skip] = counted
    added = counts[True].ops - counts[False].ops
    # the decision and its count on the device take about 16, the buffers 8 (two dtypes): it was 137
    assert added <= 32, f"the guard adds {added} operators per step"
    assert all(len(dtypes) == 1 for dtypes in counts[True].foreach_dtypes)


@pytest.mark.parametrize(
    ("skip", "fused", "fp16", "reads"),
    [
        (True, True, False, 0),  # decided on the device: nothing read
        (True, False, False, 1),  # the guard's one scalar
        (False, False, False, 0),
        (False, False, True, 1),  # GradScaler's check with an optimizer that cannot skip on the device
        (True, True, True, 1),  # fp16 checks the loss only: the guard decides on the host
    ],
)
def test_a_step_announces_its_host_reads_to_whoever_times_it(skip, fused, fp16, reads):
    """The step timer judges launch-boundness by what was launched before the step waited for
    the device (saturate.diagnostics.timing): the step calls `on_host_read` before each read."""
    model, batch = model_and_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, fused=fused)
    guard = NonFiniteGuard(skip=skip, check_grads=not fp16, max_consecutive=3, device=CPU)
    precision = setup_precision(PrecisionConfig(mode="fp16" if fp16 else "fp32"), CPU)
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1])
    step = TrainStep(model, optimizer, precision, guard, loss=loss, grad_clip=0.0)
    announced = []
    step.on_host_read = lambda: announced.append(1)
    step(batch, 1)
    assert len(announced) == reads
