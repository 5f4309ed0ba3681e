"""PM2.5 regression over sliding windows of daily sensor readings, ported from a public
"Beijing PM2.5 Concentration Prediction - 2D CNN Model" training script (`PM25CNN2D`: the
window of days x features read as a one-channel image): Bostoncool/something,
Short-essay-Beijing/DeepLearning/CNN/CNN-CPU.py at bf56a83 (MIT; `reference.py` beside this
file is that script with the example's data). What it did, and where it lives here:

- features standardised, 30-day windows, the PM2.5 of the window's last day as the target,
  split in time order 70/15/15 (train/val/test)          -> `load_pm25` (returns test too)
- PM25CNN2D(window_size, num_features, ...)              -> `PM25CNN2D`, unchanged but for
  `squeeze(-1)` (theirs, `squeeze()`, made a last batch of one a 0-d tensor)
- MSE, Adam lr 1e-3, early stopping with patience 20     -> experiment=pm25 (task regression,
  optim adam, not fused, callbacks=[early_stopping])
- DataLoader(shuffle=True), torch.manual_seed(seed)      -> loader.order=global: with
  trainer.seed=N the run learns what `reference.py --seed N` learns, bit for bit
- R², RMSE, MAE and MAPE of the test set in µg/m³, after
  `scaler_y.inverse_transform`                           -> the task's metrics with the data's
  `target_inverse`: test/rmse_raw, test/mape_raw, ...

Two changes on purpose: the scalers are fitted on the training days only (theirs saw the
test days), and nothing is read from disk: the real script merged six pollutants averaged
over Beijing's stations with 18 ERA5 reanalysis variables over the city and features made
from them (wind, calendar, lags), 2015-2024; `make_days` draws five years of days of the
same kind (weather that drives a positive, skewed PM2.5 series) so the example runs
anywhere. Nothing here is saturate's.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

FEATURES = (
    "temperature",
    "dew_point",
    "humidity",
    "pressure",
    "wind_speed",
    "wind_u",
    "wind_v",
    "precipitation",
    "boundary_layer_height",
    "solar_radiation",
    "day_sin",
    "day_cos",
)


def make_days(days: int = 1826, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(features (days, 12) float64, PM2.5 (days,) µg/m³): a seasonal climate with weather
    noise; PM2.5 builds up over calm, humid, shallow-boundary-layer days and is washed out by
    wind and rain (log-normal, 10-400 µg/m³, higher in winter)."""
    rng = np.random.default_rng(seed)
    t = np.arange(days)
    season = np.cos(2 * np.pi * t / 365.25)  # +1 in winter
    weather = np.zeros(days)
    for i in range(1, days):  # a few days of memory
        weather[i] = 0.7 * weather[i - 1] + rng.normal(0, 0.7)
    temperature = 12 - 14 * season + 3 * weather + rng.normal(0, 1.5, days)
    humidity = np.clip(55 + 10 * weather + rng.normal(0, 8, days), 10, 100)
    dew_point = temperature - (100 - humidity) / 5
    pressure = 1013 + 8 * season - 4 * weather + rng.normal(0, 2, days)
    wind_speed = np.abs(3 - 1.5 * weather + rng.normal(0, 1.2, days))
    direction = rng.uniform(0, 2 * np.pi, days)
    precipitation = np.where(rng.random(days) < 0.15 + 0.1 * (weather > 0), rng.exponential(5, days), 0.0)
    blh = np.clip(900 - 400 * season - 200 * weather + rng.normal(0, 150, days), 100, None)
    solar = np.clip(200 - 120 * season - 40 * weather + rng.normal(0, 30, days), 10, None)
    drive = (
        0.35 * season
        + 0.25 * (humidity - 55) / 10
        - 0.3 * (wind_speed - 3)
        - 0.4 * (blh - 900) / 400
        - 0.05 * precipitation
    )
    load = np.zeros(days)
    for i in range(1, days):  # pollution accumulates over stagnant days
        load[i] = 0.6 * load[i - 1] + drive[i] + rng.normal(0, 0.25)
    pm25 = np.clip(np.exp(3.8 + 0.55 * load), 3, 500)
    features = np.stack(
        [
            temperature,
            dew_point,
            humidity,
            pressure,
            wind_speed,
            wind_speed * np.cos(direction),
            wind_speed * np.sin(direction),
            precipitation,
            blh,
            solar,
            np.sin(2 * np.pi * t / 365.25),
            np.cos(2 * np.pi * t / 365.25),
        ],
        axis=1,
    )
    return features, pm25


class Standardise:
    """scikit-learn's StandardScaler, fitted on the training days; `inverse` takes model
    outputs and targets back to µg/m³ (saturate's `target_inverse`)."""

    def __init__(self, values: np.ndarray):
        self.mean, self.std = values.mean(axis=0), values.std(axis=0) + 1e-12

    def __call__(self, values: np.ndarray) -> np.ndarray:
        return (values - self.mean) / self.std

    def inverse(self, values: torch.Tensor) -> torch.Tensor:
        return values * float(self.std) + float(self.mean)


class Windows(Dataset):
    """Samples (window (window_size, num_features) float32, PM2.5 of its last day float32)."""

    def __init__(self, features: np.ndarray, target: np.ndarray, window_size: int):
        self.features, self.target, self.window_size = (
            torch.from_numpy(features).float(),
            torch.from_numpy(target).float(),
            window_size,
        )

    def __len__(self) -> int:
        return len(self.target) - self.window_size + 1

    def __getitem__(self, i: int):
        return self.features[i : i + self.window_size], self.target[i + self.window_size - 1]


def load_pm25(
    window_size: int = 30, days: int = 1826, train_fraction: float = 0.70, val_fraction: float = 0.15, seed: int = 0
) -> dict:
    """{train, val, test, target_inverse}: the days split in time order (no future in
    training; each later split starts with the window_size-1 days before it as context)."""
    features, pm25 = make_days(days, seed)
    n_train, n_val = int(days * train_fraction), int(days * val_fraction)
    scale_x, scale_y = Standardise(features[:n_train]), Standardise(pm25[:n_train])
    x, y = scale_x(features), scale_y(pm25)
    context = window_size - 1
    cuts = [(0, n_train), (n_train - context, n_train + n_val), (n_train + n_val - context, days)]
    train, val, test = (Windows(x[a:b], y[a:b], window_size) for a, b in cuts)
    return {"train": train, "val": val, "test": test, "target_inverse": scale_y.inverse}


class PM25CNN2D(nn.Module):
    """The window (window_size, num_features) as a one-channel image: blocks of Conv2d,
    BatchNorm, ReLU and 2x2 max-pooling (filters doubling), then 256 -> 64 -> 1."""

    def __init__(
        self,
        window_size: int,
        num_features: int,
        num_conv_layers: int = 3,
        base_filters: int = 32,
        kernel_size: int = 3,
        dropout_rate: float = 0.3,
    ):
        super().__init__()
        layers, channels = [], 1
        for i in range(num_conv_layers):
            out = base_filters * 2**i
            layers += [
                nn.Conv2d(channels, out, kernel_size, padding=kernel_size // 2),
                nn.BatchNorm2d(out),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2, 2),
            ]
            channels = out
        self.conv_layers = nn.Sequential(*layers)
        with torch.no_grad():
            size = self.conv_layers(torch.zeros(1, 1, window_size, num_features)).numel()
        self.fc_layers = nn.Sequential(
            nn.Linear(size, 256),
            nn.BatchNorm1d(256),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout_rate),
            nn.Linear(256, 64),
            nn.BatchNorm1d(64),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout_rate * 0.7),
            nn.Linear(64, 1),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, window_size, num_features) -> (B,)
        x = self.conv_layers(x.unsqueeze(1))
        return self.fc_layers(x.flatten(1)).squeeze(-1)
