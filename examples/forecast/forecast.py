"""A day-ahead PM2.5 forecaster from hourly sensor readings whose model takes two inputs, as
long-horizon forecasters are trained (`thuml/Autoformer`'s exp_main.py: the model called
with the past window and calendar features, `adjust_learning_rate` halving the LR every
epoch after the second). What it does, and where it lives here:

- the past 48 hours of 5 standardised readings (dew point, temperature, pressure, wind,
  PM2.5) and the calendar features of the 24 hours to forecast (hour of day, day of week and
  day of year as sine and cosine)       -> `load_forecast`: samples ((past, calendar), next_24)
- a model called as model(past, calendar) -> `TwoInputForecaster(past, calendar)`: the
                                           window encoded by a GRU, joined to each future
                                           hour's calendar features, one value per hour
- MSE, Adam at 1e-3, `--lradj type1`, no warm-up -> task=regression, optim=adam,
                                           optim.scheduler: LambdaLR(`type1`) per epoch,
                                           optim.warmup_epochs: 0

The series is drawn, not downloaded: seasonal, daily and weekly cycles, AR(1) weather, rain
that washes PM2.5 out and wind that disperses it (the UCI Beijing PM2.5 data's columns).
Nothing here is saturate's.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

PAST, AHEAD = 48, 24


def make_series(hours: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(readings (hours, 5) float32, calendar (hours, 6) float32): dew point, temperature,
    pressure, wind, PM2.5; and hour, weekday, day of year as sine and cosine."""
    rng = np.random.default_rng(seed)
    t = np.arange(hours)
    hour, weekday, yearday = t % 24, (t // 24) % 7, (t // 24) % 365
    season = np.cos(2 * np.pi * yearday / 365)
    weather = np.zeros(hours)
    for i in range(1, hours):
        weather[i] = 0.97 * weather[i - 1] + rng.normal(0, 0.25)
    temperature = 12 - 12 * season + 5 * np.sin(2 * np.pi * (hour - 9) / 24) + 3 * weather
    dew = temperature - 8 + 4 * weather + rng.normal(0, 1, hours)
    pressure = 1013 + 8 * season - 5 * weather + rng.normal(0, 1, hours)
    wind = np.abs(3 - 1.5 * weather + rng.normal(0, 1, hours))
    load = np.zeros(hours)
    traffic = 1 + 0.4 * np.exp(-((hour - 8) ** 2) / 8) + 0.4 * np.exp(-((hour - 18) ** 2) / 8) - 0.2 * (weekday >= 5)
    for i in range(1, hours):
        load[i] = 0.95 * load[i - 1] + 0.05 * (traffic[i] + 0.5 * season[i] - 0.2 * wind[i] + rng.normal(0, 0.3))
    pm25 = np.exp(3.5 + 2.5 * load)
    readings = np.stack([dew, temperature, pressure, wind, pm25], axis=1)
    angles = [2 * np.pi * hour / 24, 2 * np.pi * weekday / 7, 2 * np.pi * yearday / 365]
    calendar = np.stack([f(a) for a in angles for f in (np.sin, np.cos)], axis=1)
    return readings.astype(np.float32), calendar.astype(np.float32)


class Windows(Dataset):
    """((the past 48 hours' readings (48, 5), the next 24 hours' calendar (24, 6)), the next
    24 hours' standardised PM2.5 (24,))."""

    def __init__(self, readings: torch.Tensor, calendar: torch.Tensor, starts: range):
        self.readings, self.calendar, self.starts = readings, calendar, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        s = self.starts[i]
        past, future = self.readings[s : s + PAST], slice(s + PAST, s + PAST + AHEAD)
        return (past, self.calendar[future]), self.readings[future, -1]


def load_forecast(days: int = 120, seed: int = 0, val_fraction: float = 0.2) -> dict:
    """Standardised readings (on the training hours only), split in time order."""
    readings, calendar = make_series(days * 24, seed)
    cut = int(len(readings) * (1 - val_fraction))
    mean, std = readings[:cut].mean(0), readings[:cut].std(0)
    x, c = torch.from_numpy((readings - mean) / std), torch.from_numpy(calendar)
    span = PAST + AHEAD
    return {
        "train": Windows(x, c, range(0, cut - span + 1)),
        "val": Windows(x, c, range(cut - PAST, len(x) - span + 1)),
    }


def type1(epoch: int) -> float:
    """The author's `--lradj type1` as its loop runs it, a LambdaLR factor for epoch `epoch`
    (0-based). After epoch e, `adjust_learning_rate(optimizer, e + 1)` sets lr * 0.5 ** e: the
    first two epochs train at the full LR, each later one at half the one before (1e-3, 1e-3,
    5e-4, 2.5e-4, ...: the LR its log prints). A StepLR(1, 0.5) halves one epoch sooner."""
    return 0.5 ** max(0, epoch - 1)


class TwoInputForecaster(nn.Module):
    """The past window through a GRU; its last state joined to each future hour's calendar
    features; one value per future hour."""

    def __init__(self, readings: int = 5, calendar: int = 6, hidden: int = 32):
        super().__init__()
        self.encoder = nn.GRU(readings, hidden, batch_first=True)
        self.head = nn.Sequential(nn.Linear(hidden + calendar, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.scale = math.sqrt(hidden)

    def forward(self, past: torch.Tensor, calendar: torch.Tensor) -> torch.Tensor:
        _, state = self.encoder(past)  # (1, B, hidden)
        joined = torch.cat([state[-1][:, None].expand(-1, calendar.shape[1], -1), calendar], dim=-1)
        return self.head(joined).squeeze(-1)  # (B, 24)
