"""The sign-language workload from Python: saturate.fit with task="sequence" and the padding
collate. Extra arguments are overrides, as on train.py's command line.

    python examples/sign/fit_sign.py [trainer.max_epochs=5 ...]
"""

import sys

from sign import GestureCTCNet, load_clips

import saturate

if __name__ == "__main__":
    data = load_clips()
    metrics = saturate.fit(
        lambda in_features, num_classes: GestureCTCNet(input_dim=in_features, num_classes=num_classes),
        data["train"],
        data["val"],
        test_data=data["test"],
        collate=data["collate"],
        task="sequence",
        overrides=[
            "optim=adamw",
            "optim.optimizer.lr=0.003",
            "optim.optimizer.weight_decay=0",
            *["optim.schedule=constant", "optim.warmup_epochs=0"],  # the author's loop: no LR schedule
            "loader.batch_size=32",
            "trainer.max_epochs=8",
            "trainer.grad_clip=5",
            *sys.argv[1:],
        ],
    )
    print(f"test/ter {metrics['test/ter']:.4f} (token error rate), test/seq_acc {metrics['test/seq_acc']:.4f}")
