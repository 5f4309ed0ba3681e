"""The variational autoencoder from Python: saturate.fit with the VAE class as the model
factory (given the data's 64 features), the author's summed loss as the task's loss. Extra
arguments are overrides, as on train.py's command line.

    python examples/vae/fit_vae.py [trainer.max_epochs=20 ...]
"""

import sys

from vae import VAE, load_digits_flat, vae_loss

import saturate

if __name__ == "__main__":
    data = load_digits_flat(n_test=297)
    metrics = saturate.fit(
        lambda in_features: VAE(features=in_features),
        data["train"],
        data["val"],
        task="regression",
        loss=vae_loss,  # loss_function(recon_x, x, mu, logvar), given the model's whole (recon, mu, logvar)
        overrides=[
            *[
                "task.loss_reduction=sum",
                "task.output_key=0",
                *("+task.metrics." + m + "=null" for m in ("mae", "rmse", "r2")),
            ],
            *["optim=adam", "optim.optimizer.lr=1e-3", "optim.schedule=constant", "optim.warmup_epochs=0"],
            *["loader.batch_size=128", "loader.drop_last=false", "trainer.max_epochs=400"],
            *sys.argv[1:],
        ],
    )
    print(f"val/loss {metrics['val/loss']:.4f} per image")
