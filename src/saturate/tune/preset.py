"""The preset a tune writes, `experiment/tuned_<name>.yaml`: where it goes, what it holds,
that it never overwrites a file a tune did not write, and the command that reproduces it."""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path
from typing import cast

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from saturate.config.dirs import CONF
from saturate.config.invocation import SCRIPT, TRAIN_COMMAND, Invocation
from saturate.errors import UserError
from saturate.tune.options import merged


def preset_name(cfg: DictConfig, choices: dict) -> str:
    """`tuned_<name>`: the run's `name`, else its data and model options."""
    name = cfg.name if cfg.name else f"{choices.get('data', 'data')}_{choices.get('model', 'model')}"
    return "tuned_" + re.sub(r"[^A-Za-z0-9_-]+", "_", str(name)).strip("_")


def preset_path(cfg: DictConfig, invocation: Invocation) -> Path:
    """Where the preset goes: tune.preset, or experiment/ in the user's first config dir (the
    project's ./conf, or one added with hydra.searchpath), else in ./conf/experiment/ (made:
    the project config dir of the next command run here). Never into the installed package."""
    if cfg.tune.preset != "auto":
        path = Path(cfg.tune.preset)
        return path if path.suffix == ".yaml" else path.with_suffix(".yaml")
    users = [Path(d) for d in invocation.config_dirs if Path(d).resolve() != CONF]
    folder = users[0] if users else Path.cwd() / "conf"
    return folder / "experiment" / f"{preset_name(cfg, invocation.choices)}.yaml"


def preset_text(start: list[str], changes: list[str], groups: set[str], header: str) -> str:
    """A `# @package _global_` experiment holding `start` and then `changes` (overrides):
    group choices as defaults-list overrides, keys as values."""
    defaults: list[str | dict[str, object]] = []
    values = OmegaConf.create({})
    parser = OverridesParser.create()
    for o in parser.parse_overrides(merged(start, changes)):
        key = o.key_or_group
        if o.is_delete():
            raise UserError(f"tune: ~{key} cannot be written into a preset; remove it from the command line")
        if key == "experiment":
            defaults.append(f"/experiment/{o.value()}")
        elif key in groups and "." not in key:
            defaults.append({f"override /{key}": o.value()})
        else:
            OmegaConf.update(values, key, o.value(), force_add=True)
    body = {"defaults": [*sorted(defaults, key=lambda d: isinstance(d, dict)), "_self_"]} if defaults else {}
    text = OmegaConf.to_yaml(body) if body else ""
    if values:
        text += OmegaConf.to_yaml(values)
    return f"# @package _global_\n{header}{text}"


PRESET_MARK = "# @package _global_\n# Written by saturate's tune"  # how a preset this module wrote begins


def check_overwritable(path: Path) -> None:
    """`path` is new, or a preset an earlier tune wrote; anything else (saturate's own
    config.yaml, a user's file) is refused, never overwritten."""
    if not path.exists():
        return
    head = ""
    if path.is_file():
        try:
            with open(path, "rb") as f:
                head = f.read(len(PRESET_MARK)).decode("utf-8", "replace")
        except OSError as e:
            raise UserError(f"tune.preset: cannot read {path} ({e.strerror or e}); give another path") from None
    if head != PRESET_MARK:
        raise UserError(
            f"tune.preset: {path} exists and is not a preset saturate's tune wrote; it is never overwritten: give "
            "tune.preset=<a new .yaml path>, or remove that file yourself"
        )


def write_preset(
    path: Path,
    start: list[str],
    changes: list[str],
    *,
    groups: set[str],
    searchpath: list[str],
    speedup: float,
    rate: float,
    confirmed: bool,
) -> None:
    """The preset `path`: `start` then `changes` (`groups`: the config groups, whose
    overrides become defaults-list entries)."""
    check_overwritable(path)
    how = "" if confirmed or not changes else " (one trial each, not confirmed)"
    header = (
        f"# Written by saturate's tune on {datetime.now():%Y-%m-%d %H:%M}: {rate:,.0f} samples/s, {speedup:.2f}x the "
        f"starting config{how}:\n#   saturate train tune=true {' '.join(searchpath + start)}\n# Reproduce it: "
        f"{reproduce(path, searchpath)}\n"
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(preset_text(start, changes, groups, header))
    except OSError as e:
        raise UserError(
            f"tune.preset: cannot write {path} ({e.strerror or e}); set tune.preset=<a writable .yaml path>"
        ) from None


def reproduce(preset: Path, searchpath: list[str]) -> str:
    """The command that trains with the preset, from the folder the tune ran in: with the
    config dirs the tune was given (`searchpath`: its hydra.searchpath override) and the one
    the preset is in, unless that is found there by convention (./conf)."""
    command = "saturate train" if os.environ.get(SCRIPT) == TRAIN_COMMAND else "python train.py"
    if preset.parent.name != "experiment":
        return f"copy it to <a config dir>/experiment/, then {command} experiment={preset.stem}"
    given = [cast("list[str]", o.value() or []) for o in OverridesParser.create().parse_overrides(searchpath)]
    dirs = [str(d) for value in given for d in value]  # hydra.searchpath's value is a list
    root = preset.parent.parent.resolve()
    found = (CONF, (Path.cwd() / "conf").resolve())  # saturate's own groups, the project's by convention
    if root not in found and not any(
        d.removeprefix("file://") and Path(d.removeprefix("file://")).resolve() == root for d in dirs
    ):
        dirs.append(f"file://{root}")
    where = [f"hydra.searchpath=[{','.join(dirs)}]"] if dirs else []
    return " ".join([command, *where, f"experiment={preset.stem}"])
