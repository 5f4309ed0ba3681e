"""The checks a config value takes: a range, a choice. Each yields (key, bad value, what is
allowed) for the schema's `problems()` (saturate.config.schema); nothing when the value is
fine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from saturate.errors import is_number

# A schema's problems(): (field, bad value, what is allowed), keyed relative to its node.
Issues = Iterator[tuple[str, Any, str]]


def choice(key: str, value: Any, allowed: tuple) -> Issues:
    if value not in allowed:
        yield key, value, "one of " + ", ".join(map(str, allowed))


def at_least(key: str, value: Any, low: int | float, extra: str = "") -> Issues:
    if not is_number(value, low) and not _nan(value):  # nan: reported once, as a non-finite number
        kind = "an integer" if isinstance(low, int) else "a number"
        yield key, value, f"{kind} >= {low}{extra}"


def int_or_auto(key: str, value: Any, low: int) -> Issues:
    if value != "auto":
        yield from at_least(key, value, low, " or 'auto'")


def unit_interval(key: str, value: float, *, open_low: bool = False) -> Issues:
    ok = (0 < value <= 1) if open_low else (0 <= value <= 1)
    if not ok:
        yield key, value, "a number in (0, 1]" if open_low else "a probability in [0, 1]"


def _nan(value: Any) -> bool:
    return isinstance(value, float) and value != value
