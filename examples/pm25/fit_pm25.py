"""The PM2.5 workload from Python: saturate.fit with a model factory (built after seeding,
so two runs are identical), the test split and the target's inverse. Extra arguments are
overrides, as on train.py's command line.

    python examples/pm25/fit_pm25.py [trainer.max_epochs=20 ...]
"""

import sys

from pm25 import PM25CNN2D, load_pm25

import saturate
from saturate.callbacks import EarlyStopping

if __name__ == "__main__":
    data = load_pm25(window_size=30)
    metrics = saturate.fit(
        lambda input_shape: PM25CNN2D(window_size=input_shape[0], num_features=input_shape[1]),
        data["train"],
        data["val"],
        test_data=data["test"],
        target_inverse=data["target_inverse"],
        task="regression",
        callbacks=[EarlyStopping(patience=20)],
        overrides=[
            # the author's Adam (not fused) at a constant 1e-3, and their DataLoader(shuffle=True)'s order
            *["optim=adam", "optim.optimizer.lr=0.001", "optim.optimizer.weight_decay=0"],
            *["optim.optimizer.fused=false", "optim.schedule=constant", "optim.warmup_epochs=0"],
            *["loader.batch_size=32", "loader.order=global"],
            "trainer.max_epochs=200",
            "+task.metrics.mape._target_=torchmetrics.MeanAbsolutePercentageError",
            *sys.argv[1:],
        ],
    )
    print(
        "test (µg/m³): "
        + ", ".join(
            f"{k.removeprefix('test/').removesuffix('_raw')} {metrics[k]:.3f}"
            for k in ("test/r2_raw", "test/rmse_raw", "test/mae_raw", "test/mape_raw")
        )
    )
