"""saturate: a Hydra-configured PyTorch training framework that keeps the accelerator busy
and says, with measurements, why it is not."""

from saturate.run import train

__all__ = ["train"]
__version__ = "0.1.0"
