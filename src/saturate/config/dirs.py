"""Where configs come from: saturate's own groups, shipped inside the package (`CONF`), and a
project's own config dir, found by a convention instead of a search path typed on every
command.

A project's config dir is `./conf` in the folder the command runs from, or the folder that
`[tool.saturate] config-dir` names in that folder's `pyproject.toml` (relative to it). Parent
folders are never searched. The project's code imports from the folders `[tool.saturate]
pythonpath` names (relative to it; a `src/` layout: `["src"]`), by default the folder itself.
saturate's commands (`saturate train`, `python train.py`, `saturate eval` and `export`; and
`saturate.fit` for its call) put the config dir first on Hydra's search path
(through `PROJECT_ENV`, which the processes they start inherit: torchrun's ranks, SLURM's
jobs), so that its options sit beside saturate's and its `config.yaml`, when it has one, is
the primary config: a project's own defaults.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from saturate.errors import UserError

CONF = Path(__file__).resolve().parents[1] / "conf"  # saturate's own config groups, in the package
PROJECT_ENV = "SATURATE_CONFIG_DIR"  # the project's config dir, absolute, for Hydra's search path (hydra_plugins)


def project_table(folder: Path) -> dict:
    """`[tool.saturate]` of `folder`'s pyproject.toml ({} without one)."""
    pyproject = folder / "pyproject.toml"
    if not pyproject.is_file():
        return {}
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the same parser, before it joined the standard library
        import tomli as tomllib
    try:
        table = tomllib.loads(pyproject.read_text()).get("tool", {}).get("saturate", {})
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as e:
        raise UserError(f"{pyproject}: cannot be read ({e}); fix it, or remove [tool.saturate]") from None
    known = ("config-dir", "pythonpath")
    for key, value in table.items():
        if key not in known:
            allowed = f"one of the keys {', '.join(known)}"
            raise UserError(f"[tool.saturate] {key}={value!r} in {pyproject}: expected {allowed}")
    paths = table.get("pythonpath", [])
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise UserError(f"[tool.saturate] pythonpath={paths!r} in {pyproject}: expected a list of folders")
    return table


def project_pythonpath(folder: Path) -> list[Path]:
    """Where a project's code imports from: `[tool.saturate] pythonpath`, else the folder."""
    return [(folder / p).resolve() for p in project_table(folder).get("pythonpath", ["."])]


def project_conf(folder: Path) -> Path | None:
    """The project config dir of `folder`: `[tool.saturate] config-dir` in its pyproject.toml,
    else its `conf/`, else None."""
    pyproject = folder / "pyproject.toml"
    if pyproject.is_file():
        table = project_table(folder)
        named = table.get("config-dir")
        if named is not None:
            found = (folder / str(named)).resolve()
            if not found.is_dir():
                raise UserError(
                    f"[tool.saturate] config-dir={named!r} in {pyproject}: expected a folder; there is none at {found}"
                )
            return found
    found = folder / "conf"
    return found.resolve() if found.is_dir() and found.resolve() != CONF else None


def use_project_conf(folder: Path | None = None) -> Path | None:
    """A command's start (saturate train, python train.py, eval, export): find the project
    config dir of `folder` (default: the working dir) and put it on the search path of every
    composition in this process and those it starts; returns it. One set already (a parent
    process found it) is kept."""
    if os.environ.get(PROJECT_ENV):
        return Path(os.environ[PROJECT_ENV])
    found = project_conf(Path.cwd() if folder is None else folder)
    if found is not None:
        os.environ[PROJECT_ENV] = str(found)
    return found


@contextlib.contextmanager
def project_search_path() -> Iterator[Path | None]:
    """For a call from Python (saturate.fit) in a process that goes on: the working dir's
    project config dir on the search path for the block only (one a command set is kept)."""
    before = os.environ.get(PROJECT_ENV)
    try:
        yield use_project_conf()
    finally:
        if before is None:
            os.environ.pop(PROJECT_ENV, None)
