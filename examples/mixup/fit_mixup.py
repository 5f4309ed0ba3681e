"""The mixup classifier from Python: saturate.fit with the LeNet class as the model factory,
the test split evaluated with best.pt. Extra arguments are overrides, as on train.py's
command line (mix.cutmix=1.0 adds CutMix).

    python examples/mixup/fit_mixup.py [mix.cutmix=1.0 trainer.max_epochs=10 ...]
"""

import sys

from mixup import LeNet, load_digits_rgb

import saturate

if __name__ == "__main__":
    data = load_digits_rgb()
    metrics = saturate.fit(
        LeNet,
        data["train"],
        data["val"],
        test_data=data["test"],
        overrides=[
            "mix.mixup=1.0",
            "augmentation=gpu",  # the author's RandomCrop(32, padding=4) and flip, batched on the device
            "augmentation.transforms=[{_target_:kornia.augmentation.RandomAffine,degrees:0,translate:[0.125,0.125],"
            "resample:nearest,padding_mode:zeros,p:1.0},"
            "{_target_:kornia.augmentation.RandomHorizontalFlip}]",
            *["optim.optimizer.lr=0.1", "optim.optimizer.nesterov=false", "optim.optimizer.weight_decay=1e-4"],
            *["optim.schedule=constant", "optim.warmup_epochs=0"],
            *["loader.batch_size=128", "loader.drop_last=false", "trainer.max_epochs=40"],
            *sys.argv[1:],
        ],
    )
    print(f"val/acc {metrics['val/acc']:.4f}, test/acc {metrics['test/acc']:.4f}")
