"""The built-in loggers, chosen from the `logger` config group, a list as in
lightning-hydra-template (`logger=[tensorboard,csv]`, `logger=[tensorboard,mlflow]`,
`logger=[tensorboard,wandb]`; docs/loggers.md).

A logger is an observer like any callback (saturate.callbacks.base.Callback) that records
what the run logs: `on_log` (metrics), and where it can `on_text`, `on_images`, `on_layout`,
`on_hparams`; it opens its files at `on_run_start` and closes them at `on_run_end`. Loggers
run on rank 0 only. Each built-in one is a small file a user can copy to write their own.
"""

from saturate.loggers.csv import CSVLogger
from saturate.loggers.mlflow import MLflowLogger
from saturate.loggers.tensorboard import TensorBoardLogger
from saturate.loggers.wandb import WandbLogger

__all__ = ["CSVLogger", "MLflowLogger", "TensorBoardLogger", "WandbLogger"]
