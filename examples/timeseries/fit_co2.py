"""The same workload from Python: saturate.fit(model, train, val, ...). Extra arguments are
overrides, as on train.py's command line.

    python examples/timeseries/fit_co2.py [trainer.max_epochs=5 ...]
"""

import sys

from co2 import WindowCNN, load_co2

import saturate

if __name__ == "__main__":
    train, val = load_co2(window=52)
    overrides = ["optim=adamw", "loader.batch_size=64", "trainer.max_epochs=20", *sys.argv[1:]]
    metrics = saturate.fit(WindowCNN(in_features=3, num_outputs=1), train, val, task="regression", overrides=overrides)
    print(f"val/rmse {metrics['val/rmse']:.4f} (standardised units), val/r2 {metrics['val/r2']:.4f}")
