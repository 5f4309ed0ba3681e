"""saturate: a Hydra-configured PyTorch training framework that keeps the accelerator busy
and says, with measurements, why it is not.

- `saturate.train(cfg)`: run a composed config (what train.py does);
- `saturate.fit(model, train_data, val_data, ...)`: the same run from Python objects;
- `saturate.register()`: tell Hydra saturate's schema and resolvers, before composing conf/;
- `saturate.callbacks`: the hooks and loggers a run calls.
"""

from saturate.registration import register
from saturate.run import Metrics, fit, train

__all__ = ["Metrics", "fit", "register", "train"]
__version__ = "0.1.0"
