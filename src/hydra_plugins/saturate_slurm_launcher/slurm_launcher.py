"""hydra/launcher=slurm (conf/hydra/launcher/slurm.yaml): hydra-submitit-launcher's SLURM
launcher with saturate's checks and messages around its launch (saturate.scale.slurm).

Hydra takes launchers from the hydra_plugins package only, and imports each of its modules
when it starts: this one stays small, and offers nothing where saturate's slurm extra
(hydra-submitit-launcher) is not installed."""

from __future__ import annotations

import functools
from importlib.util import find_spec

if find_spec("hydra_plugins.hydra_submitit_launcher") is not None:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher

    class SlurmLauncher(submitit_launcher.SlurmLauncher):
        """Each job of a sweep (or the one job of `python train.py -m`) a SLURM job."""

        def launch(self, job_overrides, initial_job_idx):
            from saturate.scale.slurm import launch

            return launch(self, functools.partial(super().launch, job_overrides, initial_job_idx))
