"""One dispatcher for every observer: callbacks (on every rank) and loggers (on rank 0).

A hook is called on every observer that has it, in order: callbacks first (in the order
configured), then loggers. What can go wrong in a user's hook is bounded:

- a hook that raises ends the run with one line naming it and its error (CallbackError):
  last.pt is saved at the last completed step, metrics.json says `failed`. So does a hook
  that raises SystemExit (sys.exit), a KeyboardInterrupt no SIGINT sent, or any other
  BaseException: a hook may not end the run (exit status 0 and no record, a sweep that
  silently drops its later jobs); only a real second Ctrl-C passes through;
- a hook gets its own copy of each dict it is given (the metrics): what it changes there
  changes nothing the run or the other observers record;
- a hook that hangs cannot keep a run alive past a stop signal: HANG_S after the signal
  (or after the hook started, if the signal came first) it is interrupted and abandoned
  with a warning naming it, and the run stops as any stopped run does. A hook that swallows
  that interrupt too (`except BaseException`) is abandoned HANG_S later by `abandon`: the
  run saves what it can and the process exits with the signal's status.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from saturate.callbacks.base import HOOKS, Callback, Run
from saturate.errors import UserError

log = logging.getLogger(__name__)

HANG_S = 5.0  # once the run is asked to stop, how long a hook may still run before it is abandoned


class CallbackError(UserError):
    """A callback's or logger's hook raised: one line naming it."""


class CallbackHung(BaseException):
    """Raised inside a hook that did not return within HANG_S of a stop signal. A
    BaseException, so that a callback's own `except Exception` does not swallow it."""


_INSTEAD = "to stop it, call run.request_stop(reason); to fail it, raise an Exception"


def _leaving(error: BaseException) -> str:
    """A BaseException a hook raised, in words: SystemExit with its status."""
    if isinstance(error, SystemExit):
        code = error.code if error.code is not None else 0
        return f"SystemExit (exit status {code})" if isinstance(code, int) else f"SystemExit: {str(code)[:200]}"
    text = " ".join(str(error).split())[:300]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


_KEEPABLE = "keep tensors, numbers, strings, lists and dicts of them in a callback's state"


def _gist(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]


def _refused(error: BaseException) -> str:
    """What torch.load(weights_only=True) refused, from its long message: the global's name."""
    import re

    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    return found.group(1) if found else f"{type(error).__name__}: {_gist(error)[:120]}"


class Observers:
    """The run's callbacks and loggers behind one call per hook. `callbacks` and `loggers`:
    {name: object}; loggers are dropped on ranks other than 0 (`is_main`)."""

    def __init__(
        self, callbacks: dict[str, Any] | None = None, loggers: dict[str, Any] | None = None, *, is_main: bool = True
    ):
        self.callbacks = dict(callbacks or {})
        self.loggers = dict(loggers or {}) if is_main else {}
        every = {**self.callbacks, **self.loggers}
        for name, obj in every.items():
            if not any(callable(getattr(obj, hook, None)) for hook in HOOKS):
                raise UserError(f"callbacks: {name} ({type(obj).__name__}) has none of the hooks {', '.join(HOOKS)}")
        # a hook a subclass of Callback inherits does nothing: not called (an on_checkpoint would
        # make every save wait for its files, an on_train_batch_end would add a call per step)
        own = lambda obj, hook: getattr(type(obj), hook, None) is not getattr(Callback, hook)
        self._hooks = {
            hook: [
                (name, fn) for name, obj in every.items() if callable(fn := getattr(obj, hook, None)) and own(obj, hook)
            ]
            for hook in HOOKS
        }
        self.running: str | None = None  # the hook running now, as name.hook
        self.stopping = False  # a stop signal arrived
        self.signal: int | None = None  # which
        self._previous_alarm: Any = None  # SIGALRM's handler while a hook is on the clock
        self._interrupted = False  # CallbackHung raised in the running hook
        # what ends the process when a hook swallows CallbackHung (the run sets one that saves first)
        self.abandon: Callable[[int], None] = lambda signum: os._exit(128 + signum)

    def has(self, hook: str) -> bool:
        """Whether any observer implements `hook` (the loop skips per-step calls otherwise)."""
        return bool(self._hooks[hook])

    def call(self, hook: str, run: Run, *args) -> None:
        for name, fn in self._hooks[hook]:
            self.running = f"{name}.{hook}"
            try:
                if self.stopping:
                    self._arm()
                fn(
                    run, *(dict(a) if isinstance(a, dict) else a for a in args)
                )  # its own copy: what it changes is its own
            except CallbackHung:
                log.warning(
                    "%s did not return within %.0f s of the stop signal: abandoned; the run stops", self.running, HANG_S
                )
            except Exception as e:
                if isinstance(e, RuntimeError) and "DataLoader worker" in str(e):
                    # torch's SIGCHLD handler raises a worker's death in whatever the main thread
                    # runs, a logger's hook included: the loader's failure, not the hook's
                    raise
                raise CallbackError(
                    f"{self.running} raised {type(e).__name__}: {' '.join(str(e).split())[:300]}"
                ) from e
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt) and self.signal == signal.SIGINT:
                    raise  # Ctrl-C twice: the user's, not the hook's
                why = f"{self.running} raised {_leaving(e)}: a hook may not end the run; {_INSTEAD}"
                raise CallbackError(why) from e
            finally:
                self._disarm()
                self._interrupted = False
                self.running = None

    # -- a hook that hangs after a stop signal

    def stop_requested(self, signum: int) -> None:
        """Called from the stop signal's handler: a hook running now gets HANG_S to return."""
        self.stopping, self.signal = True, signum
        if self.running is not None:
            self._arm()

    def _arm(self) -> None:
        if self._previous_alarm is None and threading.current_thread() is threading.main_thread():
            self._previous_alarm = signal.signal(signal.SIGALRM, self._hung)
            signal.setitimer(signal.ITIMER_REAL, HANG_S)

    def _disarm(self) -> None:
        if self._previous_alarm is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous_alarm)
            self._previous_alarm = None

    def _hung(self, signum, frame) -> None:
        if self._interrupted:  # the hook caught CallbackHung and went on: end the process
            log.error(
                "%s did not return within %.0f s of the stop signal and swallowed the interrupt: abandoned; "
                "the run saves and ends here",
                self.running,
                HANG_S,
            )
            self.abandon(self.signal or signal.SIGTERM)
            return
        self._interrupted = True
        signal.setitimer(signal.ITIMER_REAL, HANG_S)  # once more, in case the hook swallows what follows
        raise CallbackHung(self.running)

    # -- state kept in checkpoints

    def state_dict(self) -> dict[str, Any]:
        """{name: state} of every callback with a state_dict()."""
        return {
            name: obj.state_dict() for name, obj in self.callbacks.items() if callable(getattr(obj, "state_dict", None))
        }

    def check_state(self) -> None:
        """Each callback's state through torch.save and torch.load(weights_only=True), as a
        checkpoint takes it, before the first step: a state that cannot be saved (a lambda, an
        open file) or that resume would refuse to load (an object of the user's class) is one
        line now, not a pickling traceback at the first save or a refusal at resume."""
        import io

        import torch

        for name, obj in self.callbacks.items():
            if not callable(getattr(obj, "state_dict", None)):
                continue
            try:
                state = obj.state_dict()
            except Exception as e:  # noqa: BLE001 (the user's code: one line)
                raise UserError(f"callbacks: {name}.state_dict() raised {type(e).__name__}: {_gist(e)}") from None
            buffer = io.BytesIO()
            try:
                torch.save(state, buffer)
            except Exception as e:  # noqa: BLE001 (pickle's errors: AttributeError, TypeError, PicklingError)
                raise UserError(
                    f"callbacks: {name}.state_dict() cannot be saved in a checkpoint ({type(e).__name__}: {_gist(e)}); "
                    f"{_KEEPABLE}"
                ) from None
            buffer.seek(0)
            try:
                torch.load(buffer, weights_only=True)
            except Exception as e:  # noqa: BLE001 (torch's UnpicklingError names the refused global)
                raise UserError(
                    f"callbacks: {name}.state_dict() holds what a checkpoint cannot load safely "
                    f"(torch.load(weights_only=True) refuses {_refused(e)}); {_KEEPABLE}"
                ) from None

    def load_state_dict(self, states: dict[str, Any]) -> None:
        """Give each callback its saved state (by name); one the checkpoint has no state for
        starts fresh, with a warning (it was added since)."""
        for name, obj in self.callbacks.items():
            load = getattr(obj, "load_state_dict", None)
            if not callable(load):
                continue
            if name in states:
                load(states[name])
            else:
                log.warning("callbacks: the checkpoint holds no state for %s; it starts fresh", name)
