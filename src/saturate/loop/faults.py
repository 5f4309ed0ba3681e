"""What stops a run early, and how: preemption signals and non-finite steps.

Both are decided at step boundaries by the engine; nothing is saved inside a signal handler.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import torch

from saturate.errors import UserError
from saturate.scale.ranks import STOP_SIGNALS
from saturate.started import stopped_early

log = logging.getLogger(__name__)

CHUNK = 1024  # verdicts decided on the device, stacked into one tensor until the next log step reads them


class Preempted(SystemExit):
    """Raised after the checkpoint of a preempted run is saved. A SystemExit, so the process
    exits with 128 + the signal's number (143 for SIGTERM) and no traceback."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(128 + signum)


class TrainingDiverged(UserError):
    """Too many non-finite steps in a row."""


class NotRequeued(UserError):
    """The scheduler's handler of its stop signal ended the job instead of requeuing it."""


class StopSignal:
    """SIGTERM, SIGUSR1, SIGUSR2 and SIGINT, once training runs (`phase` None), only set
    `requested`; the engine stops at the next step boundary. After a first SIGINT, a second
    one interrupts at once (Ctrl-C twice). Before that, while `phase` names what the run is
    doing (building its data, loading a checkpoint), there is nothing to save: a stop signal
    ends the process at once (saturate.started.StoppedEarly, 128 + the signal), wherever it
    waits or works in Python.

    In a SLURM job of hydra/launcher=slurm, submitit asks SLURM for SIGUSR2 before the time
    limit and handles it by requeuing the job at once; here the run first stops with every
    rank at the same step and saves, and submitit's handler gets the signal after that
    (rank 0 requeues the job while hydra.launcher.max_num_timeout allows, and exits).

    A signal that comes once the loop has stopped looking (the final evaluation, the report)
    is handed on, as the context exits, to the StopSignal around this one if there is one
    (tune's, which then runs no further trial); no other handler gets it twice."""

    SIGNALS = STOP_SIGNALS

    def __init__(self, phase: str | None = None):
        self.phase = phase  # what the run does before its loop starts; None once it trains
        self.nested = False  # inside another StopSignal (set on entering)
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}  # what signal.signal returned: a handler, SIG_DFL, SIG_IGN or None
        self.listeners: list = []  # called from the handler with the signal (puts a hung callback on the clock)

    def _handle(self, signum, frame) -> None:
        if self.phase is not None and not self.nested:
            raise stopped_early(signum, self.phase)
        self.requested = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        for listener in self.listeners:
            listener(signum)

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():  # only the main thread may install handlers
            # a signal the parent chose to ignore (SIGINT in a background job) stays ignored
            watched = [s for s in self.SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
            self._previous = {s: signal.signal(s, self._handle) for s in watched}
        # inside another watcher (tune's, around its trials) a stop is the outer one's to act on, between trials:
        # this one only sets `requested`, whatever the phase, and the trial stops at its first step
        self.nested = any(isinstance(getattr(h, "__self__", None), StopSignal) for h in self._previous.values())
        return self

    def __exit__(self, kind, error, traceback) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if error is None and self.requested is not None:  # it came after the loop's last look: not acted on
            outer = getattr(self._previous.get(self.requested), "__self__", None)
            if isinstance(outer, StopSignal):  # a watcher around the run (tune's, between its trials) takes it
                outer._handle(self.requested, None)
        previous = self._previous.get(error.signum) if isinstance(error, Preempted) else None
        if previous is not None and _requeues(previous):
            try:
                previous(error.signum, None)
            except Exception as refused:  # noqa: BLE001 (submitit raises its own error when it will not requeue)
                raise NotRequeued(
                    f"{signal.Signals(error.signum).name}: the job was not requeued ({str(refused).strip()}); its "
                    "last.pt is saved: resume it with the command above (more time: hydra.launcher.timeout_min, "
                    "more requeues: hydra.launcher.max_num_timeout)"
                ) from None


def _requeues(handler) -> bool:
    """Whether a signal handler is submitit's, which requeues a SLURM job (and exits)."""
    module = getattr(handler, "__module__", None) or ""
    return module.startswith("submitit.") and getattr(handler, "__name__", "") == "checkpoint_and_try_requeue"


class NonFiniteGuard:
    """Decides, per step, whether the optimizer may step: not when the loss or the gradient
    norm is non-finite. Such steps are skipped (weights, optimizer state and buffers
    untouched), counted and logged; `max_consecutive` in a row fail the run.

    With fp16 the gradient norm is the GradScaler's business (an overflow there is routine
    and the scaler skips the step itself), so only the loss is checked.

    Where the optimizer can skip a step on the device (torch's fused Adam, AdamW and SGD:
    the presets' default), the step decides there and nothing is read per step
    (`skipped_on_device`): each step's verdict stays on the device, untouched, until the next
    log step reads them all at once and names the skipped steps; the LR schedule advances
    over them, as it does over fp16 overflow steps.
    Otherwise `skip=True` costs one host read of a scalar per step (`ok`), and a skipped
    step does not advance the schedule. With `skip=False` nothing is read per step:
    non-finite steps are counted on the device and found at the next log step, which fails
    the run (the weights are no longer trustworthy; the last saved checkpoint is)."""

    def __init__(
        self, *, skip: bool, check_grads: bool, max_consecutive: int, device: torch.device, agree=lambda ok: ok
    ):
        self.skip, self.check_grads, self.max_consecutive = skip, check_grads, max_consecutive
        self.agree = agree  # across ranks: every rank skips when any rank must
        self.on_device = False  # set by the step when its optimizer skips on the device
        self.count = 0  # non-finite steps so far
        self.consecutive = 0
        self.first_bad_step: int | None = None  # of the current streak
        # skip=False: the non-finite steps not yet read, counted on the device
        self.unread = torch.zeros((), dtype=torch.int64, device=device)
        # decided on the device: each step's verdict kept as it is (no work per step), read at log
        # steps; the steps since the last read, and every CHUNK of them stacked into one tensor
        self.verdicts: list[torch.Tensor] = []
        self.stacked: list[torch.Tensor] = []
        self.since: int | None = None  # the first step not yet read
        self.streak, self.streak_from = 0, 0  # the non-finite run reaching the last step read, and its first step

    def finite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        return torch.isfinite(loss) & torch.isfinite(grad_norm) if self.check_grads else torch.isfinite(loss)

    def ok(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int) -> bool:
        finite = self.finite(loss, grad_norm)
        if not self.skip:
            self.unread += ~finite
            return True
        if self.agree(bool(finite.item())):
            self.consecutive, self.first_bad_step = 0, None
            return True
        self.count += 1
        self.consecutive += 1
        self.first_bad_step = self.first_bad_step or step
        log.warning(
            "step %d: non-finite loss (%s) or gradient norm; optimizer step skipped (%d in a row)",
            step,
            loss.item(),
            self.consecutive,
        )
        return False

    def skipped_on_device(self, finite: torch.Tensor, step: int) -> None:
        """Keep a step's verdict, decided on the device (the optimizer skipped it where
        `finite` is False), to be read at the next log step: nothing runs on the device here.
        Steps arrive in order; every CHUNK verdicts are stacked (one small tensor), so that a
        long log interval holds a byte per step."""
        if self.since is None:
            self.since = step
        self.verdicts.append(finite)
        if len(self.verdicts) == CHUNK:
            self.stacked.append(torch.stack(self.verdicts))
            self.verdicts = []

    def read(self) -> None:
        """At log steps: take in what was counted on the device (skip=False, or decided on
        the device)."""
        if self.on_device:
            self._read_verdicts()
        elif not self.skip:
            unread = int(self.unread.item())
            if unread:
                self.count += unread
                self.consecutive = self.max_consecutive  # applied already: fail at the next boundary
                self.unread.zero_()

    def _read_verdicts(self) -> None:
        """The verdicts kept since the last read (one host read): the skipped steps, and the
        longest run of them since the last read (a run still going at it counted whole)."""
        kept = self.stacked + ([torch.stack(self.verdicts)] if self.verdicts else [])
        finite = torch.cat(kept).tolist() if kept else []
        longest, longest_from = self.streak, self.streak_from
        for step, ok in enumerate(finite, start=self.since or 0):
            if ok:
                self.streak = 0
                continue
            self.streak, self.streak_from = self.streak + 1, self.streak_from if self.streak else step
            if self.streak > longest:
                longest, longest_from = self.streak, self.streak_from
        self.verdicts, self.stacked, self.since = [], [], None
        self.consecutive, self.first_bad_step = longest, longest_from if longest else None
        unread = finite.count(False)
        if unread:
            self.count += unread
            log.warning(
                "%d non-finite step(s) skipped since the last log step (a non-finite loss or gradient norm); the "
                "longest run: %d in a row from step %d",
                unread,
                longest,
                longest_from,
            )

    @property
    def failed(self) -> bool:
        return self.consecutive >= self.max_consecutive

    def error(self, step: int, checkpoint: str, resume_hint: str = "", data: str | None = None) -> TrainingDiverged:
        """The error that stops the run. `data`: the part of the last batch that holds NaN or
        inf ("inputs", "targets"), if any: then no learning rate would help."""
        if self.skip:
            first = step if self.first_bad_step is None else self.first_bad_step
            last = step if not self.on_device else first + self.consecutive - 1
            what = f"{self.consecutive} non-finite steps in a row (from step {self.first_bad_step} to {last})"
            saved = f"every one was skipped; the last good state is {checkpoint}"
        else:
            what = f"non-finite steps before step {step} (trainer.skip_nonfinite=false: they were applied)"
            saved = f"the last checkpoint saved before them is {checkpoint}"
        if data is not None:
            return TrainingDiverged(
                f"training stopped at step {step}: {what}; {saved}. The last batch holds NaN or inf {data}: the data "
                "makes the loss non-finite, whatever the learning rate; find and fix those samples"
            )
        return TrainingDiverged(
            f"training stopped at step {step}: {what}; {saved}. Try a lower optim.optimizer.lr or trainer.grad_clip=1.0"
            + (f", resuming with: {resume_hint} optim.optimizer.lr=<lower>" if resume_hint else "")
        )
