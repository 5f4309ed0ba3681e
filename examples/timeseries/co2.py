"""Windowed time-series regression in the style of the PM2.5 CNN: a window of weeks x
features in, the next week's value out. The series is the weekly CO2 concentration at Mauna
Loa (1958-2001) that ships with statsmodels (`pip install -e ".[examples]"`): nothing is
downloaded. Nothing here is saturate's: a dataset, a model and two functions."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


class Windows(Dataset):
    """Samples (window (T, F) float32, next value float32): F = the standardised series and
    the week of the year as sin/cos."""

    def __init__(self, features: np.ndarray, target: np.ndarray, window: int, horizon: int):
        self.features, self.target, self.window, self.horizon = features, target, window, horizon

    def __len__(self) -> int:
        return len(self.target) - self.window - self.horizon + 1

    def __getitem__(self, i: int):
        return self.features[i : i + self.window], self.target[i + self.window + self.horizon - 1]


def load_co2(window: int = 52, horizon: int = 1, val_fraction: float = 0.2):
    """(train, val): the first 80 % of the weeks for training, the last 20 % for validation
    (chronological: no future in training), standardised with the training part's figures."""
    import statsmodels.api as sm

    frame = sm.datasets.co2.load_pandas().data.interpolate()  # 59 missing weeks, filled linearly
    values = frame["co2"].to_numpy(np.float64)
    week = frame.index.isocalendar().week.to_numpy(np.float64)
    split = int(len(values) * (1 - val_fraction))
    mean, std = values[:split].mean(), values[:split].std()
    level = (values - mean) / std
    features = np.stack([level, np.sin(2 * np.pi * week / 52.18), np.cos(2 * np.pi * week / 52.18)], axis=1).astype(
        np.float32
    )
    target = level.astype(np.float32)
    train = Windows(features[:split], target[:split], window, horizon)
    val = Windows(features[split - window - horizon + 1 :], target[split - window - horizon + 1 :], window, horizon)
    return train, val


class WindowCNN(nn.Module):
    """1-D convolutions over time on a (T, F) window, then a linear head."""

    def __init__(self, in_features: int, num_outputs: int, width: int = 32):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(in_features, width, 5, padding=2),
            nn.GELU(),
            nn.Conv1d(width, width, 5, padding=2, stride=2),
            nn.GELU(),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(width, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, F) -> (B, num_outputs)
        return self.head(self.body(x.transpose(1, 2)))
