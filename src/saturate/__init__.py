"""saturate: a Hydra-configured PyTorch training framework that keeps the accelerator busy
and says, with measurements, why it is not.

- `saturate.train(cfg)`: run a composed config (what train.py does);
- `saturate.fit(model, train_data, val_data, ...)`: the same run from Python objects;
- `saturate.register()`: tell Hydra saturate's schema and resolvers, before composing conf/;
- `saturate.callbacks`: the hooks and loggers a run calls.
"""

import saturate.started  # noqa: F401  (first: the start-up clock's fallback origin)
from saturate.config.registration import register

__all__ = ["Metrics", "fit", "register", "train"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`train`, `fit` and `Metrics` are imported when first asked for: `import saturate` (and
    train.py's --help, and a config's mistakes) stay free of torch's start-up time."""
    if name in ("Metrics", "train"):
        from saturate.trainer import run

        return getattr(run, name)
    if name == "fit":
        from saturate.api import fit

        return fit
    raise AttributeError(f"module 'saturate' has no attribute {name!r}")
