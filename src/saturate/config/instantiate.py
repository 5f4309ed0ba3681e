"""Building an object from a user's `_target_` node, with one message for their mistake."""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

from saturate.errors import UserError


def build(node: dict, what: str, **arguments) -> Any:
    """instantiate() a `_target_` node (`what`: its key, for the message) with `arguments`
    added; the user's own mistake (a UserError) keeps its message, anything else is one line
    naming the target."""
    try:
        if not arguments or node.get("_partial_"):
            return instantiate({**node, **arguments})
        # the arguments go to the call as they are: through the node, Hydra would make each value a config node
        # first (a data set's 8,832 class names: 1.2 s)
        made = instantiate({**node, "_partial_": True})
    except InstantiationException as e:
        raise _one_line(e.__cause__ or e, node, what) from None
    try:
        return made(**arguments)
    except Exception as e:  # noqa: BLE001 (the user's constructor: one line, as instantiate() gives it)
        raise _one_line(e, node, what) from None


def _one_line(cause: BaseException, node: dict, what: str) -> UserError:
    if isinstance(cause, UserError):
        return cause.with_traceback(None)
    return UserError(f"{what}: cannot build {node['_target_']}: {' '.join(str(cause).split())[:300]}")
