"""The 128x128 grayscale workload from Python: saturate.fit with the user's Kornia modules as
augmentation.transforms (from this example's config group). Extra arguments are overrides.

    python examples/gray128/fit_gray128.py [trainer.max_epochs=3 ...]
"""

import sys
from pathlib import Path

from gray128 import GrayNet, load_gray

import saturate

if __name__ == "__main__":
    train, val = load_gray()
    conf = Path(__file__).resolve().parent / "conf"
    metrics = saturate.fit(
        GrayNet,
        train,
        val,
        overrides=[
            f"hydra.searchpath=[file://{conf}]",
            "augmentation=gray_gpu",
            "optim=adamw",
            "loader.batch_size=64",
            "trainer.max_epochs=12",
            *sys.argv[1:],
        ],
    )
    print(f"val/acc {metrics['val/acc']:.4f}")
