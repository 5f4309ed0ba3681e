"""train.py's config composed once, not twice.

Before a single run, Hydra composes the whole config to read `hydra.mode` and throws it away
(`Hydra.get_mode`), then `Hydra.run` composes it again with `hydra.mode=RUN` added when the
config left the mode unset (hydra-ecosystem/hydra#3440, open): 0.075 s of train.py's
start-up on a 2-core CPU, a third of Hydra's share (docs/benchmarks.md).

`composed_once()`, around a single run's `@hydra.main` call (saturate.cli.run): `get_mode`
composes the config as `Hydra.run` will (RunMode.RUN, the same overrides) and reads the mode
from it. When the mode is unset, `Hydra.run`'s composition, the same overrides and
`hydra.mode=RUN`, is that config with what the override would have done: the mode set and
the override recorded last among Hydra's own (`ConfigLoaderImpl._load_configuration_impl`
applies the overrides and records them after merging the files, and nothing it computes
reads either). Everything else goes Hydra's own way, composed again: a config that sets
`hydra.mode` itself (lightning-hydra-template's `hparams_search` sets MULTIRUN), an error
while composing or reading the mode (the first composition is Hydra's get_mode again, the
run's raises the error as before: three compositions before a mistake's message instead of
two), another composition between the two. Only for Hydra 1.3, whose `get_mode` and
`load_configuration` it knows; with another it does nothing.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import hydra
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.hydra import Hydra
from hydra.types import RunMode
from omegaconf import open_dict

RUN_OVERRIDE = "hydra.mode=RUN"  # what hydra._internal.utils._run_app adds when get_mode says the mode is unset
_GET_MODE = ("self", "config_name", "overrides")
_LOAD = ("self", "config_name", "overrides", "run_mode", "from_shell", "validate_sweep_overrides")


def applies() -> bool:
    """Whether this Hydra is one whose two compositions `composed_once` knows."""
    return (
        hydra.__version__.startswith("1.3.")
        and tuple(inspect.signature(Hydra.get_mode).parameters) == _GET_MODE
        and tuple(inspect.signature(ConfigLoaderImpl.load_configuration).parameters) == _LOAD
    )


@contextlib.contextmanager
def composed_once() -> Iterator[None]:
    """Within the block, a single run's config is composed once (see the module's docstring)."""
    if not applies():
        yield
        return
    get_mode, load = Hydra.get_mode, ConfigLoaderImpl.load_configuration
    kept: dict = {}  # the composition get_mode made: (loader, config name, the run's overrides) -> its config

    def get_mode_once(self, config_name, overrides):
        kept.clear()
        try:  # reading the mode can fail too (`hydra.mode=???`, an interpolation): Hydra's get_mode says None
            cfg = load(self.config_loader, config_name, list(overrides), RunMode.RUN)
            mode = cfg.hydra.mode
        except Exception:  # noqa: BLE001 (Hydra's own way: get_mode swallows it, the run's composition raises it)
            return get_mode(self, config_name, overrides)
        if mode is not None:
            return mode
        kept["key"], kept["cfg"] = (self.config_loader, config_name, [*overrides, RUN_OVERRIDE]), cfg
        return None

    def load_once(self, config_name, overrides, run_mode, from_shell=True, validate_sweep_overrides=True):
        key, cfg = kept.pop("key", None), kept.pop("cfg", None)  # the next composition takes it, or nobody does
        if key == (self, config_name, list(overrides)) and run_mode == RunMode.RUN and from_shell:
            return _with_run_mode(cfg)
        return load(self, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)

    Hydra.get_mode, ConfigLoaderImpl.load_configuration = get_mode_once, load_once
    try:
        yield
    finally:
        Hydra.get_mode, ConfigLoaderImpl.load_configuration = get_mode, load


def _with_run_mode(cfg):
    """What `hydra.mode=RUN`, the last override, does to a composed config."""
    with open_dict(cfg.hydra):
        cfg.hydra.mode = RunMode.RUN
        cfg.hydra.overrides.hydra.append(RUN_OVERRIDE)
    return cfg
