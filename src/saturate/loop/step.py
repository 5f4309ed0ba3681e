"""One optimizer step on one batch, in stages a reader can follow (and a subclass replace):

1. `forward_backward`: the batch's loss and gradients, computed in `micro_batches` pieces
   whose gradients accumulate (each piece's loss weighted by its share of the batch), so the
   optimizer sees the same gradient whatever the split. An out-of-memory error doubles the
   pieces and retries the batch: the optimizer batch and the LR schedule do not change.
   (With BatchNorm the statistics are per piece, as with any gradient accumulation.)
2. `grad_norm`: the gradients' total norm, what the non-finite guard judges;
3. `clip`: the clipping policy (trainer.grad_clip), applied with that norm;
4. the guard and the optimizer's update: decided on the device when the optimizer can skip
   a step there (torch's fused optimizers), else with one host read;
5. after the update, the loop calls the observers' `on_after_optimizer_step` (weight averages).

A batch is whatever the data's collate makes (tensors, tuples, dicts, nested): the step
never looks inside it; `loss(model, batch)` (the task's) does. Splitting into micro-batches
cuts every tensor along its first dimension, the batch's.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from saturate.components.device import OutOfMemory, free_device_memory, is_oom
from saturate.errors import named_parts
from saturate.scale.distributed import no_sync

log = logging.getLogger(__name__)


_DDP_OOM = (
    "out of memory in the last micro-batch's {where} pass under DDP, which the ranks cannot back out of together; "
    "lower loader.batch_size or raise trainer.accumulate (out-of-memory in the earlier micro-batches is recovered)"
)


_AFTER_BACKWARD = (
    "out of memory at step {step} after the backward pass (unscaling, the gradient norm or the optimizer step, which "
    "may have updated some weights): this memory is the parameters, gradients and optimizer state, which smaller "
    "micro-batches do not shrink; use a smaller model, an optimizer with less state, or free device memory, and "
    "resume from the last checkpoint"
)


def batch_size(batch) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    leaves, _ = tree_flatten(batch)
    return next(len(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.ndim)


def split(batch, count: int) -> list:
    """`batch` cut into `count` pieces along the first dimension of every tensor."""
    leaves, spec = tree_flatten(batch)
    parts = [
        leaf.tensor_split(count) if isinstance(leaf, torch.Tensor) and leaf.ndim else [leaf] * count for leaf in leaves
    ]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(count)]


class _Kept(NamedTuple):
    """Contiguous buffers of one dtype and device, and what keeps them."""

    members: list[torch.Tensor]  # the buffers
    flat: list[torch.Tensor]  # flat views of them
    kept: torch.Tensor  # their values at `keep`
    scratch: torch.Tensor
    kept_shaped: list[torch.Tensor]  # kept and scratch, viewed as the buffers
    scratch_shaped: list[torch.Tensor]


class Buffers:
    """A model's buffers, kept before each step so that a step that must not count (skipped as
    non-finite, or retried after an out-of-memory) leaves them as they were: by then the
    forward pass has moved BatchNorm's running statistics and counters (NaN in, NaN kept).

    Kept as one flat tensor per dtype and device, allocated once. A foreach copy over a list
    that mixes float32 statistics with int64 counters runs as one copy per buffer, and a
    `where` and a `copy_` per buffer put them back: about 180 launches per ResNet-18 step on
    a GPU. Here keeping them is one `cat` per dtype; putting them back is one foreach copy
    per dtype (one list of one dtype: torch's fused kernel), after one `cat` and one `where`
    when the device decides (tests/loop/test_step.py counts them)."""

    def __init__(self, buffers: list[torch.Tensor]):
        groups: dict[tuple, list[torch.Tensor]] = {}
        for b in buffers:
            groups.setdefault((b.dtype, b.device, b.is_contiguous()), []).append(b)
        self.groups: list[_Kept] = []
        self.loose: list[tuple[torch.Tensor, torch.Tensor]] = []  # non-contiguous buffers: kept one by one
        for (_, _, contiguous), members in groups.items():
            if not contiguous:
                self.loose += [(b, b.detach().clone()) for b in members]
                continue
            flat = [b.detach().view(-1) for b in members]
            kept, scratch = torch.cat(flat), torch.cat(flat)
            sizes = [f.numel() for f in flat]
            shaped = [[p.view(b.shape) for p, b in zip(t.split(sizes), members, strict=True)] for t in (kept, scratch)]
            self.groups.append(_Kept(members, flat, kept, scratch, *shaped))

    def __bool__(self) -> bool:
        return bool(self.groups or self.loose)

    def keep(self) -> None:
        for _, flat, kept, *_ in self.groups:
            torch.cat(flat, out=kept)
        for buffer, saved in self.loose:
            saved.copy_(buffer)

    def restore(self) -> None:
        """Back to what `keep` saw."""
        for members, _, _, _, kept, _ in self.groups:
            torch._foreach_copy_(members, kept)
        for buffer, saved in self.loose:
            buffer.copy_(saved)

    def restore_unless(self, finite: torch.Tensor) -> None:
        """Back to what `keep` saw where `finite` (a device bool) is False, with nothing read."""
        for members, flat, kept, scratch, _, shaped in self.groups:
            torch.cat(flat, out=scratch)
            torch.where(finite, scratch, kept, out=scratch)
            torch._foreach_copy_(members, shaped)
        for buffer, saved in self.loose:
            buffer.copy_(torch.where(finite, buffer, saved))


def _alone(ok: bool) -> bool:
    """The agreement of a single process: its own answer."""
    return ok


def _unwatched() -> None:
    """No one times the step's host reads."""


class TrainStep:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision,
        guard,
        *,
        loss: Callable[[nn.Module, object], torch.Tensor],
        grad_clip: float,
        micro_batches: int = 1,
        recover_oom: bool = True,
        dist=None,
        summed: bool = False,
    ):
        """`summed`: the loss sums over the batch's samples (task.loss_reduction=sum): the
        micro-batches' sums add up, and the loss returned is per sample."""
        self.model, self.optimizer, self.precision, self.guard, self.loss = model, optimizer, precision, guard, loss
        self.summed = summed
        self.distributed = dist is not None and dist.world_size > 1
        self.agree = self._agreed if self.distributed else _alone  # True only if every rank's answer is True
        self.dist = dist
        # called before each read of the device on the host (the loop's step timer judges
        # launch-boundness by what the step launched before it waited for the device)
        self.on_host_read: Callable[[], None] = _unwatched
        # torch's fused optimizers skip a step on the device when told `found_inf` (GradScaler's
        # protocol): the guard's decision then needs no host read (fp16 keeps the scaler's own)
        guard.on_device = self.on_device = (
            guard.skip
            and guard.check_grads
            and not precision.scaler.is_enabled()
            and bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        )
        self.params = [p for p in model.parameters() if p.requires_grad]
        # a skipped step and a step retried after an out-of-memory leave the buffers as they were
        self.buffers = Buffers(list(model.buffers()) if guard.skip or recover_oom else [])
        self.max_norm = grad_clip if grad_clip > 0 else float("inf")  # inf: measure the norm, never clip
        self.micro_batches, self.recover_oom = micro_batches, recover_oom
        self.oom_recoveries = 0
        # the update's host reads: the guard's scalar, and GradScaler's check where the
        # optimizer cannot skip a step on the device
        fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.update_reads = not self.on_device and (guard.skip or (precision.scaler.is_enabled() and not fused))

    size = staticmethod(batch_size)
    parts = staticmethod(named_parts)

    def __call__(self, batch, step: int) -> tuple[torch.Tensor, bool | torch.Tensor, bool]:
        """Returns (loss on the device, or zero if the step was skipped as non-finite;
        whether the guard let it through (a bool, or a device tensor when the step decided
        on the device); whether the caller advances the LR schedule)."""
        if self.buffers:
            self.buffers.keep()
        while (loss := self.forward_backward(batch)) is None:
            self._after_oom(step, batch_size(batch))
        try:
            loss, applied, stepped = (self._update_on_device if self.on_device else self._update_on_host)(loss, step)
        except Exception as e:
            if not (self.recover_oom and is_oom(e)):
                raise
            self.optimizer.zero_grad(set_to_none=True)
            free_device_memory()
            raise OutOfMemory(_AFTER_BACKWARD.format(step=step)) from None
        self.optimizer.zero_grad(set_to_none=True)
        return loss, applied, stepped

    # -- 1. loss and gradients

    def forward_backward(self, batch) -> torch.Tensor | None:
        """Gradients of the batch's loss, accumulated over the micro-batches; None after an
        out-of-memory (on any rank: they agree after each forward and backward pass, so all
        retry together).

        Under DDP only the last micro-batch synchronises gradients, and DDP prepares that
        exchange at the end of its forward pass: a rank cannot back out of it once its
        forward succeeded. So an out-of-memory there stops every rank together (agreed) with
        a clear error, and one inside the synchronising backward pass (where the others are
        already exchanging gradients) stops that rank, the others at the process group's
        timeout. Out-of-memory in the earlier micro-batches is recovered as in one process."""
        total, size = None, batch_size(batch)
        # never an empty piece
        pieces = split(batch, min(self.micro_batches, size)) if self.micro_batches > 1 else [batch]
        for i, piece in enumerate(pieces):
            synchronising = i == len(pieces) - 1 and self.distributed
            with contextlib.nullcontext() if i == len(pieces) - 1 else no_sync(self.model):
                ok, loss = self._attempt(self._forward, piece, size)
                if not self.agree(ok):
                    if synchronising:
                        raise OutOfMemory(_DDP_OOM.format(where="forward"))
                    return None
                ok, _ = self._attempt(self._backward, loss)
            if synchronising:  # no agreement to make: a rank that failed here cannot take part in one
                if not ok:
                    raise OutOfMemory(_DDP_OOM.format(where="gradient-synchronising backward"))
            elif not self.agree(ok):
                return None
            total = loss.detach() if total is None else total + loss.detach()
        return total / size if self.summed and total is not None else total

    def _forward(self, piece, size: int) -> torch.Tensor:
        with self.precision.autocast():
            loss = self.loss(self.model, piece)
        share = 1 if self.summed else batch_size(piece) / size  # sums over the pieces add up to the batch's
        return loss * share if share != 1 else loss  # x1.0 is exact, but a no-op kernel all the same

    def _backward(self, loss: torch.Tensor) -> None:
        self.precision.scaler.scale(loss).backward()

    # -- 2. and 3. the gradients' norm, and the clipping policy

    def grad_norm(self) -> torch.Tensor:
        """The gradients' total norm (what the guard judges), without touching them."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
            return torch.nn.utils.get_total_norm(grads)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))

    def clip(self, norm: torch.Tensor) -> None:
        """trainer.grad_clip: scale the gradients down to that norm when they exceed it (with
        the norm already computed: no second pass over them). Nothing without a limit."""
        if self.max_norm == float("inf"):
            return
        if hasattr(torch.nn.utils, "clip_grads_with_norm_"):  # torch >= 2.6
            torch.nn.utils.clip_grads_with_norm_(self.params, self.max_norm, norm)
        else:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)

    # -- 4. the guard and the optimizer's update

    def _update_on_host(self, loss: torch.Tensor, step: int) -> tuple[torch.Tensor, bool, bool]:
        """The guarded step decided on the host (one read per step): (the loss, or zero if
        skipped; whether it was applied; whether the weights moved, which is when the LR
        schedule advances)."""
        self.precision.scaler.unscale_(self.optimizer)
        norm = self.grad_norm()
        self.clip(norm)
        if self.update_reads:
            self.on_host_read()
        applied = self.guard.ok(loss, norm, step)
        if not applied:
            self.buffers.restore()
        stepped = self.precision.step(self.optimizer, applied)
        return (loss if applied else torch.zeros_like(loss)), applied, stepped

    def _update_on_device(self, loss: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The guarded step with nothing read: the optimizer skips it on the device when the
        loss or the gradient norm is not finite (on any rank), and the buffers the forward
        pass moved are put back there. Returns (the loss, or zero if skipped; whether it was
        applied, as a device tensor; True: the LR schedule advances either way)."""
        norm = self.grad_norm()
        self.clip(norm)
        finite = self.guard.finite(loss, norm)
        if self.distributed:
            finite = self.dist.all_true(finite)
        self.buffers.restore_unless(finite)
        # the attributes torch's fused optimizers read in step() (as GradScaler sets them): skip where found_inf
        self.optimizer.grad_scale, self.optimizer.found_inf = None, (~finite).to(torch.float32)  # type: ignore[attr-defined]
        self.optimizer.step()
        self.guard.skipped_on_device(finite, step)
        return torch.where(finite, loss, torch.zeros_like(loss)), finite, True

    def _agreed(self, ok: bool) -> bool:
        """Every rank's answer (one all-reduce and one host read: announced)."""
        self.on_host_read()
        return self.dist.agree(ok)

    # -- out of memory

    def _attempt(self, fn, *args) -> tuple[bool, Any]:
        """(True, fn(*args)), or (False, None) after a CUDA out-of-memory, keeping nothing of
        the failure (its frames would hold the tensors that filled the memory)."""
        try:
            return True, fn(*args)
        except Exception as e:
            if not (self.recover_oom and is_oom(e)):
                raise
        return False, None

    def _after_oom(self, step: int, batch: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # drop what the failed pieces accumulated
        self.buffers.restore()  # and what their forward passes did to BatchNorm's statistics
        free_device_memory()
        piece = math.ceil(batch / self.micro_batches)
        if piece <= 1:
            raise OutOfMemory(
                f"out of memory at step {step} even with micro-batches of 1 sample; use a smaller model or input, or "
                "free device memory (device.memory_fraction, other processes)"
            )
        self.micro_batches = min(2 * self.micro_batches, batch)  # at most one sample per piece: none left empty
        self.oom_recoveries += 1
        smaller = math.ceil(batch / self.micro_batches)
        log.warning(
            "step %d: out of memory with micro-batches of %d samples; continuing with %d micro-batches of %d "
            "(the optimizer batch stays %d)",
            step,
            piece,
            self.micro_batches,
            smaller,
            batch,
        )
