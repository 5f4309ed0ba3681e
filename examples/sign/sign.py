"""Continuous sign language from hand keypoints with CTC, ported from the public
`jmin-code/2025ESWContest_mobility_6051` (src/core/ctc_model.py: `GestureCTCNet`, a
bidirectional LSTM over MediaPipe hand landmarks, trained with CTC loss). What it did, and
where it lives here:

- a clip is a sequence of frames of hand landmarks (21 points x (x, y, z) per hand; two
  hands: 126 features), of any length; its label a sequence of signs, not aligned with the
  frames                                                -> `Clips` (dict samples), batched by
  saturate.data.pad_collate (padded, with input_length and target_length)
- GestureCTCNet(input_dim, hidden_dim, num_classes): 2-layer BiLSTM -> Linear to the signs
  plus the blank, returned time-first for nn.CTCLoss   -> `GestureCTCNet`, batch-first
  (saturate's sequence task puts the time axis where ctc_loss wants it), its Linear sized
  `num_classes` = the signs plus the blank (class 0), as the data says
- CTC loss, greedy decoding                             -> task=sequence (mode ctc): val/ter
  (token error rate), val/seq_acc (clips decoded exactly)

The clips are drawn, not recorded: each sign is a hand trajectory of its own (a few frames of
noisy keypoints moving along a sign-specific path), a clip is 1-4 signs with pauses between,
20-70 frames. Nothing here is saturate's but pad_collate, the collate it is given.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

SIGNS = ("hello", "thanks", "help", "yes", "no", "stop", "go", "left", "right", "water")
FEATURES = 2 * 21 * 3  # two hands, 21 landmarks, (x, y, z)
NOISE = 1.5  # keypoint jitter, against key poses of unit spread


class Clips(Dataset):
    """Samples {"input": (T, 126) float32, "target": (S,) int64 signs 1..10}: T and S vary."""

    num_classes = len(SIGNS) + 1  # the signs and CTC's blank (class 0)

    def __init__(self, count: int, seed: int):
        rng = np.random.default_rng(seed)
        # each sign's 4 key poses
        shapes = np.random.default_rng(7).normal(0, 1, (len(SIGNS), 4, FEATURES)).astype(np.float32)
        self.clips, self.labels = [], []
        for _ in range(count):
            signs = rng.integers(1, len(SIGNS) + 1, int(rng.integers(1, 5)))
            frames = [rng.normal(0, NOISE, (int(rng.integers(2, 5)), FEATURES))]  # rest before
            for sign in signs:
                length = int(rng.integers(6, 12))
                path = np.linspace(0, 3, length)  # through the sign's key poses, at the signer's speed
                lo = np.floor(path).astype(int).clip(0, 2)
                w = (path - lo)[:, None]
                frames.append(
                    (1 - w) * shapes[sign - 1, lo]
                    + w * shapes[sign - 1, lo + 1]
                    + rng.normal(0, NOISE, (length, FEATURES))
                )
                frames.append(rng.normal(0, NOISE, (int(rng.integers(2, 5)), FEATURES)))  # a pause
            self.clips.append(torch.from_numpy(np.concatenate(frames).astype(np.float32)))
            self.labels.append(torch.from_numpy(signs.astype(np.int64)))

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, i: int) -> dict:
        return {"input": self.clips[i], "target": self.labels[i]}


def load_clips(train: int = 1200, val: int = 200, test: int = 200, seed: int = 0) -> dict:
    from saturate.data import pad_collate

    return {
        "train": Clips(train, seed),
        "val": Clips(val, seed + 1),
        "test": Clips(test, seed + 2),
        "collate": pad_collate,
    }


class GestureCTCNet(nn.Module):
    """A 2-layer bidirectional LSTM over the frames -> per-frame logits over the signs and the
    blank (B, T, num_classes)."""

    def __init__(self, input_dim: int = 126, hidden_dim: int = 128, num_classes: int = 11):
        super().__init__()
        self.lstm = nn.LSTM(input_dim, hidden_dim, num_layers=2, batch_first=True, bidirectional=True)
        self.classifier = nn.Linear(hidden_dim * 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.lstm(x)
        return self.classifier(x)
