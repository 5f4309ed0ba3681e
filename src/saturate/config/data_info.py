"""What the data tells the constructors it builds: the data-derived arguments.

Once the data is described (saturate.data.base.DataSpec), a run knows the input's channels,
features and shape, the number of classes and outputs, the class names and the data's own
inverse transform of the targets. A model's or a task's constructor that names one of
DATA_ARGUMENTS (and whose node does not set it) gets it; any other argument takes one by
interpolation in its node: `input_size: ${data_info:in_features}`.

While the config is checked the data is not described yet, so `${data_info:KEY}` resolves to
a placeholder, `<data_info:KEY>`; the run binds the placeholders of its model and task nodes
to the values once it has them (`bind`). The values are passed, never kept in module state.
A new data-derived argument is one entry in `derive` and its name in DATA_ARGUMENTS.
"""

from __future__ import annotations

import re
from typing import Any

from saturate.errors import ConfigError, Problem

DATA_ARGUMENTS = (
    "in_channels",  # the input's first dimension: C of (C, H, W)
    "in_features",  # its last: F of (T, F)
    "input_shape",  # one sample's input shape (of its first input, when it has several)
    "input_shapes",  # every input's shape, in the order the model gets them
    "num_classes",  # classification: the classes; else what the data says, or None
    "num_outputs",  # values a model predicts per sample: the classes, or the target's size
    "class_names",  # the training set's `classes`, or None
    "target_inverse",  # the data's function taking targets back to their units, or None
)
RESOLVABLE = DATA_ARGUMENTS[:-1]  # ${data_info:...} takes values that a config can hold (not a function)
PLACEHOLDER = "<data_info:"  # what ${data_info:KEY} is before the data is described: <data_info:KEY>
_FOUND = re.compile(r"<data_info:([^>]*)>")


def derive(spec, data) -> dict[str, Any]:
    """The data-derived arguments of a run: `spec` a DataSpec, `data` its Data (splits, the
    target inverse)."""
    shape = tuple(spec.input_shape) or (1,)
    names = getattr(data.train, "classes", None)
    return {
        "in_channels": shape[0],
        "in_features": shape[-1],
        "input_shape": tuple(spec.input_shape),
        "input_shapes": [tuple(s) for s in spec.input_shapes] or [tuple(spec.input_shape)],
        "num_classes": spec.num_classes,
        "num_outputs": spec.num_outputs,
        "class_names": list(names) if isinstance(names, (list, tuple)) and names else None,
        "target_inverse": data.target_inverse,
    }


def placeholder(key: str) -> str:
    """The `data_info` resolver: `<data_info:KEY>` for a key the data will give; a ValueError
    naming the keys for any other (OmegaConf reports it against the key that used it)."""
    root, _, index = str(key).partition(".")
    indexable = root in ("input_shape", "input_shapes")
    if root not in RESOLVABLE or (index and not (indexable and all(p.lstrip("-").isdigit() for p in index.split(".")))):
        raise ValueError(
            f"data_info:{key}: the data gives {', '.join(RESOLVABLE)} (input_shape.<i> for one dimension, "
            "input_shapes.<i>.<j> for one input's)"
        )
    return f"{PLACEHOLDER}{key}>"


def lookup(key: str, values: dict[str, Any]) -> Any:
    """The value `${data_info:KEY}` stands for, from the run's data-derived `values`."""
    root, _, index = key.partition(".")
    value = values[root]
    for part in index.split(".") if index else ():
        i = int(part)
        if not -len(value) <= i < len(value):
            shown = tuple(value) if root == "input_shape" else value
            raise ValueError(f"data_info:{key}: the data's {root} is {shown}: index it with 0 to {len(value) - 1}")
        value = value[i]
    return list(value) if isinstance(value, tuple) else value


def bind(node: Any, values: dict[str, Any], where: str) -> Any:
    """`node` (a plain config tree) with every `<data_info:KEY>` placeholder replaced by its
    value: a whole value by the value itself, one inside a longer string by its text. A key
    the data cannot give (an index past the input's dimensions) is a ConfigError naming where."""
    if isinstance(node, dict):
        return {k: bind(v, values, f"{where}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [bind(v, values, f"{where}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, str) or PLACEHOLDER not in node:
        return node
    try:
        whole = _FOUND.fullmatch(node)
        if whole:
            return lookup(whole.group(1), values)
        return _FOUND.sub(lambda m: str(lookup(m.group(1), values)), node)
    except ValueError as e:
        text = _FOUND.sub(lambda m: "${data_info:" + m.group(1) + "}", node)
        raise ConfigError([Problem(where, text, f"a value that resolves ({e})")]) from None


def arguments(target, node: dict, values: dict[str, Any]) -> dict[str, Any]:
    """The data-derived values that `target`'s signature names and `node` does not set."""
    import inspect

    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return {}
    return {k: v for k, v in values.items() if k in params and k not in node and v is not None}
