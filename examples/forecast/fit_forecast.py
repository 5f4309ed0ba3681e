"""The two-input forecaster from Python: saturate.fit with a factory given the data's two
input shapes, the author's Adam with its LR schedule (the full LR for two epochs, then halved
after each). Extra arguments are overrides, as on train.py's command line.

    python examples/forecast/fit_forecast.py [trainer.max_epochs=3 ...]
"""

import sys

from forecast import TwoInputForecaster, load_forecast

import saturate

if __name__ == "__main__":
    data = load_forecast()
    metrics = saturate.fit(
        # input_shapes: one per input, ((48, 5), (24, 6)): readings per hour, calendar features per future hour
        lambda input_shapes: TwoInputForecaster(readings=input_shapes[0][1], calendar=input_shapes[1][1]),
        data["train"],
        data["val"],
        task="regression",
        overrides=[
            "optim=adam",
            "optim.scheduler={_target_:torch.optim.lr_scheduler.LambdaLR,_partial_:true,"
            "lr_lambda:{_target_:hydra.utils.get_method,path:forecast.type1}}",  # the author's lradj type1
            *["optim.scheduler_interval=epoch", "optim.warmup_epochs=0"],
            *["loader.batch_size=32", "trainer.max_epochs=6"],
            *sys.argv[1:],
        ],
    )
    print(f"val/rmse {metrics['val/rmse']:.4f}, val/r2 {metrics['val/r2']:.4f}")
