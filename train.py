"""python train.py [group=option ...] [key=value ...]   (-m for a multirun sweep)"""

import hydra
from omegaconf import DictConfig

from saturate.cli import run, task


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    return task(cfg)


if __name__ == "__main__":
    run(main)
