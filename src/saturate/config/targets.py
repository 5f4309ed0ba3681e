"""`_target_` nodes checked against what they name: the target imports, each key is one of its
parameters (of the plain type its annotation says), and a complete call has every required
argument. Nested nodes (a task's loss and metrics) are checked too."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

from hydra.utils import get_method

from saturate.config.data_info import PLACEHOLDER
from saturate.errors import Problem


def check_target(node: Any, prefix: str, given: tuple[str, ...]) -> Iterator[Problem]:
    """A `_target_` node: the target imports, and every key is one of its parameters."""
    if not isinstance(node, dict):
        yield Problem(prefix, node, "a node with a `_target_` (an importable callable) and its keyword arguments")
        return
    target = node.get("_target_")
    try:
        fn = get_method(target) if isinstance(target, str) else None
    except Exception:  # noqa: BLE001 (a target that cannot be imported is reported by its own check)
        fn = None
    if fn is None:
        yield Problem(f"{prefix}._target_", target, "an importable class or function")
        return
    try:
        params = _signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return
    allowed = [name for name in params if name not in given and name != "params"]
    if not node.get("_partial_"):  # a complete call: every required argument is in the node
        for name, p in params.items():
            required = p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            if required and name not in node and name not in given:
                yield Problem(f"{prefix}.{name}", "(missing)", f"a value: {target} requires it")
    for key, value in node.items():
        yield from _nested_targets(value, f"{prefix}.{key}")
        if key in params and not key.startswith("_") and not (isinstance(value, str) and value.startswith(PLACEHOLDER)):
            expected = _plain_type(params[key].annotation)
            if expected is not None and not _is(value, expected):
                name = getattr(fn, "__qualname__", None) or str(target)
                yield Problem(
                    f"{prefix}.{key}",
                    value,
                    f"{_A[expected[0]]}{' or null' if None in expected else ''} ({name}'s {key})",
                )
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for key, value in node.items():
        if not key.startswith("_") and key not in params:
            yield Problem(f"{prefix}.{key}", value, f"an argument of {target}: " + ", ".join(allowed))


def _nested_targets(value: Any, prefix: str) -> Iterator[Problem]:
    """`_target_` nodes inside a node's arguments (a task's loss and metrics), checked too."""
    if isinstance(value, dict) and "_target_" in value:
        yield from check_target(value, prefix, given=())
    elif isinstance(value, dict):
        for key, inner in value.items():
            yield from _nested_targets(inner, f"{prefix}.{key}")
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from _nested_targets(inner, f"{prefix}[{i}]")


_A = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _signature(fn) -> inspect.Signature:
    """fn's signature with its annotations evaluated where they can be (`from __future__
    import annotations` makes them strings)."""
    try:
        return inspect.signature(fn, eval_str=True)
    except Exception:  # noqa: BLE001 (an annotation that does not evaluate: the names alone)
        return inspect.signature(fn)


def _plain_type(annotation) -> tuple | None:
    """(type, maybe None) for an annotation of int, float, bool or str, optionally `| None`;
    None for anything else (not checked here: the callable checks its own values)."""
    import types
    import typing

    if annotation in _A:
        return (annotation,)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = typing.get_args(annotation)
        plain = [m for m in members if m is not type(None)]
        if len(plain) == 1 and plain[0] in _A and len(members) == 2:
            return (plain[0], None)
    return None


def _is(value, expected: tuple) -> bool:
    if value is None:
        return None in expected
    kind = expected[0]
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)
