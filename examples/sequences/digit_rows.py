"""Sequence classification: each handwritten digit (scikit-learn's bundled 8x8 digits) read
as a sequence of 8 rows of 8 pixels, classified by a GRU, as a behaviour or sign-language
model reads a sequence of frames. The dataset gives numpy arrays; nothing is saturate's."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


class Sequences(Dataset):
    """Samples (sequence (T, F) float32 numpy array, class index)."""

    def __init__(self, sequences: np.ndarray, labels: np.ndarray):
        self.sequences, self.labels = sequences, labels
        self.classes = sorted(set(labels.tolist()))  # saves saturate a scan of the targets

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.sequences[i], int(self.labels[i])


def load_digit_rows(val_fraction: float = 0.2, seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    rows = (x / 16.0).reshape(-1, 8, 8).astype(np.float32)  # (N, T=8 rows, F=8 pixels), values 0..1
    a, b = train_test_split(np.arange(len(y)), test_size=val_fraction, stratify=y, random_state=seed)
    return Sequences(rows[a], y[a]), Sequences(rows[b], y[b])


class SequenceGRU(nn.Module):
    """A GRU over the sequence; the last hidden state -> class logits."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64, layers: int = 1):
        super().__init__()
        self.gru = nn.GRU(in_features, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, F) -> (B, num_classes)
        _, h = self.gru(x)
        return self.head(h[-1])
