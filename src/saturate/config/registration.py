"""What Hydra must know before it composes saturate's config: the schema (`base_config`,
heading conf/config.yaml's defaults list) and the resolvers the run directory's name uses.

Registered by an explicit call, never as a side effect of an import: train.py (through
saturate.cli), `saturate.fit` and anything else that composes conf/ call `register()`
first. Calling it again does nothing.
"""

from __future__ import annotations

import os
from datetime import datetime

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from saturate.config.naming import run_name
from saturate.config.schema import RunConfig
from saturate.scale.ranks import rank_zero, world_size


def _run_stamp() -> str:
    """The run directory's name below outputs/runs: date/time to the microsecond, so two runs
    started in the same second still get directories of their own. Under torchrun, rank 0's
    (every rank resolves it before the run starts): one directory per run."""
    stamp = lambda: datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")
    if world_size() == 1:
        return stamp()
    from saturate.scale.distributed import shared_value  # torch's process group: only under torchrun

    return shared_value(stamp)


def _rank_suffix() -> str:
    """ "" on rank 0, ".rank<r>" on the others (their log files in the shared run dir)."""
    return "" if rank_zero() else f".rank{os.environ.get('RANK')}"


UNSET_RUN_DIR = "<unset: the run dir, made when train.py starts>"


def _output_dir() -> str:
    """Hydra's output dir for this run; a placeholder where there is none (`--cfg job
    --resolve` prints the config without running; the compose API has no run)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        found = OmegaConf.select(HydraConfig.get(), "runtime.output_dir", default=None, throw_on_missing=False)
        if found:
            return found
    return UNSET_RUN_DIR


_DATA_INFO: dict = {}  # what the data of the run being built gives (set_data_info)
DATA_INFO_KEYS = ("in_channels", "in_features", "input_shape", "num_classes", "num_outputs", "class_names")


def set_data_info(info: dict) -> None:
    """What `${data_info:...}` resolves to from now on (the run sets it once the data is
    described, and resolves its model and task nodes again)."""
    _DATA_INFO.clear()
    _DATA_INFO.update(info)


def data_info(key: str):
    """`${data_info:in_features}` in a model or task node: a value the data gives (in_channels,
    in_features, input_shape, input_shape.0, num_classes, num_outputs, class_names), so that
    a constructor with its own argument names needs no hard-coded shapes. Before the data is
    described (while the config is checked) it is a placeholder."""
    from saturate.config.schema import DATA_INFO

    if not _DATA_INFO:
        root, _, index = str(key).partition(".")
        if root not in DATA_INFO_KEYS or (index and (root != "input_shape" or not index.lstrip("-").isdigit())):
            raise ValueError(f"data_info:{key}: the data gives {', '.join(DATA_INFO_KEYS)} (input_shape.<i> for one dimension)")
        return f"{DATA_INFO}{key}>"
    value = _DATA_INFO
    for part in str(key).split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, (list, tuple)):
            raise ValueError(f"data_info:{key}: the data's input_shape is {tuple(value)}: index it with 0 to {len(value) - 1}")
        else:
            raise ValueError(f"data_info:{key}: the data gives {', '.join(DATA_INFO_KEYS)} (input_shape.<i> for one dimension)")
    return list(value) if isinstance(value, tuple) else value


def register() -> None:
    """Store the schema in Hydra's ConfigStore and register saturate's resolvers."""
    ConfigStore.instance().store(name="base_config", node=RunConfig)
    OmegaConf.register_new_resolver("saturate_stamp", _run_stamp, use_cache=True, replace=True)
    OmegaConf.register_new_resolver(
        "saturate_name", lambda *, _root_: run_name(OmegaConf.select(_root_, "name", default=None, throw_on_missing=False)), replace=True
    )
    OmegaConf.register_new_resolver("saturate_output_dir", _output_dir, replace=True)
    OmegaConf.register_new_resolver("saturate_rank_suffix", _rank_suffix, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("saturate_hydra_subdir", lambda: ".hydra" if rank_zero() else None, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("data_info", data_info, replace=True)
