"""The DCGAN from Python: saturate.fit with the GAN class as the model factory, the task
object (the author's loop body as its training_step) and an Adam for each net, as
dcgan/main.py's loop has them. Extra arguments are overrides, as on train.py's command line.

    python examples/dcgan/fit_dcgan.py [trainer.max_epochs=5 ...]
"""

import sys

from dcgan import GAN, GANTask, load_digits32

import saturate

ADAM = "{_target_:torch.optim.Adam,_partial_:true,lr:2e-4,betas:[0.5,0.999]}"  # the author's, for each net

if __name__ == "__main__":
    data = load_digits32()
    metrics = saturate.fit(
        GAN,  # built after seeding: nz, ngf, ndf 32 by default; in_channels from the data
        data["train"],
        data["val"],
        task=GANTask(),
        overrides=[
            # `++`: set whether or not the optim preset names the key
            f"optim.optimizers={{D:{{params:netD,optimizer:{ADAM}}},G:{{params:netG,optimizer:{ADAM}}}}}",
            *["optim.schedule=constant", "optim.warmup_epochs=0"],
            *["loader.batch_size=64", "loader.drop_last=false", "trainer.max_epochs=20"],
            *sys.argv[1:],
        ],
    )
    print(f"val/fd_pixels {metrics['val/fd_pixels']:.4f}, val/loss {metrics['val/loss']:.4f}")
