"""The HAR workload from Python: saturate.fit with a model factory, the test split, per-class
F1 and the confusion matrix. Extra arguments are overrides, as on train.py's command line.

    python examples/har/fit_har.py [trainer.max_epochs=5 ...]
"""

import sys

from har import HarLSTM, load_har

import saturate

if __name__ == "__main__":
    data = load_har()
    metrics = saturate.fit(
        lambda in_features, num_classes: HarLSTM(input_size=in_features, output_size=num_classes, n_hidden=64),
        data["train"],
        data["val"],
        test_data=data["test"],
        overrides=[
            # the author's Adam at a constant 1e-3, as saturate's adamw preset without decay or warm-up
            *["optim=adamw", "optim.optimizer.lr=0.001", "optim.optimizer.weight_decay=0"],
            *["optim.schedule=constant", "optim.warmup_epochs=0"],
            "loader.batch_size=64",
            "trainer.max_epochs=15",
            "trainer.grad_clip=10",
            "task.confusion_matrix=true",
            "+task.metrics.f1._target_=torchmetrics.classification.MulticlassF1Score",
            "+task.metrics.f1.num_classes=${data_info:num_classes}",
            "+task.metrics.f1.average=null",
            *sys.argv[1:],
        ],
    )
    print(
        f"test/acc {metrics['test/acc']:.4f}; F1 per activity: "
        + ", ".join(f"{k.removeprefix('test/f1/')} {v:.3f}" for k, v in metrics.items() if k.startswith("test/f1/"))
    )
