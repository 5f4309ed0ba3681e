"""A user's config file that would expand into more nodes than any config holds (a YAML
"billion laughs": anchors of anchors, each alias a copy once loaded) is refused before Hydra
composes it: Hydra and OmegaConf would build every copy, for hours and gigabytes.

Only the user's config dirs are read (hydra.searchpath on the command line, a project's own
conf/): saturate's are its own. Only a file holding both an anchor mark (`&`) and an alias
mark (`*`) is parsed, with PyYAML's composer, which keeps each alias as a reference to its
anchor's node instead of copying it; the size counted from that graph is the size the file
would load to.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import yaml

from saturate.errors import UserError, printable
from saturate.files import open_regular

MAX_NODES = 100_000  # far above any config (saturate's whole composed config: a few hundred), about 1 s in OmegaConf
SEARCHPATH = "hydra.searchpath="


def _dirs(argv: Iterable[str]) -> list[Path]:
    """The file config dirs a user adds: hydra.searchpath's (file:// or a plain path), then a
    project's conf/ (saturate.config.dirs)."""
    from saturate.config.dirs import use_project_conf

    dirs = []
    for arg in argv:
        if arg.startswith(SEARCHPATH):
            given = arg.removeprefix(SEARCHPATH).strip("[]")
            entries = (e.strip().strip("'\"") for e in given.split(","))
            dirs += [Path(e.removeprefix("file://")) for e in entries if e and not e.startswith("pkg://")]
    project = use_project_conf()
    return [*dirs, *([project] if project is not None else [])]


def _expanded(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many nodes `node` loads to, each alias counted as the copy it becomes."""
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = 1  # a node that holds itself (an alias inside its own anchor) counts once
    if isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_expanded(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total = 1 + sum(_expanded(k, sizes) + _expanded(v, sizes) for k, v in node.value)
    else:
        total = 1
    sizes[id(node)] = total
    return total


def _check(path: Path) -> None:
    try:  # a regular file only (a FIFO is not waited on); Hydra says what it cannot read
        with open_regular(path, "a config file") as f:
            text = f.read().decode("utf-8", errors="replace")
    except (OSError, UserError):
        return
    if "&" not in text or "*" not in text:
        return
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise UserError(f"{printable(path)}: nested too deep to load as a config") from None
    except yaml.YAMLError:
        return  # Hydra's loader answers it, naming the line
    if node is not None and (size := _expanded(node, {})) > MAX_NODES:
        raise UserError(
            f"{printable(path)}: its YAML aliases expand to {size:,} nodes (at most {MAX_NODES:,}): a config does "
            "not repeat itself that often; write the values out, or fewer levels of alias"
        )


def refuse_alias_bombs(argv: Iterable[str]) -> None:
    """A UserError naming the first user config file that would expand past MAX_NODES."""
    for folder in _dirs(argv):
        if folder.is_dir():
            for path in sorted(folder.rglob("*.yaml")):
                _check(path)
