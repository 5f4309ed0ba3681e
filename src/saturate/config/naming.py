"""A run's readable name: what its command line changed, or the `name` a user gives it.

The name ends the run directory (`outputs/runs/<date>/<time>_<name>`, a sweep job's
`<job>_<name>`), so TensorBoard's run list, which shows directories, tells runs apart. In a
multirun the name holds only the swept keys: what tells its jobs apart. It is written
`key-value+key-value` (`precision-bf16+loader-fast`): `=` and `,` would make the directory
unusable as an override value (`trainer.resume=<run dir>`, `hydra.run.dir=<run dir>`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf

# Overrides that say where or how a run is kept, not what it does
UNNAMED = ("run_dir", "name", "trainer.resume", "sweep")
MAX_LENGTH = 80  # a directory name stays readable (and well under any file system's limit)


def varied_keys() -> set[str]:
    """The keys this run varies: in a multirun, those it sweeps (comma lists on the command
    line, the sweeper's params of a `sweep=` preset); in a single run, its overrides."""
    if not HydraConfig.initialized():
        return set()
    hydra_cfg, parser = HydraConfig.get(), OverridesParser.create()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return {o.key_or_group for o in parser.parse_overrides(list(hydra_cfg.overrides.task))}
    swept = set(OmegaConf.select(hydra_cfg, "sweeper.params", default=None) or {})
    try:  # the multirun's own command line (the basic launcher runs its jobs in this process)
        given = [a for a in sys.argv[1:] if not a.startswith("-") and "=" in a]
        swept |= {o.key_or_group for o in parser.parse_overrides(given) if o.is_sweep_override()}
    except Exception:  # noqa: BLE001 (another launcher's argv: the sweeper's params are what is known)
        pass
    return swept


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


def slug(overrides: Iterable[str], keep: set[str] | None = None) -> str:
    """`key-value+key-value` for the overrides that name a run (those in `keep` when given)."""
    pairs = []
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith("hydra.") or key in UNNAMED or (keep is not None and key not in keep):
            continue
        pairs.append(_clean(f"{key}-{value}"))
    kept = []  # whole pairs, as many as fit
    for pair in pairs:
        if len("+".join([*kept, pair])) > MAX_LENGTH:
            break
        kept.append(pair)
    return "+".join(kept)


def run_name(name: str | None = None, overrides: Iterable[str] | None = None) -> str:
    """`_<name>` to end the run directory's name: `name` when the user set one, else the
    overrides (by default the command line's; a multirun's swept ones); "" when there is
    nothing to say."""
    if name is not None:
        name = _clean(str(name))
    elif overrides is not None:
        name = slug(overrides)
    elif HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        name = slug(hydra_cfg.overrides.task, varied_keys() if hydra_cfg.mode == RunMode.MULTIRUN else None)
    return f"_{name}" if name else ""
