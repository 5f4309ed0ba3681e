"""Models, built by Hydra from `_target_` nodes with the data's channels and classes:
`instantiate(cfg.model, in_channels=C, num_classes=K)` gives a plain nn.Module."""

from saturate.models.airbench import AirBench
from saturate.models.resnet import ResNet18
from saturate.models.small_cnn import SmallCNN

__all__ = ["AirBench", "ResNet18", "SmallCNN"]
