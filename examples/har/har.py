"""Human activity recognition from body-worn sensor windows, ported from the public
`mexeniz/har-lstm-mlflow` (models.py: `HarLSTM`, a Lightning module trained on UCI HAR).
What it did, and where it lives here:

- UCI HAR's "Inertial Signals": windows of 128 readings (2.56 s at 50 Hz) of 9 channels
  (body acceleration, gyroscope, total acceleration; x, y, z), 6 activities, split by
  subject                                               -> `load_har` (train, val, test)
- HarLSTM(input_size, output_size, n_hidden=256, n_layers=2, drop_prob=0.5): an LSTM, the
  last time step -> Linear                              -> `HarLSTM`, its arguments by name
  from the data (`${data_info:in_features}`, `${data_info:num_classes}`)
- CrossEntropyLoss, Adam lr 1e-3, gradients clipped at 10  -> experiment=har
- accuracy and micro precision/recall on the test set   -> per-class F1 (average: null),
  logged per activity, and a confusion matrix in TensorBoard, for val and test

Two fixes on purpose: their forward ended in a softmax before CrossEntropyLoss (which
applies log-softmax itself: the loss saw probabilities twice squashed), and computed a
dropout of the LSTM output that it then threw away; here the logits go to the loss and the
dropout is applied to the last step. The data is drawn, not downloaded: `make_windows`
gives each activity its own mix of gait frequency, amplitude and gravity direction, with
per-subject differences, in UCI HAR's shapes. Nothing here is saturate's.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

ACTIVITIES = ("walking", "walking_upstairs", "walking_downstairs", "sitting", "standing", "laying")
# per activity: gait frequency (Hz, 0: none), gait amplitude (g), gravity direction in the phone's frame
GAIT = {
    "walking": (1.9, 0.30),
    "walking_upstairs": (1.6, 0.25),
    "walking_downstairs": (2.1, 0.40),
    "sitting": (0.0, 0.0),
    "standing": (0.0, 0.0),
    "laying": (0.0, 0.0),
}
GRAVITY = {
    "walking": (1.0, -0.1, 0.1),
    "walking_upstairs": (0.95, -0.2, 0.15),
    "walking_downstairs": (1.0, -0.05, 0.05),
    "sitting": (0.75, 0.0, 0.6),
    "standing": (1.0, -0.15, 0.0),
    "laying": (0.0, 0.4, 0.9),
}


def make_windows(subjects: list[int], per_subject: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(windows (N, 128, 9) float32, activity index (N,) int64) for these subjects."""
    rng = np.random.default_rng(seed)
    t = np.arange(128) / 50.0
    windows, labels = [], []
    for subject in subjects:
        s = np.random.default_rng(1000 + subject)  # the subject's own gait and carry angle
        tempo, tilt = s.uniform(0.85, 1.15), s.normal(0, 0.12, 3)
        for _ in range(per_subject):
            k = int(rng.integers(len(ACTIVITIES)))
            freq, amp = GAIT[ACTIVITIES[k]]
            phase = rng.uniform(0, 2 * np.pi)
            gait = (
                amp * np.sin(2 * np.pi * freq * tempo * t[:, None] + phase + np.array([0.0, 1.3, 2.1])) if freq else 0.0
            )
            body = gait + rng.normal(0, 0.02 + 0.03 * (freq > 0), (128, 3))
            gyro = (np.gradient(body, axis=0) * 8 if freq else 0.0) + rng.normal(0, 0.03, (128, 3))
            gravity = np.array(GRAVITY[ACTIVITIES[k]]) + tilt + rng.normal(0, 0.05, 3)
            windows.append(np.concatenate([body, gyro, body + gravity], axis=1))
            labels.append(k)
    return np.asarray(windows, np.float32), np.asarray(labels, np.int64)


class SensorWindows(Dataset):
    """Samples (window (128, 9) float32 tensor, activity index)."""

    classes = list(ACTIVITIES)  # class names: per-class metrics are logged under them

    def __init__(self, windows: np.ndarray, labels: np.ndarray):
        self.windows, self.labels = torch.from_numpy(windows), torch.from_numpy(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.windows[i], self.labels[i]


def load_har(per_subject: int = 80, seed: int = 0) -> dict:
    """{train, val, test}, split by subject as UCI HAR is (21 train, 4 val, 5 test here)."""
    split = {"train": list(range(1, 22)), "val": list(range(22, 26)), "test": list(range(26, 31))}
    return {
        name: SensorWindows(*make_windows(subjects, per_subject, seed + i))
        for i, (name, subjects) in enumerate(split.items())
    }


class HarLSTM(nn.Module):
    """An LSTM over the window; the last time step's output, dropped out, -> activity logits."""

    def __init__(
        self, input_size: int, output_size: int, n_hidden: int = 256, n_layers: int = 2, drop_prob: float = 0.5
    ):
        super().__init__()
        self.input_size, self.n_hidden = input_size, n_hidden
        self.lstm = nn.LSTM(input_size, n_hidden, n_layers, dropout=drop_prob, batch_first=True)
        self.dropout = nn.Dropout(drop_prob)
        self.fc = nn.Linear(n_hidden, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, input_size) -> (B, output_size) logits
        lstm_out, _ = self.lstm(x.reshape(x.size(0), -1, self.input_size))
        return self.fc(self.dropout(lstm_out[:, -1, :]))
