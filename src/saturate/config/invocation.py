"""How this run was started: the overrides it was given, the option chosen in each config
group, whether it is one job of a sweep and what that sweep varies, where Hydra put it.

Read once from Hydra's runtime config at the edge (train.py's task; `saturate.train` called
inside a user's own `@hydra.main`) into one `Invocation`, which is passed down to whatever
needs it; `saturate.fit` makes the same value from the overrides it was given. This module is
the only one that reads Hydra's runtime state (the resolvers in saturate.config.registration
ask it).

One filter says which overrides are the run's settings (`is_setting`): what names a run,
fills the HParams overrides column and goes into a tune's preset.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import cast

# Where a process ran and how it was started: a process started again gets its own
PLACEMENT = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.mode", "hydra.job.num", "hydra.job.id")
# Keys that say where or how a run is kept, shown or named, not what it computes (the loggers: where it is
# recorded; `logger=[tensorboard,mlflow]` does not name the run dir)
NOT_SETTINGS: tuple[str, ...] = ("run_dir", "name", "sweep", "tune", "trainer.resume", "trainer.restart")
NOT_SETTINGS += ("trainer.progress", "trainer.log_level", "logger", "checkpoint.background")
# The script the user ran, for the processes that do not run it themselves (a SLURM job runs submitit's)
SCRIPT = "SATURATE_SCRIPT"
TRAIN_COMMAND = "saturate train"  # SCRIPT's value for the installed command (else train.py's path)


# Hydra's override parser takes time quadratic in a value's elements (1,000: 0.2 s; 4,000: 2 s; 60,000:
# hours), and OmegaConf recurses once per level of nesting: a value past either bound is refused unparsed
MAX_ELEMENTS = 1000
MAX_DEPTH = 32


def _shape(value: str) -> tuple[int, int]:
    """(elements, deepest nesting) of an override's value, read as Hydra's grammar reads it:
    commas and brackets inside quotes are text."""
    commas = depth = deepest = 0
    quote, escaped = "", False
    for char in value:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
        elif char == ",":
            commas += 1
    return commas + 1, deepest


def refuse_oversized(argv: Iterable[str]) -> None:
    """A UserError for the first override whose value holds more than MAX_ELEMENTS elements or
    nests deeper than MAX_DEPTH: read before Hydra parses anything."""
    from saturate.errors import UserError

    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or arg.startswith("-"):
            continue
        elements, deepest = _shape(value)
        if deepest > MAX_DEPTH:
            raise UserError(f"{key}: nested deeper than {MAX_DEPTH} levels ({deepest}); give such data in a file")
        if elements > MAX_ELEMENTS:
            raise UserError(
                f"{key}: a list or dict of more than {MAX_ELEMENTS:,} elements, or a sweep of more values ({elements:,}"
                " given); give such data in a file"
            )


def key_of(override: str) -> str:
    """The key (or group) an override sets: `+a.b=1` -> `a.b`."""
    return override.lstrip("+~").partition("=")[0]


def is_setting_key(key: str) -> bool:
    """Whether a config key sets what the run computes."""
    return not (key in NOT_SETTINGS or key.startswith(("hydra.", "tune.", "logger.")) or key == "hydra")


def is_setting(override: str) -> bool:
    """Whether an override sets what the run computes (not where it writes, how it is named
    or shown, that it resumes, which sweep preset or tune started it)."""
    return is_setting_key(key_of(override))


@dataclass(frozen=True)
class Invocation:
    """What a run knows of how it was started."""

    overrides: tuple[str, ...] = ()  # the run's overrides as given (Hydra's task overrides, or fit's)
    hydra: tuple[str, ...] = ()  # Hydra-level overrides (hydra.searchpath, ...), less PLACEMENT
    choices: dict[str, str | None] = field(default_factory=dict)  # config group -> the option chosen (or None)
    multirun: bool = False  # one job of a sweep (python train.py -m)
    varied: frozenset[str] = frozenset()  # keys a sweep varies; in a single run, those its overrides set
    output_dir: str | None = None  # Hydra's output dir for this job
    config_dirs: tuple[str, ...] = ()  # the file config dirs, the user's (hydra.searchpath) first, then saturate's
    app: str = "train.py"  # the script the user ran, or TRAIN_COMMAND
    sweep_dir: str | None = None  # a sweep's dir (hydra.sweep.dir), absolute

    @property
    def launcher(self) -> str | None:
        """The Hydra launcher that started this job of a sweep (`slurm`), None for the basic one
        (which runs the jobs in the process the user started) and outside a sweep."""
        chosen = self.choices.get("hydra/launcher")
        return chosen if self.multirun and chosen not in (None, "basic") else None

    @classmethod
    def given(cls, overrides: Iterable[str]) -> Invocation:
        """A run started from Python (saturate.fit) with `overrides`."""
        overrides = tuple(overrides)
        return cls(overrides=overrides, varied=frozenset(key_of(o) for o in overrides), app="")

    def settings(self) -> list[str]:
        """The overrides that set what the run computes (`is_setting`)."""
        return [o for o in self.overrides if is_setting(o)]

    def command_line(self) -> list[str]:
        """The whole command line as Hydra received it, less where this process ran: what
        every path that starts the run again (trainer.devices' ranks, the printed resume
        command, tune's trials) must carry (a user's config dir comes with hydra.searchpath)."""
        return [*self.hydra, *self.overrides]


def from_hydra() -> Invocation | None:
    """The running Hydra app's invocation, or None outside one."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import DictConfig, OmegaConf

    if not HydraConfig.initialized():
        return None
    hydra_cfg = cast(DictConfig, HydraConfig.get())  # Hydra's structured HydraConf is a DictConfig
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    # the overrides as typed: one holding `${...}` is text here, not an interpolation to resolve
    task = tuple(cast(list[str], OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)))
    given_hydra = cast(list[str], OmegaConf.to_container(hydra_cfg.overrides.hydra, resolve=False))
    script = os.environ.get(SCRIPT) or (sys.argv[0] if sys.argv else "")
    if script != TRAIN_COMMAND and (not script.endswith(".py") or "submitit" in script.split(os.sep)):  # submitit's
        script = f"{hydra_cfg.job.name}.py"
    cwd = OmegaConf.select(hydra_cfg, "runtime.cwd", default=None) or os.getcwd()
    return Invocation(
        overrides=task,
        hydra=tuple(o for o in given_hydra if not key_of(o).startswith(PLACEMENT)),
        choices=dict(hydra_cfg.runtime.choices),
        multirun=multirun,
        varied=frozenset(_swept(hydra_cfg) if multirun else (key_of(o) for o in task)),
        output_dir=OmegaConf.select(hydra_cfg, "runtime.output_dir", default=None, throw_on_missing=False),
        config_dirs=config_dirs(hydra_cfg.runtime.config_sources),
        app=script,
        sweep_dir=os.path.join(cwd, str(hydra_cfg.sweep.dir)) if multirun else None,
    )


def saved_record(task_cfg) -> dict[str, str]:
    """What Hydra saves of a run in `<run dir>/.hydra` (the config, Hydra's config, the
    overrides), as Hydra writes them, for saturate to save once the run dir is the run's own
    (saturate.checkpoint.rundir): saturate's conf/ sets hydra.output_subdir to null, so a run
    refused for another run's dir replaces nothing there. {} outside a Hydra app, and where
    Hydra saves them itself (a user's own app: its hydra.output_subdir is set)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    if not HydraConfig.initialized():
        return {}
    full = cast(DictConfig, HydraConfig.instance().cfg)  # {hydra: ...}, as Hydra saves it
    if full is None or full.hydra.output_subdir is not None:
        return {}
    return {
        "config.yaml": OmegaConf.to_yaml(task_cfg),
        "hydra.yaml": OmegaConf.to_yaml(full),
        "overrides.yaml": OmegaConf.to_yaml(full.hydra.overrides.task),
    }


def config_dirs(sources) -> tuple[str, ...]:
    """The file config dirs among Hydra's config sources: the user's (hydra.searchpath) first,
    then the primary one (saturate's conf/)."""
    files = [s for s in sources if s["schema"] == "file"]
    user = [s["path"] for s in files if s["provider"] not in ("main", "hydra", "schema")]
    return (*user, *(s["path"] for s in files if s["provider"] in ("main", "schema")))


def _swept(hydra_cfg) -> set[str]:
    """The keys a multirun sweeps: comma lists on its command line, and a sweeper's params (a
    `sweep=` preset's)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    swept = set(OmegaConf.select(hydra_cfg, "sweeper.params", default=None) or {})
    try:  # the multirun's own command line (the basic launcher runs its jobs in this process)
        given = [a for a in sys.argv[1:] if not a.startswith("-") and "=" in a]
        parsed = OverridesParser.create().parse_overrides(given)
        swept |= {o.key_or_group for o in parsed if o.is_sweep_override()}
    except Exception:  # noqa: BLE001 (another launcher's argv: the sweeper's params are what is known)
        pass
    return swept


@contextlib.contextmanager
def outside_hydra_app() -> Iterator[None]:
    """For the block, no Hydra app is running: `saturate.fit` called from inside a user's
    `@hydra.main` function composes saturate's own config and names, logs and records its run
    as its own (not with the outer app's overrides); the outer app's Hydra is put back after."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    outer_hydra = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    outer_cfg = HydraConfig.instance().cfg
    GlobalHydra.instance().clear()
    HydraConfig.instance().cfg = None
    try:
        yield
    finally:
        GlobalHydra.instance().clear()
        if outer_hydra is not None:
            GlobalHydra.instance().initialize(outer_hydra)
        HydraConfig.instance().cfg = outer_cfg
