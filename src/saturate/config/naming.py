"""A run's readable name: what its command line changed, or the `name` a user gives it.

The name ends the run directory (`outputs/runs/<date>/<time>_<name>`, a sweep job's
`<job>_<name>`), so TensorBoard's run list, which shows directories, tells runs apart. In a
multirun the name holds only the swept keys: what tells its jobs apart. It is written
`key-value+key-value`, keys by their last part (`precision-bf16+batch_size-64`): `=` and `,`
would make the directory unusable as an override value (`trainer.resume=<run dir>`,
`hydra.run.dir=<run dir>`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from saturate.config.invocation import Invocation, is_setting, key_of

MAX_LENGTH = 80  # a directory name stays readable (and well under any file system's limit)
SAFE = r"A-Za-z0-9._+-"  # what a path, a shell and Hydra's override grammar all take unquoted


def _clean(text: str) -> str:
    """`text` with anything a path, a shell or an override would trip on replaced by '-', shortened."""
    return re.sub(rf"[^{SAFE}]+", "-", text).strip("-")[:MAX_LENGTH]


def override_value(text: str) -> str:
    """`text` as a value on Hydra's command line: as it is when the grammar takes it
    unquoted, else single-quoted with its quotes escaped."""
    if re.fullmatch(rf"[{SAFE}/:]+", text):
        return text
    return "'" + text.replace("'", "\\'") + "'"


def slug(overrides: Iterable[str], keep: set[str] | frozenset[str] | None = None) -> str:
    """`key-value+key-value` for the overrides that are settings (those in `keep` when given),
    each key by its last part (`batch_size-32` for `loader.batch_size=32`) unless two of them
    would then read the same (`optim.lr` and `scheduler.lr` stay whole)."""
    settings = []
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if is_setting(override) and (keep is None or key_of(override) in keep):
            settings.append((key, value))
    short = [key.rsplit(".", 1)[-1] for key, _ in settings]
    pairs = [
        _clean(f"{name if short.count(name) == 1 else key}-{value}")
        for name, (key, value) in zip(short, settings, strict=True)
    ]
    kept: list[str] = []  # whole pairs, as many as fit
    for pair in pairs:
        if len("+".join([*kept, pair])) > MAX_LENGTH:
            break
        kept.append(pair)
    return "+".join(kept)


def run_name(name: str | None = None, invocation: Invocation | None = None) -> str:
    """`_<name>` to end the run directory's name: `name` when the user set one, else the
    run's settings (a multirun job's swept ones); "" when there is nothing to say."""
    if name is not None:
        name = _clean(str(name))
    elif invocation is not None:
        name = slug(invocation.overrides, invocation.varied if invocation.multirun else None)
    return f"_{name}" if name else ""


def identity(invocation: Invocation, run_dir) -> dict[str, str | None]:
    """How trackers name a run (saturate.callbacks.Run.info): `name`, what its command line set
    (a sweep job: what the sweep varied), else its directory's name; `app`, the script's name
    (`train`: the Hydra job's name); `sweep`, a multirun's directory, else None."""
    from pathlib import Path

    name = slug(invocation.overrides, invocation.varied if invocation.multirun else None)
    app = Path(invocation.app.split()[-1]).stem if invocation.app else ""  # `saturate train`: train
    return {"name": name or Path(run_dir).name, "app": app or "saturate", "sweep": invocation.sweep_dir}
