"""The U-Net segmenter from Python: saturate.fit with the UNet class as the model factory and
the author's recipe, plus what the author does not do: the Kornia transforms of this
example's config group (`augmentation=shapes_gpu`) moving each mask with its image on the
device. Extra arguments are overrides, as on train.py's command line.

    python examples/segmentation/fit_segment.py [trainer.max_epochs=3 trainer.predict=val ...]
"""

import sys
from functools import partial
from pathlib import Path

from segment import UNet, load_shapes

import saturate

if __name__ == "__main__":
    data = load_shapes()
    conf = Path(__file__).resolve().parent / "conf"
    metrics = saturate.fit(
        partial(UNet, out_channels=1, width=8, depth=4),
        data["train"],
        data["val"],
        task="segmentation",
        overrides=[
            f"hydra.searchpath=[file://{conf}]",
            "augmentation=shapes_gpu",
            *["task.input_key=image", "task.target_key=mask", "task.dice_weight=1.0"],
            *["optim=rmsprop", "optim.optimizer.lr=3e-4", "optim.optimizer.momentum=0.999"],
            "optim.optimizer.weight_decay=1e-8",
            "optim.scheduler={_target_:torch.optim.lr_scheduler.ReduceLROnPlateau,_partial_:true,patience:5}",
            "optim.warmup_epochs=0",
            *["loader.batch_size=16", "trainer.max_epochs=10", "trainer.eval_every=0.2", "trainer.grad_clip=1.0"],
            "trainer.channels_last=true",
            *sys.argv[1:],
        ],
    )
    print(f"val/dice {metrics['val/dice']:.4f}, val/iou {metrics['val/iou']:.4f}")
