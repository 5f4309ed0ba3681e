"""Callbacks and loggers: how a user's code sees a run, and may steer it through narrow requests.

The protocol (every hook optional) and the `Run` a hook sees: saturate.callbacks.base. One
dispatcher calls them all: saturate.callbacks.dispatch. The built-in callbacks are the
`callbacks` config group's options, each a small file written against the same protocol a
user's own would use (copy one to start yours):

- `early_stopping`: stop when the monitored metric stops improving (EarlyStopping);
- `ema`: evaluate and checkpoint an exponential moving average of the weights (EMA);
- `plateau`: lower the learning rate when the monitored metric stops improving (Plateau);
- `profiler` (trainer.profile=true adds it): a torch.profiler trace of a few steps (Profiler).

    python train.py callbacks=[early_stopping,ema] callbacks.early_stopping.patience=5
"""

from saturate.callbacks.base import HOOKS, Callback, Plan, Run
from saturate.callbacks.dispatch import CallbackError, Observers
from saturate.callbacks.early_stopping import EarlyStopping
from saturate.callbacks.ema import EMA
from saturate.callbacks.plateau import Plateau

__all__ = ["EMA", "HOOKS", "Callback", "CallbackError", "EarlyStopping", "Observers", "Plan", "Plateau", "Run"]
