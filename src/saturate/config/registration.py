"""What Hydra must know before it composes saturate's config: the schema (`base_config`,
heading conf/config.yaml's defaults list) and the resolvers the run directory's name and `${data_info:...}` use.

Registered by an explicit call, never as a side effect of an import: train.py (through
saturate.cli), `saturate.fit` and anything else that composes conf/ call `register()`
first. Calling it again does nothing.
"""

from __future__ import annotations

import os
from datetime import datetime

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from saturate.config.data_info import placeholder
from saturate.config.invocation import from_hydra
from saturate.config.naming import run_name
from saturate.config.schema import RunConfig
from saturate.config.secrets import record_env_reads
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
    invocation = from_hydra()
    return (invocation.output_dir if invocation else None) or UNSET_RUN_DIR


def _run_name(*, _root_) -> str:
    """`_<name>` ending the run directory's name (saturate.config.naming.run_name)."""
    return run_name(OmegaConf.select(_root_, "name", default=None, throw_on_missing=False), from_hydra())


def register() -> None:
    """Store the schema in Hydra's ConfigStore and register saturate's resolvers (and the
    `oc.env` that remembers what it reads: saturate.config.secrets)."""
    ConfigStore.instance().store(name="base_config", node=RunConfig)
    OmegaConf.register_new_resolver("saturate_stamp", _run_stamp, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("saturate_name", _run_name, replace=True)
    OmegaConf.register_new_resolver("saturate_output_dir", _output_dir, replace=True)
    OmegaConf.register_new_resolver("saturate_rank_suffix", _rank_suffix, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("data_info", placeholder, replace=True)
    record_env_reads()  # what ${oc.env:...} reads is written as the interpolation in every record
