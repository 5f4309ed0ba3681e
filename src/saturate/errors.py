"""Errors that are the user's to fix.

They derive from Hydra's `CompactHydraException`, which Hydra prints as the message alone
(no traceback); train.py prints them as one `error: ...` message and exits 1 (saturate.cli).
In a multirun the failed job is recorded and the others go on. From Python they are
ordinary exceptions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

from hydra.errors import CompactHydraException


class UserError(CompactHydraException):
    """A mistake in the input (config, data, paths): one short message, no traceback."""


@dataclass(frozen=True)
class Problem:
    key: str  # full dotted key, e.g. "loader.num_workers"
    value: Any
    allowed: str  # what would be accepted, e.g. "an integer >= 0 or 'auto'"

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: expected {self.allowed}"


class ConfigError(UserError):
    """Every problem found in one config, reported together."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        n = len(problems)
        lines = [f"invalid config ({n} problem{'s' if n > 1 else ''}):"]
        lines += [f"  {p}" for p in problems]
        super().__init__("\n".join(lines))

    def __reduce__(self):
        # rebuilt from its problems, not its message: a sweep's job sends it back pickled (submitit)
        return type(self), (self.problems,), self.__dict__


def is_integer(value: Any, low: int | None = None, high: int | None = None) -> TypeGuard[int]:
    """Whether `value` is an int (a bool is not one) in [low, high]: the check behind every
    "an integer >= ..." in a message."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (low is None or value >= low)
        and (high is None or value <= high)
    )


def is_number(
    value: Any, low: float = -math.inf, high: float = math.inf, *, open_low: bool = False, open_high: bool = False
) -> bool:
    """Whether `value` is an int or a float (a bool is not one) in the range, its ends
    included unless open; nan never is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (value > low if open_low else value >= low) and (value < high if open_high else value <= high)


class DataError(UserError):
    """Missing, unreadable or malformed data."""


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not fit this run."""


def printable(text: object) -> str:
    """A file name (or text holding one) that can always be printed and logged: bytes that
    are not UTF-8 (os.listdir hands them over as surrogates, which no log file or terminal
    can encode) are written as escapes, e.g. `\\xff`."""
    return str(text).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def named_parts(batch) -> list[tuple[str, object]]:
    """A batch's entries by name, for messages: the inputs and targets of a pair (each of
    several inputs by its place), a dict's keys."""

    def named(tree, name: str) -> list[tuple[str, object]]:
        if isinstance(tree, dict):
            return [pair for k, v in tree.items() for pair in named(v, f"{name}.{k}" if name else str(k))]
        if isinstance(tree, (tuple, list)):
            return [pair for i, v in enumerate(tree) for pair in named(v, f"{name}[{i}]")]
        return [(name, tree)]

    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return [*named(batch[0], "inputs"), ("targets", batch[1])]
    if isinstance(batch, dict):
        return named(batch, "")
    return [("batch", batch)]
