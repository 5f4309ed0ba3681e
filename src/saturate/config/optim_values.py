"""The values of optim.optimizer and of each optim.param_groups entry, judged by one rule
before any work: a key the optimizer class takes (a group may hold keys of its own for the
user's code, but not a misspelling of one the class takes), of the
type its default has, and values its constructor accepts, tried on a stand-in parameter (torch
checks ranges there: a negative lr, momentum or weight_decay). A group's values are tried
with optim.optimizer's, as the run builds them. optim.scheduler's periods are checked too:
torch divides by them at its first step."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterator
from typing import Any

from hydra.utils import get_method

from saturate.errors import Problem, is_integer, is_number

# keys whose check needs the run's device (fused and capturable kernels): their type only
DEVICE_KEYS = ("fused", "foreach", "capturable", "differentiable")
# optim.scheduler keys that torch divides by: a period of 0 fails at the first step
PERIODS = ("step_size", "T_max", "T_0", "total_steps", "step_size_up")


def optimizer_problems(node: dict, groups: list) -> Iterator[Problem]:
    """optim.optimizer's values, then each group's (keys, types, what the class accepts)."""
    target = str(node.get("_target_"))
    cls = _optimizer_class(target)
    if cls is None:
        return
    params = _keywords(cls)
    values = {k: v for k, v in node.items() if not k.startswith("_") and (params is None or k in params)}
    own = list(_values_problems(cls, target, params, values, values, "optim.optimizer"))
    yield from own
    for i, group in enumerate(groups):
        if not isinstance(group, dict):
            continue  # the schema's own check names it
        prefix = f"optim.param_groups[{i}]"
        # a key the class does not take stays in the group for the user's code (torch keeps it: a `name`), unless it
        # is a misspelling of one it takes (`lrr`), which would leave that one at its default without a word
        mine = {k: v for k, v in group.items() if k != "params" and (params is None or k in params)}
        misspelt = {}
        for key in (k for k in group if k != "params" and k not in mine):
            close = difflib.get_close_matches(key, list(params or ()), n=1, cutoff=0.75)
            if close:
                misspelt[key] = close[0]
                allowed = f"an argument of {target} (did you mean {close[0]}?), or a key of your own unlike any of its"
                yield Problem(f"{prefix}.{key}", group[key], allowed)
        if not own and not misspelt:
            yield from _values_problems(cls, target, params, mine, {**values, **mine}, prefix)


def scheduler_problems(node: Any) -> Iterator[Problem]:
    """optim.scheduler's periods (step_size, T_max, ...): integers >= 1, which torch divides by."""
    if not isinstance(node, dict):
        return
    name = str(node.get("_target_", "")).rpartition(".")[2]
    for key in PERIODS:
        value = node.get(key)
        if is_integer(value) and value < 1:  # another type is the target check's to name (an integer expected)
            yield Problem(f"optim.scheduler.{key}", value, f"an integer >= 1 ({name} divides by it)")


def _optimizer_class(target: Any):
    """The optimizer class the node names, when it is a torch.optim.Optimizer (the only kind
    whose constructor can be tried on a stand-in); None otherwise."""
    import torch

    try:
        cls = get_method(target) if isinstance(target, str) else None
    except Exception:  # noqa: BLE001 (a target that does not import is the node check's to report)
        return None
    return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else None


def _keywords(cls) -> dict[str, Any] | None:
    """The constructor's arguments besides the parameters, with their defaults; None where it
    takes any keyword (**kwargs)."""
    try:
        found = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in found.values()):
        return None
    return {name: p.default for name, p in found.items() if name != "params"}


def _values_problems(
    cls, target: str, params: dict | None, blamed: dict, values: dict, prefix: str
) -> Iterator[Problem]:
    """`blamed` (the keys of `prefix`) of the type their defaults have; then `values` tried on a
    stand-in parameter: a refusal names the key that is refused alone, else the whole node."""
    typed = True
    for key, value in blamed.items():
        wrong = _type_problem(cls, key, value, (params or {}).get(key, inspect.Parameter.empty))
        if wrong is not None:
            typed = False
            yield Problem(f"{prefix}.{key}", value, wrong)
    if not typed or _refusal(cls, {}) is not None:  # a class that refuses the stand-in itself (Muon: 2-D only)
        return
    refusal = _refusal(cls, values)
    if refusal is None:
        return
    for key, value in blamed.items():
        alone = _refusal(cls, {key: value})
        if alone is not None:
            yield Problem(f"{prefix}.{key}", value, f"a value {target} takes ({alone})")
            return
    together = " together with optim.optimizer's" if prefix != "optim.optimizer" else " together"
    yield Problem(prefix, blamed, f"values {target} takes{together} ({refusal})")


def _type_problem(cls, key: str, value: Any, default: Any) -> str | None:
    """What is wrong with `value`'s type, judged by the default's (a number, true or false, a
    list of numbers); None when it fits or the default says nothing."""
    name = f"{cls.__name__}'s {key}"
    if isinstance(default, bool):
        return None if isinstance(value, bool) or key in DEVICE_KEYS else f"true or false ({name})"
    if isinstance(default, (int, float)):
        return None if is_number(value) else f"a number ({name})"
    if isinstance(default, tuple) and all(isinstance(v, (int, float)) for v in default):
        fits = isinstance(value, (list, tuple)) and len(value) == len(default) and all(map(is_number, value))
        return None if fits else f"a list of {len(default)} numbers ({name})"
    return None


def _refusal(cls, values: dict) -> str | None:
    """The constructor's refusal of `values` on a stand-in parameter, in one line; None if
    it takes them (or fails for a reason of the device's, checked when the run builds it)."""
    import torch

    tried = {k: v for k, v in values.items() if k not in DEVICE_KEYS}
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **tried)
    except (TypeError, ValueError) as e:
        return " ".join(str(e).split())[:200]
    except Exception:  # noqa: BLE001 (a user's optimizer failing otherwise: the run's build reports it)
        return None
    return None
