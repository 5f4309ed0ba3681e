"""A value a config reads from the environment (`${oc.env:NAME}`: a token, a password) is
never written into a record of the run: where saturate serializes the run's config or a
message (metrics.json, report.md, TensorBoard's config text and HParams, a checkpoint's
config), the value is written as the interpolation that read it.

`record_env_reads()` puts a recording `oc.env` resolver in OmegaConf's place: every value
it hands out is remembered with its variable's name, however the config reaches it (directly,
through another key's interpolation, inside an error message). `masked(obj)` gives `obj`
(text, or dicts and lists of it) with each remembered value written as `${oc.env:NAME}`.
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import OmegaConf
from omegaconf.resolvers import oc

MIN_LENGTH = 3  # shorter values (`0`, `1`, `on`) are no secret, and would be found inside any number or word
_read: dict[str, str] = {}  # value -> the variable's name
_NO_DEFAULT = object()


def _env(key: str, default: Any = _NO_DEFAULT) -> str | None:
    value = oc.env(key) if default is _NO_DEFAULT else oc.env(key, default)
    if isinstance(value, str) and len(value) >= MIN_LENGTH:
        _read[value] = key
    return value


def record_env_reads() -> None:
    """OmegaConf's `oc.env`, remembering what it reads (calling it again does nothing more)."""
    OmegaConf.register_new_resolver("oc.env", _env, replace=True)


# a value is masked where it stands as a whole word of the text: between these (or at an end), never inside a
# path, a name or a number (`${oc.env:USER}`'s `alex` stays in /home/alex and alexnet)
_APART = r"""\s'"=,:;()\[\]{}"""


def masked(obj: Any) -> Any:
    """`obj` with every value read through `oc.env` written as `${oc.env:NAME}` where it stands
    as a whole word (a config's value, `key=value` in a message): text, and the text in dicts,
    lists and tuples (their keys too); anything else as it is."""
    if not _read:
        return obj
    if isinstance(obj, str):
        for value in sorted(_read, key=len, reverse=True):  # a value inside a longer one: the longer first
            if value in obj:
                word = rf"(?<![^{_APART}]){re.escape(value)}(?![^{_APART}])"
                obj = re.sub(word, f"${{oc.env:{_read[value]}}}", obj)  # a variable's name holds no backslash
        return obj
    if isinstance(obj, dict):
        return {masked(k): masked(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [masked(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):  # a named tuple's fields are not text to record
        return tuple(masked(v) for v in obj)
    return obj
