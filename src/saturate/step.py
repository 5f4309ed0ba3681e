"""One optimizer step on one batch, in micro-batches, surviving CUDA out-of-memory.

The batch is the optimizer batch; it is computed in `micro_batches` pieces whose gradients
accumulate (each piece's loss weighted by its share of the batch), so the optimizer sees
the same gradient whatever the split. An out-of-memory error doubles the number of pieces
and retries the batch: the optimizer batch and the LR schedule do not change. (With
BatchNorm the statistics are per piece, as with any gradient accumulation.)
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from saturate.device import OutOfMemory, free_device_memory, is_oom
from saturate.distributed import no_sync

log = logging.getLogger(__name__)


_DDP_OOM = (
    "out of memory in the last micro-batch's {where} pass under DDP, which the ranks cannot back out of together; "
    "lower loader.batch_size or raise trainer.accumulate (out-of-memory in the earlier micro-batches is recovered)"
)


_AFTER_BACKWARD = (
    "out of memory at step {step} after the backward pass (unscaling, the gradient norm or the optimizer step, which may have "
    "updated some weights): this memory is the parameters, gradients and optimizer state, which smaller micro-batches do not "
    "shrink; use a smaller model, an optimizer with less state, or free device memory, and resume from the last checkpoint"
)


def _alone(ok: bool) -> bool:
    """The agreement of a single process: its own answer."""
    return ok


class TrainStep:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision, guard, *,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], grad_clip: float, micro_batches: int = 1,
                 recover_oom: bool = True, dist=None):  # fmt: skip
        self.model, self.optimizer, self.precision, self.guard, self.loss = model, optimizer, precision, guard, loss
        self.distributed = dist is not None and dist.world_size > 1
        self.agree = dist.agree if self.distributed else _alone  # True only if every rank's answer is True
        self.dist = dist
        # torch's fused optimizers skip a step on the device when told `found_inf` (GradScaler's
        # protocol): the guard's decision then needs no host read (fp16 keeps the scaler's own)
        guard.on_device = self.on_device = (guard.skip and guard.check_grads and not precision.scaler.is_enabled()
                                            and bool(getattr(optimizer, "_step_supports_amp_scaling", False)))  # fmt: skip
        self.params = [p for p in model.parameters() if p.requires_grad]
        # A skipped step must leave the buffers as they were too: the forward pass has
        # already moved BatchNorm's running statistics (NaN in, NaN kept). They are copied
        # before each step into tensors allocated once, and copied back when the guard skips.
        self.buffers = [b for b in model.buffers()] if guard.skip else []
        self.kept = [b.detach().clone() for b in self.buffers]
        self.max_norm = grad_clip if grad_clip > 0 else float("inf")  # inf: measure the norm, never clip
        self.micro_batches, self.recover_oom = micro_batches, recover_oom
        self.oom_recoveries = 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor, step: int) -> tuple[torch.Tensor, bool | torch.Tensor, bool]:
        """Returns (loss on the device, or zero if the step was skipped as non-finite;
        whether the guard let it through (a bool, or a device tensor when the step decided
        on the device); whether the caller advances the LR schedule)."""
        if self.buffers:
            torch._foreach_copy_(self.kept, self.buffers)
        while (loss := self._forward_backward(x, y)) is None:
            self._after_oom(step, len(y))
        try:
            loss, applied, stepped = (self._step_on_device if self.on_device else self._step_on_host)(loss, step)
        except Exception as e:
            if not (self.recover_oom and is_oom(e)):
                raise
            self.optimizer.zero_grad(set_to_none=True)
            free_device_memory()
            raise OutOfMemory(_AFTER_BACKWARD.format(step=step)) from None
        self.optimizer.zero_grad(set_to_none=True)
        return loss, applied, stepped

    def _step_on_host(self, loss: torch.Tensor, step: int) -> tuple[torch.Tensor, bool, bool]:
        """The guarded step decided on the host (one read per step): (the loss, or zero if
        skipped; whether it was applied; whether the weights moved, which is when the LR
        schedule advances)."""
        self.precision.scaler.unscale_(self.optimizer)
        applied = self.guard.ok(loss, self._grad_norm(), step)
        if not applied and self.buffers:
            torch._foreach_copy_(self.buffers, self.kept)
        stepped = self.precision.step(self.optimizer, applied)
        return (loss if applied else torch.zeros_like(loss)), applied, stepped

    def _step_on_device(self, loss: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The guarded step with nothing read: the optimizer skips it on the device when the
        loss or the gradient norm is not finite (on any rank), and the buffers the forward
        pass moved are put back there. Returns (the loss, or zero if skipped; whether it was
        applied, as a device tensor; True: the LR schedule advances either way)."""
        finite = self.guard.finite(loss, self._grad_norm())
        if self.distributed:
            finite = self.dist.all_true(finite)
        for buffer, kept in zip(self.buffers, self.kept, strict=True):
            buffer.copy_(torch.where(finite, buffer, kept))
        self.optimizer.grad_scale, self.optimizer.found_inf = None, (~finite).to(torch.float32)
        self.optimizer.step()
        self.guard.skipped_on_device(finite, step)
        return torch.where(finite, loss, torch.zeros_like(loss)), finite, True

    def _grad_norm(self) -> torch.Tensor:
        """The gradients' total norm (for the non-finite guard), clipping them to grad_clip if
        set; without clipping the gradients are not touched (clip_grad_norm_ would multiply
        them all by 1)."""
        if self.max_norm != float("inf") or not hasattr(torch.nn.utils, "get_total_norm"):  # torch < 2.6 has no get_total_norm
            return torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Gradients of the batch's loss, accumulated over the micro-batches; None after an
        out-of-memory (on any rank: they agree after each forward and backward pass, so all
        retry together).

        Under DDP only the last micro-batch synchronises gradients, and DDP prepares that
        exchange at the end of its forward pass: a rank cannot back out of it once its
        forward succeeded. So an out-of-memory there stops every rank together (agreed) with
        a clear error, and one inside the synchronising backward pass (where the others are
        already exchanging gradients) stops that rank, the others at the process group's
        timeout. Out-of-memory in the earlier micro-batches is recovered as in one process."""
        total = None
        count = min(self.micro_batches, len(y))  # never an empty piece (a short last batch, or more pieces than samples)
        pieces = list(zip(x.tensor_split(count), y.tensor_split(count), strict=True))
        for i, (xs, ys) in enumerate(pieces):
            synchronising = i == len(pieces) - 1 and self.distributed
            with contextlib.nullcontext() if i == len(pieces) - 1 else no_sync(self.model):
                ok, loss = self._attempt(self._forward, xs, ys, len(y))
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
        return total

    def _forward(self, xs: torch.Tensor, ys: torch.Tensor, batch: int) -> torch.Tensor:
        with self.precision.autocast():
            return self.loss(self.model(xs), ys) * (len(ys) / batch)  # x1.0 (exact) for one piece

    def _backward(self, loss: torch.Tensor) -> None:
        self.precision.scaler.scale(loss).backward()

    def _attempt(self, fn, *args) -> tuple[bool, object]:
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
        free_device_memory()
        piece = math.ceil(batch / self.micro_batches)
        if piece <= 1:
            raise OutOfMemory(f"out of memory at step {step} even with micro-batches of 1 sample; use a smaller model or input, "
                              "or free device memory (device.memory_fraction, other processes)")  # fmt: skip
        self.micro_batches = min(2 * self.micro_batches, batch)  # at most one sample per piece: none left empty
        self.oom_recoveries += 1
        smaller = math.ceil(batch / self.micro_batches)
        log.warning("step %d: out of memory with micro-batches of %d samples; continuing with %d micro-batches of %d "
                    "(the optimizer batch stays %d)", step, piece, self.micro_batches, smaller, batch)  # fmt: skip
