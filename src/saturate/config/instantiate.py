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
        return instantiate({**node, **arguments})
    except InstantiationException as e:
        cause = e.__cause__ or e
        if isinstance(cause, UserError):
            raise cause.with_traceback(None) from None
        raise UserError(f"{what}: cannot build {node['_target_']}: {' '.join(str(cause).split())[:300]}") from None
