"""The built-in data options' checks: each names the `data.<key>` at fault and what it takes."""

from __future__ import annotations

from saturate.errors import ConfigError, DataError, Problem, is_integer, is_number


def fraction(key: str, value) -> None:
    """A built-in data option's check: `data.<key>` is a number in (0, 1)."""
    if not is_number(value, 0, 1, open_low=True, open_high=True):
        raise ConfigError([Problem(f"data.{key}", value, "a number in (0, 1)")])


def seed(key: str, value) -> None:
    """A built-in data option's check: `data.<key>` is a seed every generator accepts."""
    if not is_integer(value, 0, 2**32 - 1):
        raise ConfigError([Problem(f"data.{key}", value, "an integer in [0, 4294967295]")])


def fits_in_memory(what: str, nbytes: int) -> None:
    """A data set about to be made in memory must fit in what the host has available."""
    import psutil

    available = psutil.virtual_memory().available
    if nbytes > 0.8 * available:
        raise DataError(
            f"{what}: {nbytes / 2**30:.1f} GiB in memory, more than the {available / 2**30:.1f} GiB available; make "
            "it smaller"
        )


def at_least(key: str, value, low: int) -> None:
    """A built-in data option's check: `data.<key>` is an integer >= low."""
    if not is_integer(value, low):
        raise ConfigError([Problem(f"data.{key}", value, f"an integer >= {low}")])
