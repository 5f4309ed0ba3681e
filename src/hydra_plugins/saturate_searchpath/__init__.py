"""A project's own config dir first on Hydra's search path (saturate.config.dirs).

Hydra takes search path plugins from the `hydra_plugins` package only, and asks every one
of them in every Hydra app of this environment: this one does nothing unless a saturate
command found a project config dir (SATURATE_CONFIG_DIR)."""

import os

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class ProjectConfigDir(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        folder = os.environ.get("SATURATE_CONFIG_DIR")
        if folder:  # first: its config.yaml is the primary config, its options shadow saturate's of the same name
            search_path.prepend(provider="saturate project", path=f"file://{folder}")
