"""python train.py [group=option ...] [key=value ...]   (-m for a multirun sweep)

The checkout's way to `saturate train`: the same command, the same config."""

import os

from saturate.cli import train_command

if __name__ == "__main__":
    train_command(os.path.abspath(__file__))
